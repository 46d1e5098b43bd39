"""GGUF files at the sizes people deploy: random blocks in llama.cpp's Q4_K_M mix.

    python benchmarks/deployment_gguf.py llama-3.2-3b [--out DIR] [--mix q4_k_m|bf16]
    python benchmarks/deployment_gguf.py --list

Each file has the shapes of a real model (:data:`SHAPES`) and the tensor types
llama.cpp's ``llama-quantize ... Q4_K_M`` gives it (``llama_tensor_get_type``
in ``src/llama-quant.cpp``): Q4_K matrices; Q6_K for ``attn_v`` and
``ffn_down`` of the layers ``use_more_bits`` picks (the first and last eighth,
and every third between); Q6_K for the head (the embedding when tied) and Q4_K
for an untied embedding; float32 norms and biases.  Where a row is not a
multiple of 256 weights the K-quants fall back as llama.cpp's do (Q4_K to
Q5_0, Q6_K to Q8_0).  The blocks are random, their float16 scales set so that
each weight is about ``N(0, 1 / K)``: activations stay finite, the text is
nonsense.  ``--mix bf16`` writes every matrix as BF16 instead (a checkpoint
converted without quantizing, as ``convert_hf_to_gguf.py --outtype bf16``
gives it): random ``N(0, 1 / K)`` values.  The tokenizer and chat template
are a real model's, taken from a file maxkv already fetches (SmolLM2's for
Llama and Qwen shapes, its list padded with unreachable ``<|reserved_i|>``
tokens to the shape's vocabulary; Gemma 3 270M's, whose vocabulary Gemma 3
1B shares).

These files carry the memory and speed measurements at deployment sizes
(docs/benchmarks.md); exactness is checked on the real small models.  Writing
streams one tensor at a time (the 8B file is 4.9 GB) and is seeded: the same
arguments give the same bytes.
"""

from __future__ import annotations

import argparse
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Shape:
    """A model's shapes, as its ``config.json`` gives them."""

    architecture: str  # llama.cpp's general.architecture
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    context: int
    rope_theta: float
    qkv_bias: bool = False


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 64, 128256, True, 131072, 500000.0),
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128, 128256, True, 131072, 500000.0),
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128, 128256, False, 131072, 500000.0),
    "qwen2.5-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 128, 152064, False, 32768, 1e6, True),
    "gemma-3-1b": Shape("gemma3", 1152, 6912, 26, 4, 1, 256, 262144, True, 32768, 1e6),
}

