"""Deployment sizes on this CPU: load, memory and batch-1 decode of Q4_K_M fixtures.

    python benchmarks/deployment.py llama-3.2-3b llama-3.1-8b [--mix q4_k_m|bf16] \\
        [--activations float32,int8] [--llama-bench /tmp/llama-build/bin/llama-bench] \\
        [--json FILE.json]

For each shape of ``benchmarks/deployment_gguf.py`` in its ``--mix`` (the
file is written first if missing), in a fresh process each time, one at a time:

- maxkv: ``open_model`` then ``DecoderModel`` (greedy tokens, a one-sequence
  contiguous cache of 512 tokens), run three times: the first compiles the
  graph where MAX's cache lacks it and packs the file's tiles, keeping them
  (``load_and_compile_s``); the second packs them again, the packed cache off
  (``load_packing_s``, the graph cached); the third finds both cached
  (``load_s``, the tiles read back from the packed cache).  In the third, a
  40-token chat prompt is prefilled and decoded for 1 and for ``1 + new_tokens``
  tokens by maxkv's scheduler (one step a fetch), repeated;
  decode tokens/s is ``new_tokens`` over the median difference.  The bytes a
  decode step reads are the graph weights it streams (every matrix, the head;
  not the embedding's other rows), reported as a fraction of this machine's
  read bandwidth (``maxkv.stream_read`` over 512 MiB).  Peak resident memory
  (``VmHWM``) of the process.
- ``--activations``: the maxkv measurement once per ``MAXKV_ACTIVATIONS`` mode
  given, a row each (llama.cpp's figures repeated in each).
- ``--prefill N``: also the prefill of an ``N``-token prompt (the opening of
  the GPL-3 text, ``/usr/share/common-licenses``) and its first token, in a
  cache of ``N + 16`` tokens, median of the repeats: prompt tokens/s.
- llama.cpp (``--llama-bench``): ``llama-bench -m FILE -p 0 -n new_tokens -t
  <cores>``, its tokens/s, and the peak resident memory of that process; with
  ``--prefill N``, ``llama-bench -p N -n 0`` too.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deployment_gguf import MIXES, SHAPES, fixture_path, write

PROMPT = "Write a short paragraph about the history of the printing press."


def _peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


LONG_TEXT = Path("/usr/share/common-licenses/GPL-3")


def measure_maxkv(
    path: Path, new_tokens: int, repeats: int, decode: bool, prefill: int = 0
) -> dict[str, Any]:
    """One process's measurement (see the module docstring)."""
    import numpy as np
    from max.driver import CPU
    from max.engine import InferenceSession

    from maxkv import ContinuousBatchingKVCacheManager
    from maxkv.models.decoder import DecoderModel, cache_params
    from maxkv.models.resolve import open_model
    from maxkv.serving.scheduler import ContinuousBatchingScheduler

    start = time.perf_counter()
    model = open_model(path, progress=False)
    opened = time.perf_counter() - start
    device = CPU()
    session = InferenceSession(devices=[device])
    config = model.config
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), 1, max(512, prefill + 16), config.num_hidden_layers, [device], session
    )
    decoder = DecoderModel(config, model.weights, manager, session, quantized=model.quantized)
    row: dict[str, Any] = {
        "open_model_s": round(opened, 2),
        "load_s": round(time.perf_counter() - start, 2),
        "graph_weight_bytes": int(sum(a.nbytes for a in decoder._weights.values())),
        "file_bytes": path.stat().st_size,
        "greedy_head": decoder.greedy_head,
    }
    if not decode:
        row["peak_rss_mib"] = round(_peak_mib())
        return row
    streamed = sum(
        a.nbytes
        for name, a in decoder._weights.items()
        if not name.startswith(("embed_tokens", "rope")) and getattr(a, "ndim", 1) > 1
    )
    assert model.tokenizer is not None
    prompt = model.tokenizer.encode_chat(PROMPT)

    def generate(tokens: int, ids: list[int] = prompt) -> float:
        scheduler = ContinuousBatchingScheduler(decoder, manager, 1, 1, stop_at_eos=False)
        scheduler.submit(ids, tokens)
        began = time.perf_counter()
        scheduler.run()
        return time.perf_counter() - began

    generate(2)  # warm-up
    differences = [generate(1 + new_tokens) - generate(1) for _ in range(repeats)]
    seconds = float(np.median(differences))
    from maxkv_bench.machine import read_bandwidth_gbps

    bandwidth = read_bandwidth_gbps(session, device, os.cpu_count() or 1)
    rate = new_tokens / seconds
    row |= {
        "prompt_tokens": len(prompt),
        "decode_tokens_per_s": round(rate, 2),
        "decode_ms_per_token": round(1000 / rate, 1),
        "bytes_read_per_token": streamed,
        "read_bandwidth_gbps": round(bandwidth, 1),
        "fraction_of_read_bandwidth": round(streamed * rate / (bandwidth * 1e9), 3),
        "peak_rss_mib": round(_peak_mib()),
    }
    if prefill:
        long = model.tokenizer.encode(LONG_TEXT.read_text())[:prefill]
        if len(long) < prefill:
            raise SystemExit(f"{LONG_TEXT} has {len(long)} tokens, fewer than {prefill}")
        seconds = float(np.median([generate(1, long) for _ in range(repeats)]))
        row |= {
            "prefill_tokens": prefill,
            "prefill_s": round(seconds, 2),
            "prefill_tokens_per_s": round(prefill / seconds, 1),
            "peak_rss_mib": round(_peak_mib()),
        }
    return row


