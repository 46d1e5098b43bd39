"""The cache's encodings side by side: capacity, decode attention, quality.

    cd benchmarks
    python kv_encodings.py capacity  --json results/kv_encodings_capacity.json
    python kv_encodings.py attention --json results/kv_encodings_attention.json
    python kv_encodings.py quality   --json results/kv_encodings_quality.json

``capacity``: tokens each encoding holds in a fixed cache budget (1 GiB), from
``KVCacheParams.token_bytes`` (scales included), for real model shapes.

``attention``: one decode step of maxkv's CPU attention (one new token per
sequence) over a paged cache of each encoding, batch 1-32 x context
512-8192, GQA shapes of SmolLM2 (9 query / 3 KV heads of 64) and Llama-3.2-1B
(32 / 8 of 64); median ms, the KV bytes it reads per second against the
machine's read bandwidth (measured in the same run), the speed-up over
float32 KV, and the largest difference from float32 KV's output.  The cache
is filled by ``write_kv_ragged`` (each encoding quantizes on write).

``quality``: SmolLM2-135M-Instruct (the README's model) reads the GPL-3 text
(``/usr/share/common-licenses/GPL-3``, its first ``--tokens`` tokens) one
token per step, once per encoding in lockstep, the paged cache in that
encoding: perplexity, its difference from float32 KV's, the mean KL
divergence of the next-token distributions against float32 KV's and the
top-1 agreement (llama.cpp's ``perplexity --kl-divergence`` figures); then the
README's 8 chat questions, greedy, 64 new tokens: answers equal to float32
KV's.  ``--encodings int8,int4`` runs some encodings (and float32).
``--random-shape llama-3.2-1b`` does the KL part on random weights of
that shape (no tokenizer: a random token stream).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

GPL = Path("/usr/share/common-licenses/GPL-3")
#: Every encoding maxkv implements; ``--encodings`` picks some (float32, the
#: reference, always runs).
ENCODINGS = ("float32", "bfloat16", "float16", "float8_e4m3fn", "int8", "int4")
#: (query heads, KV heads, head_dim, layers) of real models.
SHAPES = {
    "smollm2-135m": (9, 3, 64, 30),
    "llama-3.2-1b": (32, 8, 64, 16),
    "llama-3.1-8b": (32, 8, 128, 32),
    "qwen2.5-0.5b": (14, 2, 64, 24),
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- capacity


def capacity(args: argparse.Namespace) -> dict[str, Any]:
    from max.dtype import DType

    from maxkv import KVCacheParams

    budget = 2**30
    rows = []
    for name, (_, kv_heads, head_dim, layers) in SHAPES.items():
        base = KVCacheParams(DType.float32, kv_heads, head_dim).token_bytes(layers)
        for encoding in args.encodings:
            params = KVCacheParams(DType.float32, kv_heads, head_dim, cache_dtype=encoding)
            per_token = params.token_bytes(layers)
            rows.append(
                {
                    "model": name,
                    "encoding": encoding,
                    "bytes_per_token": per_token,
                    "tokens_per_GiB": budget // per_token,
                    "x_float32": round(base / per_token, 3),
                }
            )
            print(
                f"{name:14s} {encoding:13s} {per_token:7d} B/token "
                f"{budget // per_token:8d} tokens/GiB  {base / per_token:.2f}x",
                flush=True,
            )
    return {"budget_bytes": budget, "rows": rows}


# --------------------------------------------------------------- attention


class EncodedDecode:
    """A paged cache of one encoding, its write graph and its decode-attention graph."""

    def __init__(
        self, encoding: str, shape: tuple[int, int, int], batch: int, context: int, session: Any
    ) -> None:
        from max.driver import CPU
        from max.dtype import DType
        from max.graph import DeviceRef, Graph, TensorType

        from maxkv import KVCacheParams, PagedKVCacheManager, kernels_path
        from maxkv import ops as kvops

        q_heads, kv_heads, head_dim = shape
        self.params = KVCacheParams(DType.float32, kv_heads, head_dim, cache_dtype=encoding)
        page = 128
        pages = batch * math.ceil((context + 1) / page)
        self.manager = PagedKVCacheManager(
            self.params, page, pages, batch, context + 1, 1, [CPU()], session
        )
        ref = DeviceRef.CPU()
        cache = self.manager.input_symbols()[0]
        width = kv_heads * head_dim
        kernels = [kernels_path()]
        types = [*cache, *self._rows(width, ref)]
        with Graph(f"write_{encoding}", input_types=types, custom_extensions=kernels) as g:
            *inputs, keys, values, offsets = (v.tensor for v in g.inputs)
            kv = self.manager.collection_fetcher()(*inputs)
            g.output(kvops.write_kv_ragged(self.params, keys, values, offsets, kv, 0))
        self.write = session.load(g)
        q_type = TensorType(DType.float32, ["batch", q_heads, head_dim], ref)
        o_type = TensorType(DType.uint32, ["offsets"], ref)
        types = [*cache, q_type, o_type]
        with Graph(f"attend_{encoding}", input_types=types, custom_extensions=kernels) as g:
            *inputs, q, offsets = (v.tensor for v in g.inputs)
            kv = self.manager.collection_fetcher()(*inputs)
            g.output(kvops.flash_attention_ragged(self.params, q, offsets, kv, 0))
        self.attend = session.load(g)

    @staticmethod
    def _rows(width: int, ref: Any) -> list[Any]:
        from max.dtype import DType
        from max.graph import TensorType

        return [
            TensorType(DType.float32, ["tokens", width], ref),
            TensorType(DType.float32, ["tokens", width], ref),
            TensorType(DType.uint32, ["offsets"], ref),
        ]

    def fill(self, k: np.ndarray, v: np.ndarray) -> list[Any]:
        """Writes ``k, v`` ``[batch, context, kv_heads, head_dim]``; returns the decode
        step's cache inputs (the last position is the new token)."""
        from max.driver import Buffer

        batch, context = k.shape[:2]
        ids = self.manager.claim(batch)
        (inputs,) = self.manager.fetch(ids, active_lengths=[context] * batch)
        offsets = np.arange(batch + 1, dtype=np.uint32) * context
        self.write.execute(
            *inputs,
            Buffer.from_numpy(np.ascontiguousarray(k.reshape(batch * context, -1))),
            Buffer.from_numpy(np.ascontiguousarray(v.reshape(batch * context, -1))),
            Buffer.from_numpy(offsets),
        )
        self.manager.step({i: context - 1 for i in ids})
        (inputs,) = self.manager.fetch(ids)
        self.ids = ids
        return list(inputs)


