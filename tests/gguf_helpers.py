"""Small Llama GGUF files written the way llama.cpp's converter writes them.

Independent of maxkv's loader: the metadata keys, the tensor names and the
row permutation of ``attn_q``/``attn_k`` follow llama.cpp's
``convert_hf_to_gguf.py``; quantization is ``gguf.quants.quantize``.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np

#: A tiny Llama: 2 layers, hidden 64, 4 query / 2 KV heads of 16, vocabulary 96.
TINY = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
}

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def hf_weights(
    config: Mapping[str, float], seed: int = 0, tied: bool = False
) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face names."""
    rng = np.random.default_rng(seed)
    h, d = int(config["hidden_size"]), int(config["head_dim"])
    q, kv = int(config["num_attention_heads"]) * d, int(config["num_key_value_heads"]) * d
    inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weights[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) * 0.2).astype(np.float32)
    return weights


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``DecoderModel.permute`` (convert_hf_to_gguf.py)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_llama_gguf(
    path: Path,
    weights: Mapping[str, np.ndarray],
    config: Mapping[str, float] = TINY,
    *,
    matrix_type: str = "F32",
    architecture: str = "llama",
    overrides: Mapping[str, str] | None = None,
) -> None:
    """Writes ``weights`` (Hugging Face names) as a llama.cpp-style GGUF file.

    Matrices are stored as ``matrix_type`` (``overrides`` maps a GGUF tensor
    name to another type); norms stay F32, as llama.cpp keeps them.
    """
    import gguf
    from gguf import quants

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config["num_key_value_heads"]))
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_dimension_count(int(config["head_dim"]))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    for hf, array in weights.items():
        name = gguf_name(hf)
        data = np.asarray(array, np.float32)
        if name.endswith("attn_q.weight"):
            data = llama_cpp_permute(data, heads)
        elif name.endswith("attn_k.weight"):
            data = llama_cpp_permute(data, kv_heads)
        kind = (overrides or {}).get(name, "F32" if data.ndim == 1 else matrix_type)
        qtype = gguf.GGMLQuantizationType[kind]
        if qtype == qtype.F32:
            writer.add_tensor(name, data)
        elif qtype == qtype.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            try:
                packed = quants.quantize(data, qtype)
            except NotImplementedError:  # gguf cannot write this type
                rows = int(np.prod(data.shape[:-1]))
                if kind in _F16_FIELDS:  # the K-quants: random blocks (not the weights)
                    rng = np.random.default_rng(zlib.crc32(name.encode()))
                    blocks = random_blocks(kind, rows, data.shape[-1], rng)
                    packed = blocks.reshape(*data.shape[:-1], -1)
                else:
                    packed = _raw_blocks(data, qtype)
            writer.add_tensor(name, packed, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


#: Byte offsets of each block's float16 fields (``d``, ``m`` / ``dmin``), from
#: ggml-common.h's block structs.
_F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random uint8 ``[rows, bytes per row]`` blocks of a GGML type: every integer and
    sub-block scale random, the float16 fields finite (0.001 to 0.05, either sign), so
    that any block a quantizer could write (and more) is covered."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[type_name]:
        value = rng.uniform(0.001, 0.05, (rows, cols // block)) * rng.choice([-1, 1], (rows, 1))
        raw[..., at : at + 2] = value.astype("<f2").view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def _raw_blocks(data: np.ndarray, qtype: object) -> np.ndarray:
    """Zero bytes of the right size for a type ``gguf`` cannot quantize."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]  # type: ignore[index]
    rows = int(np.prod(data.shape[:-1]))
    return np.zeros((rows, data.shape[-1] // block * size), np.uint8)


def dequantized(weights: Mapping[str, np.ndarray], matrix_type: str) -> dict[str, np.ndarray]:
    """What a correct loader must return: each matrix quantized and dequantized
    by ``gguf`` (in Hugging Face layout: the permutation is row-wise, and
    quantization blocks run along rows, so the two commute)."""
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[matrix_type]
    out = {}
    for name, array in weights.items():
        data = np.asarray(array, np.float32)
        if data.ndim == 1 or qtype == qtype.F32:
            out[name] = data
        elif qtype == qtype.F16:
            out[name] = data.astype(np.float16).astype(np.float32)
        else:
            out[name] = quants.dequantize(quants.quantize(data, qtype), qtype).reshape(data.shape)
    return out


#: Per family: llama.cpp's ``general.architecture``, whether its converter
#: permutes Q/K rows (``LlamaModel.permute``), and what it adds to norm weights
#: (``Gemma3Model.modify_tensors``: ``+ 1``), from ``convert_hf_to_gguf.py``.
LLAMA_CPP_FAMILIES = {
    "llama": ("llama", True, 0.0),
    "mistral": ("llama", True, 0.0),
    "qwen2": ("qwen2", False, 0.0),
    "qwen3": ("qwen3", False, 0.0),
    "gemma3": ("gemma3", False, 1.0),
}

_FAMILY_LAYER = {
    **_LAYER,
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GEMMA_LAYER = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def write_family_gguf(
    path: Path, family: str, hf_config: object, weights: Mapping[str, np.ndarray]
) -> None:
    """Writes a transformers checkpoint (``hf_config``, float32 ``weights`` under
    Hugging Face names) of ``family`` as llama.cpp's converter would: its
    architecture's metadata keys, tensor names, Q/K permutation (Llama and
    Mistral) and Gemma's norm weights plus one; matrices as Q8_0."""
    import gguf
    from gguf import quants

    arch, permuted, norm_shift = LLAMA_CPP_FAMILIES[family]
    c = hf_config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{family.capitalize()} tiny")
    writer.add_block_count(c.num_hidden_layers)  # type: ignore[attr-defined]
    writer.add_context_length(c.max_position_embeddings)  # type: ignore[attr-defined]
    writer.add_embedding_length(c.hidden_size)  # type: ignore[attr-defined]
    writer.add_feed_forward_length(c.intermediate_size)  # type: ignore[attr-defined]
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads  # type: ignore[attr-defined]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads  # type: ignore[attr-defined]
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = c.rope_parameters  # type: ignore[attr-defined]
    theta = (rope.get("full_attention") or rope)["rope_theta"]
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))  # type: ignore[attr-defined]
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if getattr(c, "sliding_window", None) and arch == "gemma3":
        writer.add_sliding_window(int(c.sliding_window))  # type: ignore[attr-defined]
    writer.add_vocab_size(c.vocab_size)  # type: ignore[attr-defined]
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    layer_names = {**_FAMILY_LAYER, **(_GEMMA_LAYER if arch == "gemma3" else {})}
    for hf, array in weights.items():
        if hf == "lm_head.weight" and getattr(c, "tie_word_embeddings", False):
            continue
        if hf.startswith("model.layers."):
            _, _, layer, rest = hf.split(".", 3)
            name = f"blk.{layer}.{layer_names[rest]}"
        else:
            name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[hf]
        data = np.asarray(array, np.float32)
        if permuted and ".attn_q." in name:
            data = llama_cpp_permute(data, heads)
        elif permuted and ".attn_k." in name:
            data = llama_cpp_permute(data, kv_heads)
        if name.endswith("norm.weight"):
            data = data + np.float32(norm_shift)
        if data.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quants.quantize(data, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
