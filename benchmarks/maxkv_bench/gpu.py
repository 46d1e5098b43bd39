"""The GPU study: maxkv against MAX's own GPU kernels and pipeline, in parts.

Each part fits one call of a lent GPU machine (10 minutes) and merges its
results into one JSON file (``benchmarks/results/gpu_<kind>.json``), so a
study can span calls and sessions.  ``benchmarks/gpu_study.py`` is the command.

- ``reduce``: which construct breaks MAX's GPU compile of maxkv's model from 4
  layers on.  Variants of the graph compile in parallel subprocesses (each with
  its own timeout): the model at 2 and 4 layers, float32 and bfloat16,
  contiguous and paged; a stack of only maxkv's attention ops; a stack of its
  RoPE op alone (the smallest graph that failed); a stack of only MAX's own
  ops (RMSNorm, matmuls, SiLU), so a failure there is MAX's alone.  Runs
  without a GPU too (``--device virtual``).
- ``compile``: compile seconds of the full SmolLM2-shaped model (30 layers,
  bfloat16) vs MAX's own Llama pipeline on the same checkpoint, each in a fresh
  process with empty compile caches, one after the other (``--device
  virtual``: compiled on this machine for the target GPU).
- ``attention``: one decode step of flash attention, maxkv's collection vs MAX's
  paged kernel, bfloat16, 8 KV heads of 128 (Llama-3-8B's), batch 1-128 x
  context 512-8192, with the device's read bandwidth measured first by MAX's own
  reduction (``machine.device_read_bandwidth_gbps``).
- ``end_to_end``: tokens/s of maxkv's scheduler vs MAX's pipeline at batch 1, 8,
  32 and 128 on SmolLM2 and Llama-3-8B shapes, bfloat16 random weights (drawn
  on the GPU by ``torch`` when it is there, else NumPy), written once as a
  Hugging Face checkpoint that MAX's pipeline loads and maxkv takes as
  ``prepared`` graph weights; the tokens of both sides compared, and for
  SmolLM2's shape at batch 1 with the float64 NumPy reference on the same
  bfloat16-rounded weights.  The other families' published shapes
  (``benchmarks/family_models.py``: ``qwen2.5-0.5b`` with its QKV bias,
  ``qwen3-0.6b`` and ``gemma-3-1b`` with q/k norms, ``llama-3.2-1b``) run
  the same way from transformers' own config; at batch 1 their first sequence
  is compared with transformers' greedy tokens (float32 on the same weights).
  ``<shape>@tiny`` shrinks one to 2 layers of hidden 64 (the smoke test's).

``--smoke`` runs every part at toy sizes (the tiny model, float32, 2 layers) on
the CPU, which is how the test suite checks this module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from max.driver import Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops

from maxkv import kernels_path
from maxkv import ops as kvops
from maxkv.cache.device import MaxCacheDevice
from maxkv.cache.spec import CacheSpec
from maxkv.graph.types import collection_fetcher
from maxkv.models.config import DecoderConfig, default_llama, random_weight_recipe
from maxkv.models.decoder import (
    DecoderModel,
    bfloat16_bits,
    bfloat16_buffer,
    cache_params,
    matrix_sources,
    uses_packed_kernels,
    vector_sources,
)
from maxkv.models.export import llama_config_json
from maxkv.models.reference import greedy_reference
from maxkv.models.registry import family_for

from .attention import (
    AttentionShape,
    MaxkvDecodeAttention,
    MaxPagedDecodeAttention,
    bench_attention_decode,
)
from .machine import device_read_bandwidth_gbps, device_read_graph
from .real import MaxkvSide, MaxPipeline

PARTS = ("reduce", "compile", "export", "attention", "end_to_end")

#: The shapes measured (random weights); ``tiny`` is the smoke test's.
SHAPES: dict[str, DecoderConfig] = {
    "smollm2": DecoderConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        bos_token_id=1,
    ),
    "llama3_8b": DecoderConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_ids=(128001,),
        bos_token_id=128000,
    ),
    "tiny": default_llama()[0],
}

DTYPES = {"float32": DType.float32, "bfloat16": DType.bfloat16}

#: What ``<shape>@tiny`` sets over a family shape: 2 layers of hidden 64.
TINY_FIELDS: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)


def family_config_json(shape: str) -> dict[str, Any]:
    """The ``config.json`` of a family shape of ``benchmarks/family_models.py``
    (``<name>`` or ``<name>@tiny``), as transformers writes it, with the
    architecture maxkv and MAX's pipeline look up and the word-level
    tokenizer's special ids (:func:`write_checkpoint`)."""
    from family_models import SHAPES as FAMILY_SHAPES  # benchmarks/ is on sys.path
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name, _, size = shape.partition("@")
    if name not in FAMILY_SHAPES or size not in ("", "tiny"):
        raise SystemExit(
            f"unknown shape {shape!r}: choose from {sorted(SHAPES)} or "
            f"{sorted(FAMILY_SHAPES)} (each also as <name>@tiny)"
        )
    model_type, fields = FAMILY_SHAPES[name]
    fields = {**fields, **(TINY_FIELDS if size else {})}
    if size and "sliding_window" in fields:
        fields["sliding_window"] = 256  # maxkv's CPU windows: at least the SIMD width
    hf = AutoConfig.for_model(model_type, **fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    raw: dict[str, Any] = hf.to_dict()
    raw["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return raw


def shape_config(shape: str) -> tuple[DecoderConfig, dict[str, Any] | None]:
    """A shape's decoder configuration, and its ``config.json`` where it is not
    a plain Llama of :data:`SHAPES` (those are written by ``llama_config_json``)."""
    if shape in SHAPES:
        return SHAPES[shape], None
    raw = family_config_json(shape)
    return family_for(raw).read(raw), raw


def dtype_name(dtype: DType) -> str:
    """``dtype``'s name in :data:`DTYPES` (a checkpoint's ``torch_dtype``, MAX's encoding)."""
    return next(name for name, known in DTYPES.items() if known == dtype)


#: How a compile subprocess marks its one result line on stdout (MAX logs there too).
RESULT_MARK = "MAXKV_RESULT "


@dataclasses.dataclass(frozen=True)
class Variant:
    """One graph to compile: ``stack`` ``model`` (maxkv's Llama), ``attention``
    (only maxkv's attention ops, chained), ``rope`` (only its RoPE op, chained),
    ``max_ops`` (only MAX's own ops) or
    ``max_pipeline`` (MAX's Llama pipeline on a checkpoint of the shape)."""

    name: str
    stack: str
    shape: str
    layers: int
    dtype: str = "float32"
    cache: str = "contiguous"
    output: str = "tokens"


def reduce_variants(smoke: bool) -> list[Variant]:
    if smoke:
        return [
            Variant("model_L2", "model", "tiny", 2),
            Variant("model_L2_bf16_paged", "model", "tiny", 2, "bfloat16", "paged"),
            Variant("attention_L2", "attention", "tiny", 2),
            Variant("rope_L2", "rope", "tiny", 2),
            Variant("max_ops_L2", "max_ops", "tiny", 2),
        ]
    # The reduction that found the cause: the model fails from 4 layers on, and
    # so does a stack of RoPE ops alone (four consumers of one collection); a
    # stack of MAX's own ops does not.  tests/test_gpu_graph_compile.py keeps
    # the smallest one.
    return [
        Variant("rope_L2_f32", "rope", "smollm2", 2),
        Variant("rope_L4_f32", "rope", "smollm2", 4),
        Variant("rope_L4_f32_paged", "rope", "smollm2", 4, cache="paged"),
        Variant("attention_L4_f32", "attention", "smollm2", 4),
        Variant("max_ops_L4_f32", "max_ops", "smollm2", 4),
        Variant("model_L2_f32", "model", "smollm2", 2),
        Variant("model_L4_f32", "model", "smollm2", 4),
        Variant("model_L4_bf16", "model", "smollm2", 4, "bfloat16"),
        Variant("model_L4_bf16_paged", "model", "smollm2", 4, "bfloat16", "paged"),
    ]


def compile_variants(smoke: bool) -> list[Variant]:
    shape, layers, dtype = ("tiny", 2, "float32") if smoke else ("smollm2", 30, "bfloat16")
    return [
        Variant("maxkv", "model", shape, layers, dtype),
        Variant("max_pipeline", "max_pipeline", shape, layers, dtype),
    ]


# ----------------------------------------------------------------- graphs


def shaped(variant: Variant) -> DecoderConfig:
    return dataclasses.replace(SHAPES[variant.shape], num_hidden_layers=variant.layers)


def attention_stack(config: DecoderConfig, spec: CacheSpec, device: DeviceRef) -> Graph:
    """``layers`` x (fused QKV matmul into the cache, RoPE, flash attention), chained."""
    c, params = config, spec.params
    width = c.num_attention_heads * c.head_dim
    qkv = width + 2 * c.num_key_value_heads * c.head_dim
    types = [
        TensorType(params.dtype, ["tokens", width], device),
        TensorType(DType.uint32, ["offsets"], device),
        TensorType(DType.float32, [c.max_position_embeddings, c.head_dim], device),
        *(TensorType(params.dtype, [qkv, width], device) for _ in range(c.num_hidden_layers)),
        *spec.input_symbols([device])[0],
    ]
    with Graph("attention_stack", input_types=types, custom_extensions=[kernels_path()]) as g:
        x, offsets, freqs, *rest = (v.tensor for v in g.inputs)
        weights, cache = rest[: c.num_hidden_layers], rest[c.num_hidden_layers :]
        kv = collection_fetcher(spec)(*cache)
        for i, w in enumerate(weights):
            q = kvops.fused_qkv_ragged_matmul(params, x, offsets, w, kv, i)
            q = q.reshape(["tokens", c.num_attention_heads, c.head_dim])
            q = kvops.fused_qk_ragged_rope(params, q, offsets, kv, freqs, i, interleaved=False)
            x = kvops.flash_attention_ragged(params, q, offsets, kv, i).reshape(["tokens", width])
        g.output(x)
    return g


def rope_stack(config: DecoderConfig, spec: CacheSpec, device: DeviceRef) -> Graph:
    """``layers`` x RoPE over one collection, chained: the smallest graph that
    broke MAX's GPU compile (``docs/mojo.md``, "On a GPU")."""
    c, params = config, spec.params
    types = [
        TensorType(params.dtype, ["tokens", c.num_attention_heads, c.head_dim], device),
        TensorType(DType.uint32, ["offsets"], device),
        TensorType(DType.float32, [c.max_position_embeddings, c.head_dim], device),
        *spec.input_symbols([device])[0],
    ]
    with Graph("rope_stack", input_types=types, custom_extensions=[kernels_path()]) as g:
        x, offsets, freqs, *cache = (v.tensor for v in g.inputs)
        kv = collection_fetcher(spec)(*cache)
        for i in range(c.num_hidden_layers):
            x = kvops.fused_qk_ragged_rope(params, x, offsets, kv, freqs, i, interleaved=False)
        g.output(x)
    return g


def max_ops_stack(config: DecoderConfig, dtype: DType, device: DeviceRef) -> Graph:
    """The model's layers with every maxkv op taken out: MAX's own ops only."""
    c = config
    h_types = [TensorType(dtype, ["tokens", c.hidden_size], device)]
    per_layer = [
        TensorType(dtype, [c.hidden_size], device),
        TensorType(dtype, [c.hidden_size, c.hidden_size], device),
        TensorType(dtype, [2 * c.intermediate_size, c.hidden_size], device),
        TensorType(dtype, [c.hidden_size, c.intermediate_size], device),
    ]
    with Graph("max_ops_stack", input_types=h_types + per_layer * c.num_hidden_layers) as g:
        h: TensorValue = g.inputs[0].tensor
        values = [v.tensor for v in g.inputs[1:]]
        for i in range(c.num_hidden_layers):
            norm, wo, gate_up, down = values[4 * i : 4 * i + 4]
            x = ops.rms_norm(h, norm, epsilon=c.rms_norm_eps)
            h = h + x @ wo.T
            x = ops.rms_norm(h, norm, epsilon=c.rms_norm_eps)
            both = x @ gate_up.T
            h = h + (ops.silu(both[:, : c.intermediate_size]) * both[:, c.intermediate_size :]) @ (
                down.T
            )
        g.output(h)
    return g


def compile_variant(variant: Variant, device: Device, workdir: Path) -> dict[str, Any]:
    """Compiles ``variant`` on ``device``; seconds, or the error's telling lines."""
    session = InferenceSession(devices=[device])
    config, dtype = shaped(variant), DTYPES[variant.dtype]
    ref = DeviceRef.from_device(device)
    spec = CacheSpec(
        cache_params(config, dtype),
        config.num_hidden_layers,
        variant.cache,  # type: ignore[arg-type]
        128 if variant.cache == "paged" else None,
    )
    # Random weights and the checkpoint are made before the clock starts: each
    # side is timed loading its weights and compiling.
    weights: dict[str, np.ndarray] = {}
    directory = None
    if variant.stack == "model":
        recipe = random_weight_recipe(config, np.random.default_rng(0).standard_normal)
        weights = {n: np.asarray(w, np.float32) for n, w in recipe.items()}
    elif variant.stack == "max_pipeline":
        directory = write_checkpoint(config, dtype, workdir / "checkpoint", device)[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    if variant.stack == "model":
        DecoderModel(
            config,
            weights,
            spec,
            session,
            device=device,
            output=variant.output,  # type: ignore[arg-type]
        )
    elif variant.stack == "attention":
        session.load(attention_stack(config, spec, ref))
    elif variant.stack == "rope":
        session.load(rope_stack(config, spec, ref))
    elif variant.stack == "max_ops":
        session.load(max_ops_stack(config, dtype, ref))
    elif variant.stack == "max_pipeline" and directory is not None:
        MaxPipeline(directory, 4, 256, not device.is_host, variant.dtype)
    else:
        raise ValueError(f"unknown stack {variant.stack!r}")
    return {
        "ok": True,
        "seconds": round(time.perf_counter() - start, 1),
        # Every thread's CPU time: how far the compile spread over the cores.
        "cpu_seconds": round(time.process_time() - cpu_start, 1),
    }


def run_variants(
    variants: list[Variant],
    device_kind: str,
    target: str,
    *,
    jobs: int,
    timeout_s: float,
    fresh_caches: bool,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Each variant compiled in a subprocess (``jobs`` at once): a compile that
    hangs or crashes costs its own process, and a clean process times it."""

    def one(variant: Variant) -> dict[str, Any]:
        env = dict(os.environ)
        with tempfile.TemporaryDirectory(prefix=f"maxkv_{variant.name}_") as scratch:
            if fresh_caches:  # nothing compiled before: MAX's and maxkv's caches empty
                env["XDG_CACHE_HOME"] = env["HOME"] = scratch
                env["MAXKV_CACHE_DIR"] = str(Path(scratch) / "maxkv")
            command = [
                sys.executable,
                str(Path(__file__).resolve().parents[1] / "gpu_study.py"),
                "--device",
                device_kind,
                "--target",
                target,
                "--compile-variant",
                json.dumps(dataclasses.asdict(variant)),
                "--workdir",
                scratch,
            ]
            start = time.perf_counter()
            try:
                done = subprocess.run(
                    command, capture_output=True, text=True, timeout=timeout_s, env=env
                )
            except subprocess.TimeoutExpired:
                result: dict[str, Any] = {"ok": False, "error": f"no result in {timeout_s:.0f} s"}
            else:
                marked = [
                    line[len(RESULT_MARK) :]
                    for line in done.stdout.splitlines()
                    if line.startswith(RESULT_MARK)
                ]
                if marked:
                    result = json.loads(marked[-1])
                else:  # the process died before it could say
                    result = {"ok": False, "error": telling_lines(done.stderr + done.stdout)}
        result |= {"variant": dataclasses.asdict(variant)}
        result.setdefault("wall_s", round(time.perf_counter() - start, 1))
        log(f"  {variant.name}: {result}")
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, variants))


def telling_lines(text: str, limit: int = 12) -> str:
    """The lines of a compiler's output that say what failed."""
    keys = ("error", "uninitialized", "note:", "Error", "failed")
    lines = [line.strip() for line in text.splitlines() if any(k in line for k in keys)]
    return "\n".join((lines or text.strip().splitlines())[-limit:])


# ------------------------------------------------------------ checkpoints


def torch_sees_a_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def hf_random_weights(config: DecoderConfig, device: Device, seed: int = 0) -> dict[str, Any]:
    """:func:`~maxkv.models.config.random_weights`' recipe; ``torch`` tensors on the
    GPU when torch sees one (8B parameters in seconds), float32 NumPy otherwise."""
    if not device.is_host and torch_sees_a_gpu():
        import torch

        generator = torch.Generator(device="cuda").manual_seed(seed)
        return random_weight_recipe(
            config, lambda shape: torch.randn(shape, generator=generator, device="cuda")
        )
    rng = np.random.default_rng(seed)
    weights = random_weight_recipe(config, lambda shape: rng.standard_normal(shape, np.float32))
    return {name: np.asarray(w, np.float32) for name, w in weights.items()}


def write_checkpoint(
    config: DecoderConfig,
    dtype: DType,
    directory: Path,
    device: Device,
    config_json: Mapping[str, Any] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """A Hugging Face directory of random ``dtype`` weights (and a word-level
    tokenizer over the vocabulary, for MAX's pipeline); also returns the weights,
    as written (``torch`` tensors on the GPU, or NumPy).  ``config_json``: the
    checkpoint's ``config.json`` (:func:`shape_config`); default a Llama's."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    weights = hf_random_weights(config, device)
    name = dtype_name(dtype)
    if isinstance(next(iter(weights.values())), np.ndarray):
        if dtype == DType.bfloat16:
            stored = {n: bfloat16_bits(w) for n, w in weights.items()}
            _save_bfloat16_numpy(stored, directory / "model.safetensors")
            # The weights as written: bfloat16 values, widened back to float32.
            weights = {n: (b.astype(np.uint32) << 16).view(np.float32) for n, b in stored.items()}
        else:
            save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        import torch
        from safetensors.torch import save_file as save_torch

        torch_dtype = torch.bfloat16 if dtype == DType.bfloat16 else torch.float32
        weights = {n: w.to(torch_dtype).contiguous() for n, w in weights.items()}
        save_torch({n: w.cpu() for n, w in weights.items()}, str(directory / "model.safetensors"))
    raw = llama_config_json(config, name) if config_json is None else {**config_json}
    raw["torch_dtype"] = name
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = f"t{config.eos_token_ids[0]}" if config.eos_token_ids else "t0"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos).save_pretrained(directory)
    return directory, weights


def _save_bfloat16_numpy(bits: Mapping[str, np.ndarray], path: Path) -> None:
    """safetensors with BF16 tensors from their uint16 bit patterns (NumPy has no
    bfloat16): the format's header, then the raw little-endian bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in bits.items():
        header[name] = {
            "dtype": "BF16",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for array in bits.values():
            out.write(np.ascontiguousarray(array).tobytes())


def prepared_graph_weights(
    config: DecoderConfig, weights: Mapping[str, Any], dtype: DType
) -> dict[str, Any]:
    """maxkv's unpacked graph weights from Hugging Face ones: the same arrays
    (``torch`` tensors stay on their device; NumPy ones become host buffers of
    ``dtype``), Q/K/V and gate/up stacked as :func:`matrix_sources` says."""
    first = next(iter(weights.values()))
    if isinstance(first, np.ndarray):

        def convert(array: Any) -> Any:
            return bfloat16_buffer(array) if dtype == DType.bfloat16 else array

        def cat(arrays: list[Any]) -> Any:
            return np.concatenate(arrays)
    else:
        import torch

        def convert(array: Any) -> Any:
            return array.contiguous()

        def cat(arrays: list[Any]) -> Any:
            return torch.cat(arrays)

    out: dict[str, Any] = dict(config.rope_tables())
    for name, source in vector_sources(config).items():
        out[name] = convert(weights[source])
    if config.qkv_bias:
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            biases = [weights[p + f"{n}_proj.bias"] for n in "qkv"]
            out[f"layers.{i}.qkv_bias"] = convert(cat(biases))
    for name, parts in matrix_sources(config, packed=False).items():
        stacked = cat([weights[p] for p in parts]) if len(parts) > 1 else weights[parts[0]]
        out[name] = convert(stacked)
    return out


# ------------------------------------------------------------------ parts


def end_to_end(
    session: InferenceSession,
    device: Device,
    shapes: list[str],
    batches: list[int],
    *,
    dtype: DType,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    num_steps: int,
    workdir: Path,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Tokens/s of maxkv and MAX's pipeline per shape and batch (module docstring)."""
    rows: list[dict[str, Any]] = []
    gpu = not device.is_host
    for shape in shapes:
        config, config_json = shape_config(shape)
        rng = np.random.default_rng(1)
        prompts = [
            [int(t) for t in rng.integers(3, config.vocab_size, prompt_len)]
            for _ in range(max(batches))
        ]
        max_len = prompt_len + new_tokens + num_steps
        log(f"end to end {shape}: writing the checkpoint ...")
        directory, weights = write_checkpoint(config, dtype, workdir / shape, device, config_json)
        prepared = maxkv_weights(config, weights, dtype, device)
        reference_weights = None
        if config_json is None and shape != "llama3_8b":  # small enough for the float64 one
            reference_weights = {n: host_float32_array(w) for n, w in weights.items()}
        del weights
        log(f"end to end {shape}: compiling maxkv ...")
        start = time.perf_counter()
        maxkv_rows, maxkv_compile_s = _maxkv_side(
            session,
            device,
            config,
            prepared,
            dtype,
            prompts,
            batches,
            max_len,
            new_tokens,
            num_steps,
            repeats,
        )
        del prepared
        _release_torch_memory()
        log(f"end to end {shape}: loading MAX's pipeline ...")
        start = time.perf_counter()
        max_rows: list[tuple[float, list[list[int]]]] | None = None
        max_error = None
        try:
            theirs = MaxPipeline(directory, max(batches), max_len, gpu, dtype_name(dtype))
        except Exception as error:  # e.g. MAX's Qwen 3 needs a GPU: maxkv's rows stand
            max_error = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
            log(f"end to end {shape}: MAX's pipeline did not load: {max_error}")
        else:
            max_compile_s = time.perf_counter() - start
            max_rows = _time_side(
                lambda p, side=theirs: side.run(p, new_tokens), prompts, batches, repeats
            )
            del theirs
        for i, (batch, (ours_s, ours_out)) in enumerate(zip(batches, maxkv_rows, strict=True)):
            generated = batch * new_tokens
            row: dict[str, Any] = {
                "shape": shape,
                "layers": config.num_hidden_layers,
                "dtype": str(dtype),
                "batch": batch,
                "prompt_tokens": prompt_len,
                "new_tokens": new_tokens,
                "maxkv_tokens_per_s": round(generated / ours_s, 1),
                "maxkv_load_and_compile_s": round(maxkv_compile_s, 1),
            }
            # Sequence 0's prompt is in every batch: a side whose tokens for it
            # change with the batch computes some batch wrong (or in another order).
            row["maxkv_first_sequence_equals_batch_1"] = ours_out[0] == maxkv_rows[0][1][0]
            theirs_out: list[list[int]] | None = None
            if max_rows is None:
                row["max_pipeline_error"] = max_error
            else:
                theirs_s, theirs_out = max_rows[i]
                row |= {
                    "max_pipeline_tokens_per_s": round(generated / theirs_s, 1),
                    "same_tokens": ours_out == theirs_out,
                    "same_token_fraction": round(_agreement(ours_out, theirs_out), 4),
                    "same_first_token_fraction": round(
                        _agreement([o[:1] for o in ours_out], [t[:1] for t in theirs_out]), 4
                    ),
                    "max_pipeline_first_sequence_equals_batch_1": (
                        theirs_out[0] == max_rows[0][1][0]
                    ),
                    # Per sequence, the first new token where the sides differ (0: the
                    # prefill's token; -1: none): a prefill or a decode fault.
                    "first_difference_at": [
                        _first_difference(o, t) for o, t in zip(ours_out, theirs_out, strict=True)
                    ],
                    "max_pipeline_load_and_compile_s": round(max_compile_s, 1),
                }
                row["speedup_vs_max_pipeline"] = round(
                    row["maxkv_tokens_per_s"] / row["max_pipeline_tokens_per_s"], 3
                )
            if batch == batches[0] and (reference_weights is not None or config_json is not None):
                if reference_weights is not None:
                    reference = greedy_reference(config, reference_weights, prompts[0], new_tokens)
                else:
                    reference = transformers_greedy(directory, prompts[0], new_tokens)
                    row["reference"] = "transformers float32"
                row["maxkv_first_sequence_equals_reference"] = ours_out[0] == reference
                if theirs_out is not None:
                    row["max_pipeline_first_sequence_equals_reference"] = theirs_out[0] == reference
                row["maxkv_first_sequence_reference_agreement"] = round(
                    _agreement([ours_out[0]], [reference]), 4
                )
            log(f"  {row}")
            rows.append(row)
        _release_torch_memory()
    return rows


def transformers_greedy(directory: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens for ``prompt`` on the checkpoint in ``directory``
    (float32 on the host CPU: its own modeling code, the families' reference)."""
    from maxkv.models.hf import hf_from_pretrained, hf_generate

    model = hf_from_pretrained(directory)
    tokens: list[int] = hf_generate(model, [prompt], new_tokens)[0]
    del model
    return tokens


def _maxkv_side(
    session: InferenceSession,
    device: Device,
    config: DecoderConfig,
    prepared: Mapping[str, Any],
    dtype: DType,
    prompts: list[list[int]],
    batches: list[int],
    max_len: int,
    new_tokens: int,
    num_steps: int,
    repeats: int,
) -> tuple[list[tuple[float, list[list[int]]]], float]:
    """maxkv's rows of :func:`_time_side` and the seconds to load and compile it.
    ``prepared``: graph weights, or Hugging Face ones where maxkv packs them (float32
    on the CPU)."""

    def build(manager: Any) -> DecoderModel:
        return maxkv_model(config, prepared, manager, session, device, dtype)

    start = time.perf_counter()
    ours = MaxkvSide(session, device, config, max_len, build, dtype)
    ours.run(prompts[:1], 2, num_steps)
    compile_s = time.perf_counter() - start
    rows = _time_side(lambda p: ours.run(p, new_tokens, num_steps), prompts, batches, repeats)
    return rows, compile_s


def maxkv_weights(
    config: DecoderConfig, weights: Mapping[str, Any], dtype: DType, device: Device
) -> dict[str, Any]:
    """What :func:`maxkv_model` takes from a checkpoint's weights: Hugging Face
    ones as float32 NumPy where maxkv packs them (float32 on the CPU), else the
    graph weights (:func:`prepared_graph_weights`)."""
    if uses_packed_kernels(DeviceRef.from_device(device), dtype):
        return {n: host_float32_array(w) for n, w in weights.items()}
    return prepared_graph_weights(config, weights, dtype)


def maxkv_model(
    config: DecoderConfig,
    prepared: Mapping[str, Any],
    cache: Any,
    session: InferenceSession,
    device: Device,
    dtype: DType,
) -> DecoderModel:
    """maxkv's model as the end-to-end part builds it, over a manager or (to
    compile it alone, as the ``export`` part does) a :class:`CacheSpec`."""
    packed = uses_packed_kernels(DeviceRef.from_device(device), dtype)
    on = {"device": device} if isinstance(cache, CacheSpec) else {}
    if packed:
        return DecoderModel(config, prepared, cache, session, **on)  # type: ignore[arg-type]
    return DecoderModel(config, None, cache, session, prepared=prepared, **on)


def _time_side(
    run: Callable[[list[list[int]]], list[list[int]]],
    prompts: list[list[int]],
    batches: list[int],
    repeats: int,
) -> list[tuple[float, list[list[int]]]]:
    """(median seconds, outputs) per batch, after a warm-up run of each."""
    out = []
    for batch in batches:
        outputs = run(prompts[:batch])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(prompts[:batch])
            times.append(time.perf_counter() - start)
        out.append((float(np.median(times)), outputs))
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where ``a`` and ``b`` differ, or -1."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), -1)


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def host_float32_array(array: Any) -> np.ndarray:
    """A NumPy or torch array as float32 NumPy (torch's bfloat16 widened)."""
    if isinstance(array, np.ndarray):
        return array.astype(np.float32)
    return array.float().cpu().numpy()  # type: ignore[no-any-return]


def _release_torch_memory() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def attention(
    session: InferenceSession,
    device: Device,
    *,
    smoke: bool,
    log: Callable[[str], None],
) -> tuple[float, list[dict[str, Any]]]:
    """(device read GB/s, decode-attention rows) (module docstring)."""
    bandwidth = device_read_bandwidth_gbps(session, device, gib=attention_read_gib(smoke))
    log(f"attention: read bandwidth {bandwidth:.1f} GB/s")
    shape, batches, contexts = attention_shape(smoke)
    rows = bench_attention_decode(
        session,
        device,
        batches,
        contexts,
        warmup=2,
        repeats=5 if smoke else 20,
        shape=shape,
        read_bandwidth_gbps=bandwidth,
        period=256,
        max_tokens=None if smoke else ATTENTION_MAX_TOKENS,
    )
    for row in rows:
        log(f"  {row}")
    return bandwidth, rows


def attention_read_gib(smoke: bool) -> float:
    """GiB the attention part's bandwidth measurement reads."""
    return 0.0625 if smoke else 4.0


#: The attention part's largest batch x context: 128 x 8,192 tokens would take
#: the host longer to make than a lent machine's call lasts.
ATTENTION_MAX_TOKENS = 32 * 8192


def attention_shape(smoke: bool) -> tuple[AttentionShape, list[int], list[int]]:
    """The attention part's cache shape, batches and contexts."""
    if smoke:
        return AttentionShape(2, 16, max_batch=2, max_context=128, page_size=16), [1, 2], [64, 128]
    shape = AttentionShape(8, 128, max_batch=128, max_context=8192, dtype=DType.bfloat16)
    return shape, [1, 8, 32, 128], [512, 2048, 8192]


def use_mef_store(
    export: Path | None, precompiled: list[Path] | None, log: Callable[[str], None]
) -> None:
    """Every session of this process writes each graph it compiles to ``export``,
    or loads graphs from the artifacts in ``precompiled`` instead of compiling
    them (MAX's ``InferenceSession.default_mef_store``; MAX's pipeline consults
    it too).  A graph without an artifact is compiled as usual (and logged).

    Artifacts are named by the graph's name and a digest of its body (MAX's
    ``_fingerprint``, which leaves out where the kernels lie), not MAX's default
    name and signature: two shapes' pipelines build same-named graphs with the
    same symbolic signature (``top_k_sampler`` over another vocabulary), which
    the default cannot tell apart, and would load one for the other."""
    from max.engine._precompiled_mefs import MefStore, _fingerprint

    def body_key(graph: Graph) -> str:
        name = re.sub(r"[^A-Za-z0-9._-]", "_", graph.name)
        return f"{name}-{_fingerprint(graph)[:16]}.mef"

    if export is not None:
        InferenceSession.default_mef_store = MefStore.for_export(export, key=body_key)
        return
    if not precompiled:
        return
    MefStore.for_import(precompiled)  # MAX's own errors for a folder it did not write
    recorded = {
        entry["key"]
        for directory in precompiled
        for entry in json.loads((directory / "manifest.json").read_text())["graphs"]
    }

    def key(graph: Graph) -> str | None:
        name = body_key(graph)
        if name in recorded:
            return name
        log(f"  no precompiled artifact for graph {graph.name!r}: compiling it")
        return None

    InferenceSession.default_mef_store = MefStore.for_import(precompiled, key=key)
    log(f"precompiled graphs: {len(recorded)} from {', '.join(map(str, precompiled))}")


def export_graphs(
    session: InferenceSession,
    device: Device,
    shapes: list[str],
    batches: list[int],
    *,
    smoke: bool,
    dtype: DType,
    max_len: int,
    workdir: Path,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Compiles the graphs of the ``attention`` and ``end_to_end`` parts without
    running them or allocating a cache, so on a virtual device: with
    ``--export-mefs`` a machine without a GPU compiles what a lent GPU machine
    then loads (``--precompiled-mefs``) in seconds.  Seconds per graph."""
    ref = DeviceRef.from_device(device)
    rows: list[dict[str, Any]] = []

    def timed(name: str, build: Callable[..., object], *args: Any) -> None:
        start = time.perf_counter()
        build(*args)
        rows.append({"graph": name, "seconds": round(time.perf_counter() - start, 1)})
        log(f"  {rows[-1]}")

    shape = attention_shape(smoke)[0]
    timed("device_read", session.load, device_read_graph(ref, attention_read_gib(smoke)))
    timed("maxkv_decode_attention", session.load, MaxkvDecodeAttention.graph(shape, ref))
    timed("max_paged_decode_attention", session.load, MaxPagedDecodeAttention.graph(shape, ref))
    for name in shapes:
        config, config_json = shape_config(name)
        # Without a GPU torch draws the weights in host memory, as float32.
        needed = 4 * sum(math.prod(shape) for shape in config.weight_shapes().values())
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if not torch_sees_a_gpu() and 2 * needed > memory:
            raise SystemExit(
                f"exporting {name} draws {needed / 2**30:.0f} GiB of weights in this "
                f"machine's {memory / 2**30:.0f} GiB: choose --shapes smollm2"
            )
        directory, weights = write_checkpoint(config, dtype, workdir / name, device, config_json)
        prepared = maxkv_weights(config, weights, dtype, device)
        del weights
        spec = CacheSpec(cache_params(config, dtype), config.num_hidden_layers)
        timed(f"maxkv {name}", maxkv_model, config, prepared, spec, session, device, dtype)
        del prepared
        # The manager's own graphs (lengths increment, token copies).
        timed(f"maxkv cache {name}", MaxCacheDevice(spec, [device], session).warm_up)
        gpu = not device.is_host
        pipeline_args = (directory, max(batches), max_len, gpu, dtype_name(dtype))
        timed(f"max_pipeline {name}", MaxPipeline, *pipeline_args)
    return rows


def merge_into(path: Path, update: Mapping[str, Any]) -> dict[str, Any]:
    """``path``'s JSON updated with ``update`` and written back, so that parts of a
    study run in different calls land in one file: dicts are merged key by key,
    lists of rows row by row (a new row replaces the old one of the same shape,
    batch, context or variant), anything else replaced."""
    results: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    for key, value in update.items():
        old = results.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            results[key] = old | value
        elif isinstance(value, list) and isinstance(old, list):
            new_keys = {_row_key(row) for row in value}
            results[key] = [row for row in old if _row_key(row) not in new_keys] + value
        else:
            results[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return results


def _row_key(row: Any) -> str:
    if not isinstance(row, dict):
        return json.dumps(row)
    fields = ("shape", "layers", "dtype", "batch", "context", "variant")
    return json.dumps({f: row[f] for f in fields if f in row}, sort_keys=True)