#: Per GGML type: (weights per block, bytes per block, byte offsets of its float16
#: scales, the scale that makes a weight about N(0, 1) before dividing by sqrt(K)).
#: Q4_K: w = d sc q - dmin m (q < 16; sc, m < 64; dmin = 7.5 d centres it), std ~ 255 d;
#: Q6_K: w = d sc (q - 32) (int8 sc), std ~ 1370 d; Q5_0: d (q - 16), std ~ 9.2 d;
#: Q8_0: d q (int8 q), std ~ 74 d.
_TYPES = {
    "Q4_K": (256, 144, (0, 2), 1 / 255),
    "Q6_K": (256, 210, (208,), 1 / 1370),
    "Q5_0": (32, 22, (0,), 1 / 9.2),
    "Q8_0": (32, 34, (0,), 1 / 74),
}
#: llama.cpp's fallbacks for rows that are not a multiple of 256.
_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
#: The tensor mixes :func:`write` writes: llama.cpp's Q4_K_M, or every matrix BF16.
MIXES = ("q4_k_m", "bf16")


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers Q4_K_M gives Q6_K ``attn_v``/``ffn_down``."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensors(shape: Shape, mix: str = "q4_k_m") -> list[tuple[str, tuple[int, ...], str]]:
    """``(GGUF name, (rows, K) or (n,), GGML type)`` of every tensor, in file order."""
    s = shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (s.vocab, s.hidden), "Q6_K" if s.tied else "Q4_K")
    ]
    for i in range(s.layers):
        more = "Q6_K" if use_more_bits(i, s.layers) else "Q4_K"
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (s.hidden,), "F32"),
            (b + "attn_q.weight", (q, s.hidden), "Q4_K"),
            (b + "attn_k.weight", (kv, s.hidden), "Q4_K"),
            (b + "attn_v.weight", (kv, s.hidden), more),
            (b + "attn_output.weight", (s.hidden, q), "Q4_K"),
            (b + "ffn_gate.weight", (s.intermediate, s.hidden), "Q4_K"),
            (b + "ffn_up.weight", (s.intermediate, s.hidden), "Q4_K"),
            (b + "ffn_down.weight", (s.hidden, s.intermediate), more),
            (b + "ffn_norm.weight", (s.hidden,), "F32"),
        ]
        if s.qkv_bias:
            out += [
                (b + f"attn_{n}.bias", (w,), "F32") for n, w in (("q", q), ("k", kv), ("v", kv))
            ]
        if s.architecture == "gemma3":
            out += [
                (b + "attn_q_norm.weight", (s.head_dim,), "F32"),
                (b + "attn_k_norm.weight", (s.head_dim,), "F32"),
                (b + "post_attention_norm.weight", (s.hidden,), "F32"),
                (b + "post_ffw_norm.weight", (s.hidden,), "F32"),
            ]
    out.append(("output_norm.weight", (s.hidden,), "F32"))
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.hidden), "Q6_K"))
    if mix == "bf16":
        return [(n, dims, t if t == "F32" else "BF16") for n, dims, t in out]
    return [(n, dims, _FALLBACK.get(t, t) if dims[-1] % 256 else t) for n, dims, t in out]


def tensor_bytes(dims: tuple[int, ...], kind: str) -> int:
    """The bytes of a tensor of ``dims`` in GGML type ``kind``."""
    if kind in ("F32", "BF16"):
        return (4 if kind == "F32" else 2) * int(np.prod(dims))
    return dims[0] * dims[1] // _TYPES[kind][0] * _TYPES[kind][1]


def random_bf16(rows: int, k: int, seed: int) -> np.ndarray:
    """uint8 ``[rows, 2 k]``: random bfloat16 values of about ``N(0, 1 / k)``."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((rows, k), np.float32) / np.float32(np.sqrt(k))).view(np.uint32)
    return (values >> 16).astype("<u2").view(np.uint8)


def random_blocks(type_name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """uint8 ``[rows, bytes per row]``: random integers and sub-block scales, float16
    scales giving weights of about ``N(0, 1 / k)`` (see :data:`_TYPES`)."""
    per_block, size, fields, unit = _TYPES[type_name]
    rng = np.random.default_rng(seed)
    blocks = k // per_block
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    d = np.float16(unit / np.sqrt(k))
    raw[..., fields[0] : fields[0] + 2] = np.array([d], "<f2").view(np.uint8)
    if type_name == "Q4_K":  # dmin
        raw[..., 2:4] = np.array([d * np.float16(7.5)], "<f2").view(np.uint8)
    return raw.reshape(rows, blocks * size)


def _tokenizer_source(shape: Shape) -> Path:
    from maxkv.models.fetch import fetch

    return fetch("gemma3-270m" if shape.architecture == "gemma3" else "smollm2-135m")


def _copy_tokenizer(writer: Any, source: Path, vocab: int) -> None:
    """The source file's ``tokenizer.*`` keys, its token list padded to ``vocab``."""
    import gguf

    fields = gguf.GGUFReader(source).fields
    for key, field in fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            extra = vocab - len(value)
            if extra < 0:
                raise SystemExit(f"{source.name}'s vocabulary is larger than {vocab}")
            pad: list[Any]
            if key == "tokenizer.ggml.tokens":
                pad = [f"<|reserved_{i}|>" for i in range(extra)]
            elif key == "tokenizer.ggml.token_type":
                pad = [int(gguf.TokenType.NORMAL)] * extra
            else:
                pad = [0.0] * extra
            value = list(value) + pad
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, field.types[0])