def attention(args: argparse.Namespace) -> dict[str, Any]:
    from max.driver import CPU, Buffer
    from max.engine import InferenceSession
    from maxkv_bench.machine import read_bandwidth_gbps
    from maxkv_bench.timing import interleaved_median_seconds

    session = InferenceSession(devices=[CPU()])
    bandwidth = read_bandwidth_gbps(session, CPU(), os.cpu_count() or 1)
    log(f"read bandwidth: {bandwidth:.1f} GB/s")
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for model in args.shapes.split(","):
        q_heads, kv_heads, head_dim, _ = SHAPES[model]
        for batch in batches:
            for context in contexts:
                rng = np.random.default_rng(batch * 7919 + context)
                dims = (batch, context, kv_heads, head_dim)
                k = rng.standard_normal(dims, dtype=np.float32)
                v = rng.standard_normal(dims, dtype=np.float32)
                q = rng.standard_normal((batch, q_heads, head_dim), dtype=np.float32)
                queries = [
                    Buffer.from_numpy(q),
                    Buffer.from_numpy(np.arange(batch + 1, dtype=np.uint32)),
                ]
                sides = {
                    e: EncodedDecode(e, (q_heads, kv_heads, head_dim), batch, context, session)
                    for e in args.encodings
                }
                inputs = {e: side.fill(k, v) for e, side in sides.items()}
                del k, v
                outputs = {
                    e: side.attend.execute(*inputs[e], *queries)[0].to_numpy()
                    for e, side in sides.items()
                }
                fns = {
                    e: (lambda s=side, i=inputs[e], qs=queries: s.attend.execute(*i, *qs))
                    for e, side in sides.items()
                }
                medians = interleaved_median_seconds(fns, warmup=3, repeats=args.repeats)
                base = medians["float32"]
                for e, side in sides.items():
                    kv_bytes = batch * context * side.params.token_bytes(1)
                    ms = medians[e] * 1e3
                    rows.append(
                        {
                            "shape": model,
                            "batch": batch,
                            "context": context,
                            "encoding": e,
                            "ms": round(ms, 4),
                            "x_float32": round(base / medians[e], 3),
                            "kv_GBps": round(kv_bytes / medians[e] / 1e9, 2),
                            "fraction_of_read_bandwidth": round(
                                kv_bytes / medians[e] / 1e9 / bandwidth, 3
                            ),
                            "max_abs_difference_from_float32": float(
                                np.abs(outputs[e] - outputs["float32"]).max()
                            ),
                        }
                    )
                log(
                    f"{model} batch {batch:2d} context {context:5d}: "
                    + "  ".join(
                        f"{e} {medians[e] * 1e3:.3f} ms ({base / medians[e]:.2f}x)"
                        for e in args.encodings
                    )
                )
                for side in sides.values():
                    for i in side.ids:
                        side.manager.release(i)
                del sides, inputs
    return {"read_bandwidth_GBps": bandwidth, "rows": rows}


