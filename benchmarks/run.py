"""maxkv benchmarks, side by side with MAX's paged KV cache and transformers.

    python benchmarks/run.py --quick --json results.json --plot results.png

Every figure comes from this one run: warm-up, repeated runs, medians.
Needs ``pip install ".[bench]"`` (matplotlib; torch for the transformers side).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from max.driver import CPU, Accelerator, Device, accelerator_count
from max.engine import InferenceSession

from maxkv.bench.attention import bench_attention_decode
from maxkv.bench.end_to_end import end_to_end
from maxkv.bench.memory import memory_footprint
from maxkv.bench.overhead import max_paged_step_overhead_us, maxkv_step_overhead_us
from maxkv.bench.report import machine_info, plot


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="maxkv benchmarks")
    parser.add_argument(
        "--quick", action="store_true", help="fewer repeats (about 5 min on 2 cores)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write the figure here (PNG)")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    return parser.parse_args()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> int:
    args = parse_args()
    if args.device == "gpu" and accelerator_count() == 0:
        print("error: --device gpu: no GPU is visible to MAX", file=sys.stderr)
        return 2
    device: Device = Accelerator() if args.device == "gpu" else CPU()
    session = InferenceSession(devices=[device])
    warmup, repeats = (2, 7) if args.quick else (5, 25)
    started = time.perf_counter()
    results: dict[str, Any] = {"machine": machine_info(args.device), "quick": args.quick}

    log("attention decode: compiling both graphs, then the grid ...")
    results["attention_decode"] = bench_attention_decode(
        session, device, [1, 8, 32], [128, 512, 2048], warmup=warmup, repeats=repeats
    )
    log("manager step overhead ...")
    results["manager_step_overhead_us"] = {
        "batch": 64,
        "maxkv": round(maxkv_step_overhead_us(session, device, 64, 4, repeats=repeats * 4), 1),
        "maxkv_num_steps_1": round(
            maxkv_step_overhead_us(session, device, 64, 1, repeats=repeats * 4), 1
        ),
        "max_paged": round(max_paged_step_overhead_us(session, device, 64, repeats=repeats * 4), 1),
    }
    log("end to end: demo model vs transformers ...")
    results["end_to_end"] = end_to_end(
        session,
        device,
        batch=8,
        prompt_len=16,
        new_tokens=32 if args.quick else 64,
        num_steps=4,
        repeats=3 if args.quick else 5,
    )
    results["memory"] = memory_footprint([512, 2048, 8192])
    results["elapsed_s"] = round(time.perf_counter() - started, 1)

    print(f"machine: {results['machine']}")
    print("\nattention decode (one step, ms, median)")
    print(
        f"{'batch':>5} {'context':>7} {'maxkv':>9} {'MAX paged':>9} {'ratio':>6} {'maxkv GB/s':>10}"
    )
    for r in results["attention_decode"]:
        print(
            f"{r['batch']:>5} {r['context']:>7} {r['maxkv_ms']:>9.3f} {r['max_paged_ms']:>9.3f} "
            f"{r['ratio']:>6.2f} {r['maxkv_GBps']:>10.1f}"
        )
    ratios = sorted(r["ratio"] for r in results["attention_decode"])
    results["attention_decode_median_ratio"] = ratios[len(ratios) // 2]
    overhead = results["manager_step_overhead_us"]
    results["step_overhead_ratio"] = round(overhead["maxkv"] / overhead["max_paged"], 3)
    print(f"median maxkv/MAX-paged ratio: {results['attention_decode_median_ratio']}")
    print(
        f"\nstep overhead, batch 64 (us per decode step): {overhead}; "
        f"ratio maxkv/paged {results['step_overhead_ratio']}"
    )
    print(f"end to end: {results['end_to_end']}")
    print("memory (mean live/reserved):")
    for m in results["memory"]:
        print(
            f"  {m['scheme']:>10} max_seq_len {m['max_seq_len']:>5}: "
            f"reserved {m['reserved_bytes'] / 2**30:7.2f} GiB, live "
            f"{m['live_bytes'] / 2**30:6.2f} GiB, utilization {m['utilization']:.3f}"
        )
    print(f"\ntotal {results['elapsed_s']} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