def measure_llama_cpp(
    binary: Path, path: Path, new_tokens: int, prefill: int = 0
) -> dict[str, Any]:
    row = _llama_bench(binary, path, 0, new_tokens)
    if prefill:
        prompt = _llama_bench(binary, path, prefill, 0, repetitions=2)
        row |= {
            "prefill_command": prompt["command"],
            "prefill_tokens_per_s": prompt["decode_tokens_per_s"],
        }
    return row


def _llama_bench(
    binary: Path, path: Path, prompt: int, new_tokens: int, repetitions: int = 5
) -> dict[str, Any]:
    """``llama-bench`` of one test: its tokens/s (under ``decode_tokens_per_s``) and peak RSS."""
    threads = str(os.cpu_count() or 1)
    command = [str(binary), "-m", str(path), "-p", str(prompt), "-n", str(new_tokens)]
    command += ["-t", threads, "-r", str(repetitions)]
    process = subprocess.Popen([*command, "-o", "json"], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)  # this child's own peak
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode})")
    (test,) = json.loads(output)
    return {
        "command": " ".join(command),
        "decode_tokens_per_s": round(float(test["avg_ts"]), 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024),
    }


def _child(
    shape: str,
    mix: str,
    new_tokens: int,
    repeats: int,
    decode: bool,
    activations: str,
    packed_cache: bool = True,
    prefill: int = 0,
) -> dict[str, Any]:
    command = [sys.executable, __file__, shape, "--child", "--new-tokens", str(new_tokens)]
    command += ["--prefill", str(prefill)]
    command += ["--mix", mix]
    command += ["--repeats", str(repeats)] + ([] if decode else ["--no-decode"])
    env = os.environ | {
        "MAXKV_PACKED_CACHE": "1" if packed_cache else "0",
        "MAXKV_ACTIVATIONS": activations,
    }
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode:
        raise SystemExit(f"{shape}: the measurement failed:\n{result.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="+", help=f"of: {', '.join(SHAPES)}")
    parser.add_argument("--mix", choices=MIXES, default="q4_k_m", help="the fixtures' tensor types")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--activations", default="float32", help="MAXKV_ACTIVATIONS modes, by commas"
    )
    parser.add_argument("--prefill", type=int, default=0, help="also a prompt of this many tokens")
    parser.add_argument("--llama-bench", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--arith-json",
        type=Path,
        help="also the rows as the arithmetic results keep them (model, mode, concurrency 1, "
        "maxkv_tok_s, llamacpp_tok_s)",
    )
    parser.add_argument(
        "--child",
        action="store_true",
        help="one maxkv measurement of one shape in this process, printed as a JSON row "
        "(MAXKV_ACTIVATIONS from the environment; comparing two trees: PYTHONPATH)",
    )
    parser.add_argument("--no-decode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from maxkv.cachedir import cache_dir

    folder = cache_dir() / "deployment"
    paths = {}
    for shape in args.shapes:
        if shape not in SHAPES:
            parser.error(f"unknown shape {shape}; choose from {', '.join(SHAPES)}")
        path = fixture_path(shape, folder, args.mix)
        paths[shape] = path if path.is_file() or args.child else write(shape, folder, mix=args.mix)
    if args.child:
        (shape,) = args.shapes
        decode = not args.no_decode
        row = measure_maxkv(paths[shape], args.new_tokens, args.repeats, decode, args.prefill)
        print(json.dumps(row))
        return
    from maxkv.cpu.features import cpu_flags

    flags = cpu_flags()
    machine = {
        "cpu": platform.processor() or _cpu_name(),
        "cores": os.cpu_count(),
        "isa": "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other",
        "vnni": "avx512_vnni" in flags or "avx_vnni" in flags,
    }
    rows = []
    for shape, path in paths.items():
        llama_cpp = None
        if args.llama_bench:
            llama_cpp = measure_llama_cpp(args.llama_bench, path, args.new_tokens, args.prefill)
        for mode in args.activations.split(","):
            row: dict[str, Any] = {"shape": shape, "file": path.name, "activations": mode}
            if llama_cpp is not None:
                row["llama_cpp"] = llama_cpp
            child = functools.partial(_child, shape, args.mix, args.new_tokens, args.repeats)
            first = child(decode=False, activations=mode)
            packing = child(decode=False, activations=mode, packed_cache=False)
            row["maxkv"] = {
                "load_and_compile_s": first["load_s"],
                "load_packing_s": packing["load_s"],
                "load_packing_peak_rss_mib": packing["peak_rss_mib"],
            } | child(decode=True, activations=mode, prefill=args.prefill)
            if llama_cpp is not None:
                row["decode_vs_llama_cpp"] = round(
                    row["maxkv"]["decode_tokens_per_s"] / llama_cpp["decode_tokens_per_s"], 3
                )
                if args.prefill:
                    row["prefill_vs_llama_cpp"] = round(
                        row["maxkv"]["prefill_tokens_per_s"] / llama_cpp["prefill_tokens_per_s"], 3
                    )
            print(json.dumps(row, indent=2), flush=True)
            rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "deployment": rows}, indent=2) + "\n")
    if args.arith_json:
        arith = [
            {
                "model": f"{row['shape']} ({args.mix} fixture)",
                "mode": row["activations"],
                "concurrency": 1,
                "workload": "batch-1 decode",
                "maxkv_tok_s": row["maxkv"]["decode_tokens_per_s"],
                "llamacpp_tok_s": row.get("llama_cpp", {}).get("decode_tokens_per_s"),
                "maxkv_peak_rss_mib": row["maxkv"]["peak_rss_mib"],
                "llamacpp_peak_rss_mib": row.get("llama_cpp", {}).get("peak_rss_mib"),
                "fraction_of_read_bandwidth": row["maxkv"]["fraction_of_read_bandwidth"],
            }
            for row in rows
        ]
        arith += [
            {
                "model": f"{row['shape']} ({args.mix} fixture)",
                "mode": row["activations"],
                "concurrency": 1,
                "workload": f"{args.prefill}-token prefill",
                "maxkv_tok_s": row["maxkv"]["prefill_tokens_per_s"],
                "llamacpp_tok_s": row.get("llama_cpp", {}).get("prefill_tokens_per_s"),
                "maxkv_peak_rss_mib": row["maxkv"]["peak_rss_mib"],
            }
            for row in rows
            if args.prefill
        ]
        from maxkv_bench.report import merge_arith

        merge_arith(args.arith_json, machine, arith)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
