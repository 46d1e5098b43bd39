"""maxkv benchmarks, side by side with MAX's own kernels and pipeline and transformers.

    python benchmarks/run.py --quick --json results.json --plot results.png
    python benchmarks/run.py --only end_to_end_real,profile

Every figure comes from this one run: warm-up, repeated runs, medians.  The
machine's memory read bandwidth and matmul FLOP rate are measured first and
every roofline and bandwidth fraction uses them.  Needs ``pip install
".[bench]"`` (matplotlib; torch for the transformers side).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from max.driver import CPU, Accelerator, Device, accelerator_count
from max.engine import InferenceSession
from maxkv_bench.attention import bench_attention_decode
from maxkv_bench.end_to_end import end_to_end
from maxkv_bench.machine import matmul_gflops, read_bandwidth_gbps
from maxkv_bench.memory import memory_footprint
from maxkv_bench.overhead import max_paged_step_overhead_us, maxkv_step_overhead_us
from maxkv_bench.report import machine_info, plot, print_summary

SECTIONS = (
    "attention_decode",
    "manager_step_overhead",
    "end_to_end",
    "end_to_end_real",
    "profile",
    "matmul_dtypes",
    "sequence_ops",
    "paged",
    "memory",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="maxkv benchmarks")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and points")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write the figure here (PNG)")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument(
        "--only", help=f"comma-separated sections to run (default all: {', '.join(SECTIONS)})"
    )
    return parser.parse_args()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> int:
    args = parse_args()
    sections = SECTIONS if args.only is None else tuple(args.only.split(","))
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"error: unknown sections {unknown}; choose from {SECTIONS}", file=sys.stderr)
        return 2
    if args.device == "gpu" and accelerator_count() == 0:
        print("error: --device gpu: no GPU is visible to MAX", file=sys.stderr)
        return 2
    device: Device = Accelerator() if args.device == "gpu" else CPU()
    session = InferenceSession(devices=[device])
    quick = args.quick
    warmup, repeats = (2, 7) if quick else (5, 25)
    started = time.perf_counter()
    machine = machine_info(args.device)
    results: dict[str, Any] = {"machine": machine, "quick": quick, "sections": list(sections)}

    if args.device == "cpu":
        log("machine: read bandwidth and matmul rate ...")
        workers = machine["cpu_count"] or 1
        machine["read_bandwidth_GBps"] = round(read_bandwidth_gbps(session, device, workers), 1)
        machine["matmul_GFLOPs"] = round(matmul_gflops(), 1)
        machine["read_bandwidth_method"] = (
            "512 MiB float32 tensor summed by maxkv.stream_read, one contiguous chunk per "
            "CPU worker; bytes / median time"
        )
        machine["matmul_method"] = "NumPy float32 GEMM 2048^3 (its BLAS, all threads); median"
        log(f"  {machine['read_bandwidth_GBps']} GB/s, {machine['matmul_GFLOPs']} GFLOP/s")
    bandwidth = machine.get("read_bandwidth_GBps")

    runners: dict[str, Callable[[], Any]] = {
        "attention_decode": lambda: bench_attention_decode(
            session,
            device,
            [1, 8, 32],
            [128, 512, 2048],
            warmup=warmup,
            repeats=repeats,
            read_bandwidth_gbps=bandwidth,
        ),
        "manager_step_overhead": lambda: {
            "batch": 64,
            "maxkv": round(maxkv_step_overhead_us(session, device, 64, 4, repeats=repeats * 4), 1),
            "maxkv_num_steps_1": round(
                maxkv_step_overhead_us(session, device, 64, 1, repeats=repeats * 4), 1
            ),
            "max_paged": round(
                max_paged_step_overhead_us(session, device, 64, repeats=repeats * 4), 1
            ),
        },
        "end_to_end": lambda: end_to_end(
            session,
            device,
            batch=8,
            prompt_len=16,
            new_tokens=32 if quick else 64,
            num_steps=4,
            repeats=3 if quick else 5,
        ),
        "end_to_end_real": lambda: _end_to_end_real(session, device, machine, quick),
        "profile": lambda: _profile(session, device, quick),
        "matmul_dtypes": lambda: _matmul_dtypes(session, device),
        "sequence_ops": lambda: _sequence_ops(session, device, quick),
        "paged": lambda: _paged(session, device, quick),
        "memory": lambda: memory_footprint([512, 2048, 8192]),
    }
    names = {
        "manager_step_overhead": "manager_step_overhead_us",
    }
    for section in sections:
        log(f"{section} ...")
        results[names.get(section, section)] = runners[section]()
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    print_summary(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)
    return 0


def _end_to_end_real(
    session: InferenceSession, device: Device, machine: dict[str, Any], quick: bool
) -> Any:
    from maxkv_bench.real import end_to_end_real

    return end_to_end_real(
        session,
        device,
        [8] if quick else [1, 8, 32],
        read_bandwidth_gbps=machine.get("read_bandwidth_GBps"),
        matmul_gflops=machine.get("matmul_GFLOPs"),
        repeats=3,
        log=log,
    )


def _profile(session: InferenceSession, device: Device, quick: bool) -> Any:
    from maxkv_bench.profile import profile_decode_step
    from maxkv_bench.real import QUESTIONS

    from maxkv.models.resolve import open_model

    model = open_model("smollm2-135m")
    assert model.tokenizer is not None
    profiles = []
    for batch in [8] if quick else [8, 32]:
        prompts = [model.tokenizer.encode_chat(q) for q in QUESTIONS[:batch]]
        profiles.append(
            profile_decode_step(
                session, device, model.config, model.weights, prompts, quantized=model.quantized
            )
        )
    return profiles


def _matmul_dtypes(session: InferenceSession, device: Device) -> Any:
    from maxkv_bench.profile import matmul_dtypes

    from maxkv.models.resolve import open_model

    return matmul_dtypes(session, device, open_model("smollm2-135m").config, [8, 32])


def _sequence_ops(session: InferenceSession, device: Device, quick: bool) -> Any:
    from maxkv_bench.sequence_ops import sequence_ops_bench

    from maxkv.models.resolve import open_model

    return sequence_ops_bench(session, device, open_model("smollm2-135m"), quick=quick)


def _paged(session: InferenceSession, device: Device, quick: bool) -> Any:
    from maxkv_bench.paged import paged_bench

    from maxkv.models.resolve import open_model

    return paged_bench(session, device, open_model("smollm2-135m"), quick=quick)


if __name__ == "__main__":
    sys.exit(main())
