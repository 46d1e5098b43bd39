"""Machine description and the one-figure summary of a benchmark run."""

from __future__ import annotations

import os
import platform
from importlib.metadata import version
from pathlib import Path
from typing import Any


def machine_info(device: str) -> dict[str, Any]:
    """Where the numbers came from."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": cpu,
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


def plot(results: dict[str, Any], path: Path) -> None:
    """Four panels: attention decode, step overhead, end to end, memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    rows = results["attention_decode"]
    labels = [f"b{r['batch']}\nc{r['context']}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["maxkv_ms"] for r in rows], 0.4, label="maxkv")
    ax.bar(x + 0.2, [r["max_paged_ms"] for r in rows], 0.4, label="MAX paged")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title("Flash attention decode, 8 heads x 64, float32")
    ax.legend()

    ax = axes[0][1]
    overhead = results["manager_step_overhead_us"]
    names = [k for k in overhead if k != "batch"]
    ax.bar(names, [overhead[k] for k in names], color=["C0", "C2", "C1"][: len(names)])
    ax.set_ylabel("host us per decode step (median)")
    ax.set_title(f"Cache-input preparation, batch {overhead['batch']}")
    ax.tick_params(axis="x", labelsize=8)

    ax = axes[1][0]
    e2e = results["end_to_end"]
    bars = {"maxkv": e2e["maxkv_tokens_per_s"]}
    if "hf_tokens_per_s" in e2e:
        bars["transformers"] = e2e["hf_tokens_per_s"]
    ax.bar(list(bars), list(bars.values()), color=["C0", "C3"][: len(bars)])
    ax.set_ylabel("generated tokens / s (median)")
    ax.set_title(f"Greedy decoding, demo model, batch {e2e['batch']}")

    ax = axes[1][1]
    memory = results["memory"]
    lens = sorted({m["max_seq_len"] for m in memory})
    x = np.arange(len(lens))
    for offset, scheme in ((-0.2, "continuous"), (0.2, "paged")):
        util = [
            next(
                m["utilization"] for m in memory if m["scheme"] == scheme and m["max_seq_len"] == n
            )
            for n in lens
        ]
        ax.bar(x + offset, util, 0.4, label=scheme)
    ax.set_xticks(x, [f"max_seq_len {n}" for n in lens], fontsize=8)
    ax.set_ylabel("live bytes / reserved bytes")
    ax.set_title("Memory utilization, 32 requests in flight")
    ax.legend()
    fig.suptitle(
        f"maxkv benchmarks on {results['machine']['cpu']} ({results['machine']['device']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