def fixture_path(shape_name: str, out: Path, mix: str = "q4_k_m") -> Path:
    """Where :func:`write` puts the file: ``<out>/<shape_name>.<mix>.gguf``."""
    return out / f"{shape_name}.{mix}.gguf"


def write(shape_name: str, out: Path, seed: int = 0, mix: str = "q4_k_m") -> Path:
    """Writes :func:`fixture_path`'s file and returns its path."""
    import gguf
    from tqdm import tqdm

    shape = SHAPES[shape_name]
    path = fixture_path(shape_name, out, mix)
    out.mkdir(parents=True, exist_ok=True)
    arch = shape.architecture
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{shape_name} shapes, random {mix.upper()} tensors (maxkv benchmark fixture)")
    file_type = (
        gguf.LlamaFileType.MOSTLY_BF16 if mix == "bf16" else gguf.LlamaFileType.MOSTLY_Q4_K_M
    )
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6 if arch == "gemma3" else 1e-5)
    writer.add_vocab_size(shape.vocab)
    if arch == "gemma3":
        writer.add_sliding_window(512)
    _copy_tokenizer(writer, _tokenizer_source(shape), shape.vocab)
    layout = tensors(shape, mix)
    for name, dims, kind in layout:
        if kind == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
        elif kind == "BF16":
            byte_shape = (dims[0], 2 * dims[1])
            writer.add_tensor_info(
                name,
                byte_shape,
                np.dtype(np.uint8),
                tensor_bytes(dims, kind),
                raw_dtype=gguf.GGMLQuantizationType.BF16,
            )
        else:
            per_block, size, _, _ = _TYPES[kind]
            qtype = gguf.GGMLQuantizationType[kind]
            nbytes = dims[0] * dims[1] // per_block * size
            byte_shape = (dims[0], dims[1] // per_block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, kind in tqdm(layout, desc=path.name, unit="tensor", file=sys.stderr):
        if kind == "F32":
            # Norm weights 1 (Gemma's converter stores 1 + w: w = 0), biases 0.
            value = 0.0 if name.endswith(".bias") else 1.0
            writer.write_tensor_data(np.full(dims, value, np.float32))
        elif kind == "BF16":  # made a million weights at a time (no float32 copy)
            data = np.empty((dims[0], 2 * dims[1]), np.uint8)
            step = max(1, (1 << 20) // dims[1])
            for start in range(0, dims[0], step):
                rows = min(step, dims[0] - start)
                seed_rows = zlib.crc32(f"{seed}:{name}:{start}".encode())
                data[start : start + rows] = random_bf16(rows, dims[1], seed_rows)
            writer.write_tensor_data(data)
        else:
            writer.write_tensor_data(
                random_blocks(kind, dims[0], dims[1], zlib.crc32(f"{seed}:{name}".encode()))
            )
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", help=f"shapes to write: {', '.join(SHAPES)}")
    parser.add_argument(
        "--out", type=Path, default=None, help="folder (default: maxkv's cache, deployment/)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mix", choices=MIXES, default="q4_k_m", help="the tensor types")
    parser.add_argument("--list", action="store_true", help="list the shapes and file sizes")
    args = parser.parse_args(argv)
    unknown = [name for name in args.shapes if name not in SHAPES]
    if unknown:
        parser.error(f"unknown shape {unknown[0]}; choose from {', '.join(SHAPES)}")
    if args.list or not args.shapes:
        for name, shape in SHAPES.items():
            size = sum(tensor_bytes(dims, kind) for _, dims, kind in tensors(shape, args.mix))
            print(f"{name:14s} {shape.architecture:7s} {size / 1e9:5.2f} GB")
        return
    from maxkv.cachedir import cache_dir

    out = args.out or cache_dir() / "deployment"
    for name in args.shapes:
        print(write(name, out, args.seed, args.mix))


if __name__ == "__main__":
    main()
