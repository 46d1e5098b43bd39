"""Weights and configuration of a GGUF file (llama.cpp's format), every family maxkv serves.

Read the way transformers' GGUF loader reads them (its mapping is the
reference; the header by :mod:`maxkv.models.gguf_header`, the blocks with the
``gguf`` package's tables, installed with MAX): the metadata becomes a
``config.json`` dict through transformers' own ``GGUF_CONFIG_MAPPING``, read by
the family's configuration reader like any checkpoint's; the block-quantized
matrices maxkv's kernels read stay in the mapped file as their blocks
(:mod:`maxkv.models.held`), every other tensor is dequantized to float32 with
``gguf.quants.dequantize``; what llama.cpp's
converter changed is undone as transformers undoes it (the row permutation of
Llama's ``attn_q`` and ``attn_k``: its converter interleaves the two RoPE
halves of each head, maxkv like Hugging Face rotates ``(x[i], x[i + head_dim
/ 2])``; Gemma's norm weights, stored plus one); and the names become Hugging
Face's, which the graph uses.  Each family declares its layout
(:class:`~maxkv.models.family.GGUFLayout`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..cpu.quantized import HELD_TYPES
from .config import DecoderConfig, ModelLoadError, Weights
from .family import Family, GGUFLayout, gguf_families
from .gguf_header import GGUFHeader, read_header
from .held import FileBlocks, HeldTensor, HeldWeights, check_held

#: The tensors outside the layers, GGUF name -> Hugging Face name (every family).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str, layout: GGUFLayout) -> str | None:
    """The Hugging Face name of a GGUF tensor, or ``None`` if ``layout`` has no such tensor."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in layout.layer_tensors:
        return f"model.layers.{match.group(1)}.{layout.layer_tensors[match.group(2)]}"
    return None


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's ``permute`` of a Q or K projection ``[n_heads * head_dim, hidden]``.

    llama.cpp's converter reorders each head's rows from the half-split
    layout (first half, second half) to interleaved pairs; this restores the
    Hugging Face order.  ``n_heads`` is the number of heads of this projection
    (key/value heads for K).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"{rows} rows cannot be split into {n_heads} heads of pairs")
    half = rows // n_heads // 2
    return np.ascontiguousarray(
        weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _quant_types() -> Any:
    import gguf

    return gguf.GGMLQuantizationType


@functools.cache
def dequantizable(type_name: str) -> bool:
    """Whether ``gguf.quants.dequantize`` turns tensors of this GGML type into floats.

    F32, F16, BF16 and every block-quantized type ``gguf`` implements in
    NumPy (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K- and IQ-quants); not integer
    tensors, nor types it lacks (F64, Q8_1, Q8_K, ...).  Found by
    dequantizing one zero block.
    """
    import gguf
    from gguf import quants

    qtype = _quant_types()[type_name]
    if qtype in (qtype.F32, qtype.F16):
        return True
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def supported_tensor_types() -> list[str]:
    """Names of the GGML tensor types :func:`read_gguf` dequantizes."""
    return [t.name for t in _quant_types() if dequantizable(t.name)]


def _field(fields: Mapping[str, Any], key: str, default: object = None) -> Any:
    field = fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_family(fields: Mapping[str, Any]) -> Family:
    """The family of a GGUF file, by ``general.architecture`` (llama.cpp writes
    Mistral checkpoints as ``llama`` files, read as Llamas, as transformers does).

    Raises:
        ModelLoadError: On an architecture no registered family reads.
    """
    arch = _field(fields, "general.architecture")
    model_type = {"gemma3": "gemma3_text"}.get(arch, arch)
    families = gguf_families()
    if model_type not in families:
        readable = sorted({f.gguf.architecture for f in families.values() if f.gguf})
        raise ModelLoadError(
            f"unsupported architecture {arch!r}: maxkv reads GGUF files of "
            f"{', '.join(readable)} models"
        )
    return families[model_type]


def hf_config_from_metadata(fields: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A ``config.json`` dict of a GGUF file's metadata, keyed as transformers' GGUF
    loader keys it (its ``GGUF_CONFIG_MAPPING``), with the family's ``architectures``.

    Raises:
        ModelLoadError: On an unsupported architecture, missing shapes, or what
            the decoder does not implement (RoPE scaling, partial rotary).
    """
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    family = gguf_family(fields)
    assert family.gguf is not None
    arch = family.gguf.architecture
    mapping = cast(
        "Mapping[str, str | None]",
        GGUF_CONFIG_MAPPING[family.gguf.model_type.removesuffix("_text")],
    )
    raw: dict[str, Any] = {
        "model_type": family.gguf.model_type,
        "architectures": [family.architectures[0]],
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    for key, name in mapping.items():
        value = _field(fields, f"{arch}.{key}")
        if name is not None and value is not None:
            raw[name] = value
    for key in ("bos_token_id", "eos_token_id"):  # the tokenizer's, as llama.cpp reads them
        value = _field(fields, f"tokenizer.ggml.{key}")
        if value is not None:
            raw[key] = int(value)
    for key in ("attention.head_count", "embedding_length", "block_count", "feed_forward_length"):
        if _field(fields, f"{arch}.{key}") is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
    if "vocab_size" not in raw:
        tokens = fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.vocab_size and a token list")
        raw["vocab_size"] = len(tokens)  # one entry per token, none decoded
    heads = int(raw["num_attention_heads"])
    head_dim = int(_field(fields, f"{arch}.attention.key_length", raw["hidden_size"] // heads))
    # llama.cpp's head size (transformers' mapping reads it for Gemma only, and
    # takes its config class's default elsewhere: Qwen 3's 128).
    raw["head_dim"] = head_dim
    rope_dims = _field(fields, f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ModelLoadError(
            f"partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported"
        )
    scaling = _field(fields, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(f"RoPE scaling ({scaling or 'rope_freqs'}) is not supported")
    return raw


def config_from_metadata(fields: Mapping[str, Any], tensor_names: set[str]) -> DecoderConfig:
    """The :class:`DecoderConfig` of a GGUF file's metadata (see :func:`hf_config_from_metadata`).

    Raises:
        ModelLoadError: On another architecture, missing keys, or features
            this decoder does not implement (named).
    """
    return DecoderConfig.from_hf(hf_config_from_metadata(fields, tensor_names))


def open_gguf(path: Path) -> GGUFHeader:
    """The header of the GGUF file at ``path`` (:func:`~maxkv.models.gguf_header.read_header`).

    Raises:
        ModelLoadError: If the file is missing or its header cannot be read.
    """
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    return read_header(path)


class _File:
    """An open GGUF file: its reader, family layout and configuration."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = open_gguf(path)
        self.names = {tensor.name for tensor in self.reader.tensors}
        family = gguf_family(self.reader.fields)
        assert family.gguf is not None
        self.layout: GGUFLayout = family.gguf
        self.config = config_from_metadata(self.reader.fields, self.names)

    def hf_name(self, gguf_name: str) -> str | None:
        return hf_name(gguf_name, self.layout)

    def restore(self, gguf_name: str, hf: str, array: np.ndarray) -> np.ndarray:
        """``array`` (float32, Hugging Face shape) with llama.cpp's changes undone."""
        if self.layout.permuted_qk:
            if hf.startswith("model.layers.") and ".q_proj." in hf:
                return unpermute_rope_rows(array, self.config.num_attention_heads)
            if hf.startswith("model.layers.") and ".k_proj." in hf:
                return unpermute_rope_rows(array, self.config.num_key_value_heads)
        if self.layout.norm_shift and gguf_name.endswith("norm.weight"):
            shifted: np.ndarray = array - np.float32(self.layout.norm_shift)
            return shifted
        return array

    def blocks(self) -> FileBlocks:
        """The matrices of :data:`~maxkv.cpu.quantized.HELD_TYPES`, read when asked for."""
        held: dict[str, HeldTensor] = {}
        for tensor in self.reader.tensors:
            name = self.hf_name(tensor.name)
            shape = tuple(int(d) for d in reversed(tensor.shape))
            type_name = tensor.tensor_type.name
            if name is None or len(shape) != 2 or type_name not in HELD_TYPES:
                continue
            n, k = shape  # whole blocks, its bytes in the file: checked by the header reader
            heads = None
            if self.layout.permuted_qk and name.endswith("q_proj.weight"):
                heads = self.config.num_attention_heads
            elif self.layout.permuted_qk and name.endswith("k_proj.weight"):
                heads = self.config.num_key_value_heads
            order = None
            if heads is not None:
                order = unpermute_rope_rows(np.arange(n)[:, None], heads)[:, 0]
            raw = tensor.data  # uint8 [n, bytes per row]
            span = (int(tensor.data_offset), int(tensor.n_bytes))
            held[name] = HeldTensor(type_name, (n, k), raw, span, order, self.reader.mapping)
        return FileBlocks(held, source=self.path)


def read_gguf(
    path: str | Path, progress: Callable[[int, int], None] | None = None
) -> tuple[DecoderConfig, HeldWeights]:
    """Loads a GGUF file of any family with a GGUF layout: its configuration and
    weights (Hugging Face names), parsing the file once.

    Every matrix of a type in :data:`maxkv.cpu.quantized.HELD_TYPES` (Q4_0,
    Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K, IQ4_NL, IQ4_XS, F16, BF16) stays in
    the mapped file as its blocks or 16-bit values
    (:class:`~maxkv.models.held.FileBlocks`, Q and K rows unpermuted when
    read); every other tensor (norms, float32 matrices, the block types
    maxkv's kernels do not read) is dequantized to
    float32 with ``gguf.quants.dequantize`` and llama.cpp's changes undone.
    A held matrix read as float32 (``weights[name]``) is exactly what
    ``gguf.quants.dequantize`` gives for its bytes.

    Args:
        path: The ``.gguf`` file.
        progress: Called with (tensors done, tensors in all).

    Raises:
        ModelLoadError: On a missing, truncated or corrupt file, another
            architecture, a tensor type that cannot be dequantized (named in
            the message), an unexpected tensor, or a weight of the wrong shape.
    """
    from gguf import quants

    file = _File(Path(path))
    reader, config = file.reader, file.config
    unknown = sorted(n for n in file.names if file.hf_name(n) is None)
    if unknown:
        raise ModelLoadError(
            f"{file.path.name} holds tensors a {config.family} model does not have: "
            f"{', '.join(unknown[:5])}"
        )
    bad_types = sorted(
        {t.tensor_type.name for t in reader.tensors if not dequantizable(t.tensor_type.name)}
    )
    if bad_types:
        raise ModelLoadError(
            f"{file.path.name} uses tensor type {', '.join(bad_types)}, which maxkv cannot "
            f"dequantize (supported: {', '.join(supported_tensor_types())})"
        )
    blocks = file.blocks()
    dense: Weights = {}
    for done, tensor in enumerate(reader.tensors, 1):
        name = file.hf_name(tensor.name)
        assert name is not None
        if name not in blocks:
            try:
                array = quants.dequantize(tensor.data, tensor.tensor_type)
            except Exception as error:
                raise ModelLoadError(
                    f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {error}"
                ) from None
            expected = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne0 first
            array = np.asarray(array, dtype=np.float32).reshape(expected)
            dense[name] = file.restore(tensor.name, name, array)
        if progress is not None:
            progress(done, len(reader.tensors))
    return config, check_held(config, HeldWeights(dense, blocks))


def read_gguf_quantized(path: str | Path) -> FileBlocks:
    """The block-quantized matrices of a GGUF file, as stored (Hugging Face names):
    what :func:`read_gguf` holds as blocks (its ``weights.blocks``).

    Raises:
        ModelLoadError: On a file :func:`read_gguf` would refuse.
    """
    return _File(Path(path)).blocks()


def find_gguf(directory: Path) -> Path | None:
    """The one ``*.gguf`` file in ``directory``, ``None`` if there is none.

    Raises:
        ModelLoadError: If there are several (name the file instead).
    """
    files = sorted(directory.glob("*.gguf"))
    if len(files) > 1:
        listed = ", ".join(f.name for f in files)
        raise ModelLoadError(f"{directory} holds several GGUF files ({listed}); name one")
    return files[0] if files else None
