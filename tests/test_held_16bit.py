"""A bfloat16 or float16 checkpoint held as its 16-bit values.

The checkpoints here are written by ``safetensors.torch`` from random float32
weights (torch rounds them to each tensor's dtype) in two shards with
transformers' index, and read back by transformers as float32: the
independent reference for maxkv's loader, its tile layout and its kernel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from max.engine import InferenceSession

from maxkv.cpu.quantized import Floats16, PackedFormat, TileBuilder, stacked_format
from maxkv.models import load_model
from maxkv.models.config import ModelLoadError
from maxkv.models.decoder import quantized_formats
from maxkv.models.held import HeldWeights

from .gguf_helpers import TINY, hf_weights
from .test_quantized import assert_steps_give_transformers_logits, held_registry

#: Tiles of 64 rows throughout (the vocabulary too), so the held bytes are the file's
#: plus one 256-byte ``sm`` row per tile.
CONFIG = {**TINY, "vocab_size": 128}
BF16 = PackedFormat(16, 1, False, "bfloat16")
F16 = PackedFormat(16, 1, False, "float16")


def _dtype_of(name: str) -> str:
    """Layer 0 and the head bfloat16, layer 1 and the embedding float16, norms bfloat16."""
    if name.startswith("model.layers.1.") and name.endswith("proj.weight"):
        return "float16"
    return "float16" if name == "model.embed_tokens.weight" else "bfloat16"


def write_checkpoint(directory: Path, seed: int = 3) -> dict[str, Any]:
    """Writes a two-shard Llama checkpoint of mixed bfloat16 / float16 tensors;
    returns them as torch tensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    directory.mkdir(parents=True, exist_ok=True)
    hf_config = LlamaConfig(**CONFIG, tie_word_embeddings=False)
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.save_pretrained(directory)
    tensors = {
        name: torch.from_numpy(array).to(getattr(torch, _dtype_of(name)))
        for name, array in hf_weights(CONFIG, seed=seed).items()
    }
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(directory / file), {"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def _bits(tensor: Any) -> np.ndarray:
    """A torch 16-bit tensor's bit patterns as uint16 (independent of maxkv's reader)."""
    import torch

    bits: np.ndarray = tensor.view(torch.int16).numpy().view(np.uint16)
    return bits


@pytest.mark.unit
def test_a_16_bit_checkpoint_is_held_as_its_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every matrix stays 16-bit from the file to the graph weights: no float32
    matrix is made (widening one fails the test), the tiles hold the file's bit
    patterns column by column, and the held bytes are within 1.1x the file's."""
    pytest.importorskip("torch")
    tensors = write_checkpoint(tmp_path / "ckpt")
    config, loaded = load_model(tmp_path / "ckpt")
    assert isinstance(loaded, HeldWeights)
    assert all(a.ndim == 1 and a.dtype == np.float32 for a in loaded.dense.values())
    matrices = {n for n, t in tensors.items() if t.ndim == 2}
    assert set(loaded.blocks) == matrices
    for name in matrices:
        assert loaded.blocks.format(name) == (F16 if _dtype_of(name) == "float16" else BF16)
    registry = held_registry(config, loaded, monkeypatch)
    formats = quantized_formats(registry)
    assert formats["layers.0.wqkv"] == BF16 and formats["layers.1.gate_up"] == F16
    assert formats["embed_tokens"] == F16 and formats["lm_head"] == BF16
    held = sum(registry[f"{stem}.{part}"].nbytes for stem in formats for part in ("q", "sm"))
    file_bytes = sum(2 * t.numel() for t in tensors.values() if t.ndim == 2)
    assert file_bytes <= held <= 1.1 * file_bytes
    # Tile t, row k, column j: the file's value of row 64 t + j, column k.
    o_proj = _bits(tensors["model.layers.0.self_attn.o_proj.weight"])
    tiles = registry["layers.0.wo.q"].view(np.uint16)
    np.testing.assert_array_equal(tiles.transpose(0, 2, 1).reshape(-1, o_proj.shape[1]), o_proj)
    q = _bits(tensors["model.layers.1.self_attn.q_proj.weight"])
    k = _bits(tensors["model.layers.1.self_attn.k_proj.weight"])
    v = _bits(tensors["model.layers.1.self_attn.v_proj.weight"])
    stacked = registry["layers.1.wqkv.q"].view(np.uint16).transpose(0, 2, 1).reshape(-1, q.shape[1])
    np.testing.assert_array_equal(stacked[: 2 * 64], np.concatenate([q, k, v]))
    # Read as float32 (references, tools), a matrix is the checkpoint's values.
    name = "model.layers.1.mlp.down_proj.weight"
    np.testing.assert_array_equal(loaded[name], tensors[name].float().numpy())


@pytest.mark.unit
def test_16_bit_types_do_not_mix_and_shards_do_not_repeat(tmp_path: Path) -> None:
    """bfloat16 rows cannot join float16 ones (nor blocks) in one tile layout; a
    tensor in two shards is refused by name; values that are not all of a type
    are refused."""
    pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match="16-bit floats stack with their own type only"):
        stacked_format([BF16, F16])
    with pytest.raises(ValueError, match="16-bit floats stack"):
        stacked_format([BF16, PackedFormat(8, 32)])
    values = np.ones((64, 32), np.float32)
    with pytest.raises(ValueError, match="does not fit"):
        TileBuilder(BF16, 64, 32).write(0, Floats16.of(values, "float16"))
    with pytest.raises(ValueError, match="not all float16"):
        Floats16.of(values + np.float32(1e-7), "float16")
    directory = tmp_path / "ckpt"
    write_checkpoint(directory)
    first, second = sorted(directory.glob("*.safetensors"))
    again = load_file(str(first))
    name = sorted(again)[0]
    save_file({**load_file(str(second)), name: again[name]}, str(second), {"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"holds {name} again"):
        load_model(directory)


@pytest.mark.compile
def test_a_16_bit_checkpoint_gives_transformers_logits(
    tmp_path: Path, session: InferenceSession
) -> None:
    """The graph over the 16-bit tiles (bfloat16 and float16 matmuls, the embedding
    gathered from float16 tiles) gives transformers' float32 logits on the same
    checkpoint: a prompt (panels), a step of 3 rows and steps of one."""
    pytest.importorskip("torch")
    from max.driver import CPU

    from maxkv import ContinuousBatchingKVCacheManager
    from maxkv.models.decoder import DecoderModel, cache_params
    from maxkv.models.hf import hf_from_pretrained

    directory = tmp_path / "ckpt"
    write_checkpoint(directory, seed=7)
    config, loaded = load_model(directory)
    hf: Any = hf_from_pretrained(directory)
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), 1, 64, config.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(config, loaded, manager, session, output="logits")
    assert model.quant_formats["embed_tokens"] == F16
    assert_steps_give_transformers_logits(model, manager, hf, (20, 3, 1, 1), seed=8)
