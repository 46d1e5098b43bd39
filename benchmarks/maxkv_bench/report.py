"""Machine description and the one-figure summary of a benchmark run."""

from __future__ import annotations

import os
import platform
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np


def machine_info(device: str) -> dict[str, Any]:
    """Where the numbers came from."""
    cpu = platform.processor()
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    cpu = fields.get("model name", cpu)
    flags = set(fields.get("flags", "").split())
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else platform.machine()
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_family_model": f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}",
        "isa": isa,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "max": version("max"),
        "device": device,
    }
    try:
        info["torch"] = version("torch")
    except Exception:
        pass
    return info


def merge_arith(path: Path, machine: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Adds ``rows`` to the arithmetic results at ``path`` (``arith_<isa>.json``: one
    row per model, mode, concurrency and workload), replacing the rows they measure
    again; each row keeps the machine it was measured on and the time."""
    import json
    import time

    key = ("model", "mode", "concurrency", "workload")
    kept: list[dict[str, Any]] = []
    if path.is_file():
        kept = json.loads(path.read_text()).get("rows", [])
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    new = [row | {"machine": machine, "measured": stamp} for row in rows]
    fresh = {tuple(row[k] for k in key) for row in new}
    rows = [row for row in kept if tuple(row.get(k) for k in key) not in fresh] + new
    path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


def print_summary(results: dict[str, Any]) -> None:
    """Prints every section of a benchmark run that is present."""
    machine = results["machine"]
    print(f"machine: {machine}")
    if "attention_decode" in results:
        rows = results["attention_decode"]
        print("\nattention decode (one step, ms, median)")
        print(
            f"{'batch':>5} {'context':>7} {'maxkv':>9} {'MAX paged':>9} {'ratio':>6} "
            f"{'maxkv GB/s':>10} {'of read BW':>10}"
        )
        for r in rows:
            fraction = r.get("maxkv_fraction_of_read_bandwidth")
            shown = f"{fraction:>10.2f}" if fraction is not None else f"{'-':>10}"
            print(
                f"{r['batch']:>5} {r['context']:>7} {r['maxkv_ms']:>9.3f} "
                f"{r['max_paged_ms']:>9.3f} {r['ratio']:>6.2f} {r['maxkv_GBps']:>10.1f} {shown}"
            )
        ratios = sorted(r["ratio"] for r in rows)
        results["attention_decode_median_ratio"] = ratios[len(ratios) // 2]
        print(f"median maxkv/MAX-paged ratio: {results['attention_decode_median_ratio']}")
        long = [r["ratio"] for r in rows if r["context"] >= 512]
        if long:
            results["attention_decode_median_ratio_context_ge_512"] = float(np.median(long))
            print(f"  contexts >= 512: median ratio {float(np.median(long)):.3f}")
        short = [r["ratio"] for r in rows if r["context"] < 512]
        if short:
            results["attention_decode_max_ratio_context_lt_512"] = max(short)
            print(f"  contexts < 512: worst ratio {max(short):.3f}")
        big = [
            r["maxkv_fraction_of_read_bandwidth"]
            for r in rows
            if r["batch"] >= 8 and r["context"] >= 2048 and "maxkv_fraction_of_read_bandwidth" in r
        ]
        if big:
            results["attention_decode_min_fraction_of_read_bandwidth_b8_c2048"] = min(big)
            print(
                f"  batch >= 8, context >= 2048: at least {min(big):.2f} of the measured "
                "read bandwidth"
            )
    if "manager_step_overhead_us" in results:
        overhead = results["manager_step_overhead_us"]
        results["step_overhead_ratio"] = round(overhead["maxkv"] / overhead["max_paged"], 3)
        print(
            f"\nstep overhead, batch {overhead['batch']} (us per decode step): {overhead}; "
            f"ratio maxkv/paged {results['step_overhead_ratio']}"
        )
    if "end_to_end" in results:
        print(f"\nend to end, demo model: {results['end_to_end']}")
    if "end_to_end_real" in results:
        print("\nend to end, SmolLM2-135M-Instruct (tokens/s, median)")
        print(
            f"{'batch':>5} {'maxkv':>8} {'+prefix':>8} {'HF':>8} {'MAX':>8} {'roofline':>9} "
            f"{'xHF':>6} {'xMAX':>6} {'+p xHF':>7} {'+p xMAX':>8} {'roof':>6} same-as-HF"
        )
        for r in results["end_to_end_real"]:
            print(
                f"{r['batch']:>5} {r['maxkv_tokens_per_s']:>8.1f} "
                f"{r.get('maxkv_prefix_caching_tokens_per_s', float('nan')):>8.1f} "
                f"{r.get('hf_tokens_per_s', float('nan')):>8.1f} "
                f"{r['max_pipeline_tokens_per_s']:>8.1f} "
                f"{r.get('roofline_tokens_per_s', float('nan')):>9.1f} "
                f"{r.get('speedup_vs_hf', float('nan')):>6.2f} "
                f"{r['speedup_vs_max_pipeline']:>6.2f} "
                f"{r.get('prefix_caching_speedup_vs_hf', float('nan')):>7.2f} "
                f"{r.get('prefix_caching_speedup_vs_max_pipeline', float('nan')):>8.2f} "
                f"{r.get('fraction_of_roofline', float('nan')):>6.2f} {r.get('same_tokens_as_hf')}"
                f"/{r.get('prefix_caching_same_tokens_as_hf')}"
            )
    for profile in results.get("profile", []):
        print(
            f"\ndecode step profile, batch {profile['batch']}, context {profile['context']}: "
            f"{profile['step_ms']} ms measured, {profile['unattributed_ms']} ms unattributed"
        )
        for row in profile["rows"]:
            print(
                f"  {row['family']:<26} {row['calls_per_step']:>4} x {row['ms_per_call']:.4f} = "
                f"{row['ms_per_step']:7.3f} ms ({100 * row['share']:4.1f} %)"
            )
    if "matmul_dtypes" in results:
        print("\nmatmul by weight dtype (ms, median)")
        for r in results["matmul_dtypes"]:
            print(f"  {r}")
    if "sequence_ops" in results:
        ops_results = results["sequence_ops"]
        print(f"\nprefix caching (sequential requests): {ops_results['prefix_caching']}")
        print(f"fork: {ops_results['fork']}")
    if "memory" in results:
        print("\nmemory (mean live/reserved):")
        for m in results["memory"]:
            print(
                f"  {m['scheme']:>10} max_seq_len {m['max_seq_len']:>5}: "
                f"reserved {m['reserved_bytes'] / 2**30:7.2f} GiB, live "
                f"{m['live_bytes'] / 2**30:6.2f} GiB, utilization {m['utilization']:.3f}"
            )
    print(f"\ntotal {results['elapsed_s']} s")


def plot(results: dict[str, Any], path: Path) -> None:
    """One panel per section present (attention, overhead, end to end, memory, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [
        name
        for name in (
            "attention_decode",
            "manager_step_overhead_us",
            "end_to_end",
            "memory",
            "end_to_end_real",
            "profile",
        )
        if results.get(name)
    ]
    cols = 2 if len(panels) > 1 else 1
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 4.5 * rows_n), squeeze=False)
    for ax, name in zip(axes.flat, panels, strict=False):
        if name == "attention_decode":
            rows = results[name]
            labels = [f"b{r['batch']}\nc{r['context']}" for r in rows]
            x = np.arange(len(rows))
            ax.bar(x - 0.2, [r["maxkv_ms"] for r in rows], 0.4, label="maxkv")
            ax.bar(x + 0.2, [r["max_paged_ms"] for r in rows], 0.4, label="MAX paged")
            ax.set_xticks(x, labels, fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel("ms per decode step (median)")
            ax.set_title("Flash attention decode, 8 heads x 64, float32")
            ax.legend()
        elif name == "manager_step_overhead_us":
            overhead = results[name]
            keys = [k for k in overhead if k != "batch"]
            ax.bar(keys, [overhead[k] for k in keys], color=["C0", "C2", "C1"][: len(keys)])
            ax.set_ylabel("host us per decode step (median)")
            ax.set_title(f"Cache-input preparation, batch {overhead['batch']}")
            ax.tick_params(axis="x", labelsize=8)
        elif name == "end_to_end":
            e2e = results[name]
            bars = {"maxkv": e2e["maxkv_tokens_per_s"]}
            if "hf_tokens_per_s" in e2e:
                bars["transformers"] = e2e["hf_tokens_per_s"]
            ax.bar(list(bars), list(bars.values()), color=["C0", "C3"][: len(bars)])
            ax.set_ylabel("generated tokens / s (median)")
            ax.set_title(f"Greedy decoding, 2-layer demo model, batch {e2e['batch']}")
        elif name == "memory":
            memory = results[name]
            lens = sorted({m["max_seq_len"] for m in memory})
            schemes = sorted({m["scheme"] for m in memory})
            x = np.arange(len(lens))
            width = 0.8 / len(schemes)
            for j, scheme in enumerate(schemes):
                util = [
                    next(
                        (
                            m["utilization"]
                            for m in memory
                            if m["scheme"] == scheme and m["max_seq_len"] == n
                        ),
                        0.0,
                    )
                    for n in lens
                ]
                ax.bar(x + (j - (len(schemes) - 1) / 2) * width, util, width, label=scheme)
            ax.set_xticks(x, [f"max_seq_len {n}" for n in lens], fontsize=8)
            ax.set_ylabel("live bytes / reserved bytes")
            ax.set_title("Memory utilization, 32 requests in flight")
            ax.legend()
        elif name == "end_to_end_real":
            rows = results[name]
            x = np.arange(len(rows))
            sides = [
                ("maxkv_tokens_per_s", "maxkv"),
                ("maxkv_prefix_caching_tokens_per_s", "maxkv + prefix caching"),
                ("hf_tokens_per_s", "transformers"),
                ("max_pipeline_tokens_per_s", "MAX pipeline"),
                ("roofline_tokens_per_s", "roofline"),
            ]
            for j, (key, label) in enumerate(sides):
                ax.bar(x + (j - 2) * 0.16, [r.get(key, 0.0) for r in rows], 0.16, label=label)
            ax.set_xticks(x, [f"batch {r['batch']}" for r in rows])
            ax.set_ylabel("generated tokens / s (median)")
            ax.set_title("SmolLM2-135M-Instruct, float32, 64 new tokens")
            ax.legend(fontsize=8)
        elif name == "profile":
            profile = results[name][-1]
            families = [row["family"] for row in profile["rows"]]
            ax.barh(families, [row["ms_per_step"] for row in profile["rows"]])
            ax.invert_yaxis()
            ax.tick_params(axis="y", labelsize=8)
            ax.set_xlabel("ms per decode step")
            ax.set_title(f"Decode step, batch {profile['batch']}: {profile['step_ms']} ms measured")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        f"maxkv benchmarks on {results['machine']['cpu']} ({results['machine']['device']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
