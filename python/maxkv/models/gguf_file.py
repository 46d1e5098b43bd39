"""Llama weights and configuration from a GGUF file (llama.cpp's format).

Read with the ``gguf`` package (installed with MAX): the metadata gives the
configuration, every tensor is dequantized to float32 with
``gguf.quants.dequantize``, llama.cpp's row permutation of ``attn_q`` and
``attn_k`` is undone (its converter interleaves the two RoPE halves of each
head; maxkv, like Hugging Face, rotates ``(x[i], x[i + head_dim / 2])``), and
the names are mapped to Hugging Face's, which the graph uses.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..cpu.quantized import GGUF_TYPES, BlockQuantized, from_gguf_blocks
from .config import DecoderConfig, ModelLoadError, Weights, check_weights

#: GGUF architectures this loader reads (Mistral-family files also say "llama").
SUPPORTED_ARCHITECTURES = ("llama",)

#: GGUF tensor name -> Hugging Face name; ``{i}`` is the layer.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or ``None`` if it is not a Llama weight."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
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


def config_from_metadata(fields: Mapping[str, Any], tensor_names: set[str]) -> DecoderConfig:
    """A :class:`DecoderConfig` from GGUF metadata (``general.architecture`` ``llama``).

    Raises:
        ModelLoadError: On another architecture, missing keys, or features
            this decoder does not implement (RoPE scaling, partial rotary).
    """
    arch = _field(fields, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}: maxkv reads GGUF files of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} models"
        )

    def need(key: str) -> Any:
        value = _field(fields, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    kv_heads = int(_field(fields, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(fields, f"{arch}.attention.key_length", hidden // heads))
    rope_dims = _field(fields, f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ModelLoadError(
            f"partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported"
        )
    scaling = _field(fields, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(f"RoPE scaling ({scaling or 'rope_freqs'}) is not supported")
    tokens = _field(fields, "tokenizer.ggml.tokens")
    vocab = _field(fields, f"{arch}.vocab_size")
    if vocab is None:
        if tokens is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.vocab_size and a token list")
        vocab = len(tokens)
    eos = _field(fields, "tokenizer.ggml.eos_token_id")
    bos = _field(fields, "tokenizer.ggml.bos_token_id")
    return DecoderConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_field(fields, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(fields, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(fields, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=None if bos is None else int(bos),
    )


def open_gguf(path: Path) -> Any:
    """``gguf.GGUFReader`` over ``path``, with read errors as :class:`ModelLoadError`."""
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as error:  # truncated, not GGUF, unsupported version, ...
        raise ModelLoadError(f"cannot read GGUF file {path}: {error}") from None


def read_gguf(
    path: str | Path, progress: Callable[[int, int], None] | None = None
) -> tuple[DecoderConfig, Weights]:
    """Loads a Llama GGUF file: configuration and float32 weights (Hugging Face names).

    Args:
        path: The ``.gguf`` file.
        progress: Called with (tensors done, tensors in all) while dequantizing.

    Raises:
        ModelLoadError: On a missing, truncated or corrupt file, another
            architecture, a tensor type that cannot be dequantized (named in
            the message), an unexpected tensor, or a weight of the wrong shape.
    """
    from gguf import quants

    path = Path(path)
    reader = open_gguf(path)
    names = {tensor.name for tensor in reader.tensors}
    config = config_from_metadata(reader.fields, names)
    unknown = sorted(n for n in names if hf_name(n) is None)
    if unknown:
        raise ModelLoadError(
            f"{path.name} holds tensors a Llama does not have: {', '.join(unknown[:5])}"
        )
    bad_types = sorted(
        {t.tensor_type.name for t in reader.tensors if not dequantizable(t.tensor_type.name)}
    )
    if bad_types:
        raise ModelLoadError(
            f"{path.name} uses tensor type {', '.join(bad_types)}, which maxkv cannot "
            f"dequantize (supported: {', '.join(supported_tensor_types())})"
        )
    weights: Weights = {}
    for done, tensor in enumerate(reader.tensors, 1):
        name = hf_name(tensor.name)
        assert name is not None
        try:
            array = quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as error:
            raise ModelLoadError(
                f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {error}"
            ) from None
        expected = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne0 first
        array = np.asarray(array, dtype=np.float32).reshape(expected)
        if name.endswith("q_proj.weight"):
            array = unpermute_rope_rows(array, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = unpermute_rope_rows(array, config.num_key_value_heads)
        weights[name] = array
        if progress is not None:
            progress(done, len(reader.tensors))
    return config, check_weights(config, weights)


def read_gguf_quantized(path: str | Path) -> dict[str, BlockQuantized]:
    """The block-quantized matrices of a Llama GGUF file, as stored (Hugging Face names).

    Every 2-D tensor of type Q4_0, Q4_1 or Q8_0 (:data:`maxkv.cpu.quantized.GGUF_TYPES`)
    as a :class:`~maxkv.cpu.quantized.BlockQuantized` ``[N, K]``, Q and K rows
    unpermuted as :func:`read_gguf` does; other types are left out.  What
    :func:`read_gguf` returns for these tensors is exactly their
    :meth:`~maxkv.cpu.quantized.BlockQuantized.dequantize`.

    Raises:
        ModelLoadError: On a file :func:`read_gguf` would refuse.
    """
    path = Path(path)
    reader = open_gguf(path)
    names = {tensor.name for tensor in reader.tensors}
    config = config_from_metadata(reader.fields, names)
    out: dict[str, BlockQuantized] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if name is None or len(shape) != 2 or tensor.tensor_type.name not in GGUF_TYPES:
            continue
        try:
            matrix = from_gguf_blocks(tensor.tensor_type.name, tensor.data, (shape[0], shape[1]))
        except ValueError as error:
            raise ModelLoadError(f"cannot read {tensor.name}: {error}") from None
        heads = None
        if name.endswith("q_proj.weight"):
            heads = config.num_attention_heads
        elif name.endswith("k_proj.weight"):
            heads = config.num_key_value_heads
        if heads is not None:
            order = unpermute_rope_rows(np.arange(shape[0])[:, None], heads)[:, 0]
            matrix = matrix.rows(order)
        out[name] = matrix
    return out


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