# ----------------------------------------------------------------- quality


def quality(args: argparse.Namespace) -> dict[str, Any]:
    from max.driver import CPU, Buffer
    from max.engine import InferenceSession

    from maxkv import PagedKVCacheManager
    from maxkv.models import DecoderModel
    from maxkv.models.decoder import cache_params

    session = InferenceSession(devices=[CPU()])
    if args.random_shape:
        import subprocess
        import tempfile

        from family_models import make  # type: ignore[import-not-found]

        from maxkv.models import load_model

        directory = Path(args.models) / args.random_shape
        if not (directory / "config.json").exists():
            smollm2 = Path(tempfile.mkdtemp(prefix="smollm2_"))
            export = [sys.executable, "-m", "maxkv.models", "export", "smollm2-135m", str(smollm2)]
            subprocess.run(export, check=True)
            make(args.random_shape, directory, smollm2)
        config, weights = load_model(directory)
        quantized, tokenizer = None, None
        rng = np.random.default_rng(0)
        ids = rng.integers(3, config.vocab_size, args.tokens).tolist()
        model_name = f"{args.random_shape} (random weights)"
    else:
        from maxkv.models.resolve import open_model

        loaded = open_model("smollm2-135m")
        assert loaded.tokenizer is not None
        config, weights, quantized, tokenizer = (
            loaded.config,
            loaded.weights,
            loaded.quantized,
            loaded.tokenizer,
        )
        ids = tokenizer.encode(GPL.read_text())[: args.tokens]
        model_name = "smollm2-135m"
    page = 16
    sides: dict[str, tuple[Any, Any]] = {}
    for encoding in args.encodings:
        manager = PagedKVCacheManager(
            cache_params(config, cache_dtype=encoding),
            page,
            len(ids) // page + 8,
            8,
            len(ids) + 8,
            config.num_hidden_layers,
            [CPU()],
            session,
        )
        model = DecoderModel(
            config, weights, manager, session, output="logits", quantized=quantized
        )
        sides[encoding] = (manager, model)
        log(f"{encoding}: model ready")
    seqs = {e: m.claim(1)[0] for e, (m, _) in sides.items()}
    nll: dict[str, list[float]] = {e: [] for e in args.encodings}
    kl: dict[str, list[float]] = {e: [] for e in args.encodings}
    top1: dict[str, list[bool]] = {e: [] for e in args.encodings}
    started = time.perf_counter()
    offsets = Buffer.from_numpy(np.array([0, 1], dtype=np.uint32))
    for i in range(len(ids) - 1):
        token = Buffer.from_numpy(np.array([ids[i]], dtype=np.int64))
        logp: dict[str, np.ndarray] = {}
        for e, (manager, model) in sides.items():
            (kv,) = manager.fetch([seqs[e]], 1)
            logits = model.execute(token, offsets, kv).to_numpy()[0].astype(np.float64)
            manager.step({seqs[e]: 1})
            top = logits.max()
            logp[e] = logits - (top + math.log(np.exp(logits - top).sum()))
            nll[e].append(-logp[e][ids[i + 1]])
        reference = logp["float32"]
        p = np.exp(reference)
        for e in args.encodings:
            kl[e].append(float((p * (reference - logp[e])).sum()))
            top1[e].append(bool(logp[e].argmax() == reference.argmax()))
        if (i + 1) % 512 == 0:
            log(
                f"{i + 1} tokens, {time.perf_counter() - started:.0f} s: "
                + "  ".join(f"{e} KL {np.mean(kl[e]):.2e}" for e in args.encodings)
            )
    for e, (manager, _) in sides.items():
        manager.release(seqs[e])
    base = math.exp(np.mean(nll["float32"]))
    runs = {}
    for e in args.encodings:
        ppl = math.exp(np.mean(nll[e]))
        runs[e] = {
            "perplexity": ppl,
            "perplexity_minus_float32": ppl - base,
            "mean_kl_divergence": float(np.mean(kl[e])),
            "kl_p99": float(np.percentile(kl[e], 99)),
            "top1_agreement": float(np.mean(top1[e])),
        }
        print(
            f"{e:9s} ppl {ppl:.4f} (d {ppl - base:+.4f})  KL {runs[e]['mean_kl_divergence']:.2e}"
            f"  top-1 {runs[e]['top1_agreement']:.4f}",
            flush=True,
        )
    result: dict[str, Any] = {
        "model": model_name,
        "text": str(GPL) if tokenizer is not None else "random tokens",
        "tokens": len(ids),
        "runs": runs,
    }
    if tokenizer is not None and args.json:  # the figures so far, if the chat part fails
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if tokenizer is not None:
        result["chat"] = chat_agreement(
            config, weights, quantized, tokenizer, session, args.encodings
        )
        print(f"chat answers equal to float32 KV's: {result['chat']}", flush=True)
    return result


def chat_agreement(
    config: Any, weights: Any, quantized: Any, tokenizer: Any, session: Any, encodings: list[str]
) -> Any:
    """The README's chat questions, greedy, through maxkv's scheduler per encoding:
    how many answers equal float32 KV's, token for token."""
    from max.driver import CPU

    from maxkv import PagedKVCacheManager
    from maxkv.models import DecoderModel
    from maxkv.models.decoder import cache_params
    from maxkv.serving.scheduler import ContinuousBatchingScheduler

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from multistep_decode import DEFAULT_QUESTIONS  # type: ignore[import-not-found]

    prompts = [tokenizer.encode_chat(q) for q in DEFAULT_QUESTIONS]
    answers: dict[str, list[list[int]]] = {}
    for encoding in encodings:
        manager = PagedKVCacheManager(
            cache_params(config, cache_dtype=encoding),
            16,
            8 * 16,
            8,
            256,
            config.num_hidden_layers,
            [CPU()],
            session,
        )
        model = DecoderModel(
            config, weights, manager, session, output="tokens", quantized=quantized
        )
        scheduler = ContinuousBatchingScheduler(model, manager, 8)
        for prompt in prompts:
            scheduler.submit(prompt, 64)
        answers[encoding], _ = scheduler.run()
        log(f"chat on {encoding} KV: done")
    return {
        e: {
            "equal_answers": sum(
                a == b for a, b in zip(answers[e], answers["float32"], strict=True)
            ),
            "of": len(prompts),
        }
        for e in encodings
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("capacity", "attention", "quality"))
    parser.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--random-shape", help="quality on random weights of this shape")
    parser.add_argument("--models", default="/work/bench_models", help="checkpoints folder")
    parser.add_argument("--encodings", default=",".join(ENCODINGS), help="comma-separated")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    chosen = [e.strip() for e in args.encodings.split(",") if e.strip() != "float32"]
    args.encodings = ["float32", *chosen]
    from maxkv_bench.report import machine_info

    started = time.time()
    part = {"capacity": capacity, "attention": attention, "quality": quality}[args.part]
    result = {"machine": machine_info("cpu"), **part(args), "elapsed_s": time.time() - started}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
