"""The GPU study, one command: maxkv vs MAX's own GPU kernels and pipeline.

    python benchmarks/gpu_study.py --json benchmarks/results/gpu_h100.json
    python benchmarks/gpu_study.py --json R.json --parts reduce --jobs 4
    python benchmarks/gpu_study.py --json R.json --parts end_to_end --shapes llama3_8b
    python benchmarks/gpu_study.py --json R.json --parts end_to_end \
        --shapes qwen2.5-0.5b,qwen3-0.6b,gemma-3-1b,llama-3.2-1b
    python benchmarks/gpu_study.py --smoke --device cpu --json /tmp/smoke.json
    python benchmarks/gpu_study.py --device virtual --parts reduce,compile --json R.json

``--device virtual`` needs no GPU: MAX 26.7 compiles for a GPU that is not
attached (virtual devices, ``--target``, default ``cuda:sm_90``, an H100), so
the compile-only parts, ``reduce`` and ``compile``, run on any machine, MAX's
own pipeline included (what ``max warm-cache --target`` does).  The other two
parts need a real device.

Parts (``--parts``, default all but ``export``, in this order): ``reduce``,
``compile``, ``export``, ``attention``, ``end_to_end``; see
``maxkv_bench/gpu.py`` for what each measures.  ``export`` (with
``--export-mefs``, on virtual devices) compiles the graphs of ``attention``
and ``end_to_end`` here; ``--precompiled-mefs`` there loads them instead of
compiling (``benchmarks/gpu_machine.sh`` carries everything to a lent GPU
machine).  Every part merges its results into ``--json`` as it finishes, so a
study that takes more than one device call (each call is cut at 10 minutes)
runs part by part, or shape by shape, into one file: the required fields are
``end_to_end`` rows (``shape, layers, batch, maxkv_tokens_per_s,
max_pipeline_tokens_per_s, same_tokens``), ``compile_s`` (``maxkv``,
``max_pipeline``), ``attention_decode`` rows (``batch, context, maxkv_ms,
max_paged_ms, maxkv_GBps``) and ``machine.read_bandwidth_GBps``.

On a lent GPU machine (nothing can be fetched there): carry MAX 26.7's cp312
wheels (``max``, ``max-core``, ``max-mojo-libs``, ``max-shmem-libs``, ``mojo``,
``mojo-compiler``, ``mojo-compiler-mojo-libs``, about 286 MB: more than one
call's 64 MiB, so in parts over calls made while the machine is warm, kept in
``/tmp``), install them with ``pip --no-deps --target``, put ``python/`` on
``PYTHONPATH``, then run this script with the machine's ``python3`` (it has
torch, transformers, tokenizers and safetensors).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

from max.driver import (
    CPU,
    Accelerator,
    Device,
    set_virtual_device_api,
    set_virtual_device_count,
    set_virtual_device_target_arch,
)
from max.engine import InferenceSession
from maxkv_bench import gpu
from maxkv_bench.report import machine_info


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="results file, merged into part by part")
    parser.add_argument(
        "--parts", help="comma-separated parts (default: all; reduce,compile when virtual)"
    )
    parser.add_argument("--device", choices=["gpu", "cpu", "virtual"], default="gpu")
    parser.add_argument(
        "--target", default="cuda:sm_90", help="virtual: the GPU to compile for (API:arch)"
    )
    parser.add_argument("--smoke", action="store_true", help="toy sizes (the tests' check)")
    parser.add_argument("--variants", help="reduce / compile: only these variant names")
    parser.add_argument("--jobs", type=int, default=4, help="reduce: compiles at once")
    parser.add_argument("--timeout", type=float, default=540, help="seconds per compile")
    parser.add_argument(
        "--shapes",
        help="end_to_end / export shapes (default smollm2,llama3_8b; tiny with --smoke); "
        "the families: qwen2.5-0.5b,qwen3-0.6b,gemma-3-1b,llama-3.2-1b (<name>@tiny: 2 layers)",
    )
    parser.add_argument(
        "--batches",
        default="1,8,32,64",
        help="end_to_end batch sizes (MAX's generate() prefills at most 8192 tokens: 64 "
        "prompts of 128)",
    )
    parser.add_argument("--workdir", type=Path, help="checkpoints (default: a temp folder)")
    parser.add_argument(
        "--export-mefs", type=Path, help="write every graph compiled to this folder (export)"
    )
    parser.add_argument(
        "--precompiled-mefs",
        type=Path,
        action="append",
        help="load graphs from artifacts in this folder instead of compiling (repeatable)",
    )
    parser.add_argument("--compile-variant", help=argparse.SUPPRESS)  # a subprocess's job
    return parser.parse_args()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def open_device(kind: str, target: str = "cuda:sm_90") -> Device:
    """The device of ``--device``; ``virtual`` switches this process to MAX's
    compile-only virtual devices for ``target`` first."""
    if kind == "virtual":
        api, _, arch = target.partition(":")
        if not api or not arch:
            raise SystemExit(f"--target must be API:ARCH (cuda:sm_90), got {target!r}")
        set_virtual_device_api(api)
        set_virtual_device_target_arch(arch)
        set_virtual_device_count(1)
    return CPU() if kind == "cpu" else Accelerator()


def _model_name(device: Device) -> str:
    try:
        return f"{device.model_name} ({device.architecture_name})"
    except Exception:  # a name is only a label
        return str(device)


def compile_one(args: argparse.Namespace) -> int:
    """Subprocess: compile one variant, print one JSON line (the parent reads it)."""
    variant = gpu.Variant(**json.loads(args.compile_variant))
    try:
        workdir = args.workdir or Path.cwd()
        result = gpu.compile_variant(variant, open_device(args.device, args.target), workdir)
    except Exception as exc:  # the parent records any failure
        traceback.print_exc()
        result = {"ok": False, "error": gpu.telling_lines(str(exc))}
    print(gpu.RESULT_MARK + json.dumps(result), flush=True)
    return 0


def main() -> int:
    args = parse_args()
    if args.compile_variant:
        return compile_one(args)
    measuring = tuple(p for p in gpu.PARTS if p != "export")
    default_parts = ("reduce", "compile") if args.device == "virtual" else measuring
    parts = [p for p in (args.parts or ",".join(default_parts)).split(",") if p]
    unknown = sorted(set(parts) - set(gpu.PARTS))
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; choose from {gpu.PARTS}")
    if args.json is None:
        raise SystemExit("--json is required: every part merges its results into it")
    if args.device == "virtual" and set(parts) - {"reduce", "compile", "export"}:
        raise SystemExit(
            "--device virtual compiles only: choose --parts from reduce,compile,export"
        )
    if "export" in parts and args.export_mefs is None:
        raise SystemExit("--parts export writes its graphs to --export-mefs FOLDER")
    if args.export_mefs is not None and args.precompiled_mefs:
        raise SystemExit("pass at most one of --export-mefs and --precompiled-mefs")
    device = open_device(args.device, args.target)
    gpu.use_mef_store(args.export_mefs, args.precompiled_mefs, log)
    session = InferenceSession(devices=[device])
    kind = "smoke" if args.smoke else args.device
    if args.device == "virtual":
        kind = f"virtual {args.target}"
    machine = machine_info(kind) | {"device_model": _model_name(device)}
    gpu.merge_into(args.json, {"machine": machine, "command": " ".join(sys.argv)})
    only = set(args.variants.split(",")) if args.variants else None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="maxkv_gpu_study_"))
    # The end-to-end run's sizes (the export part compiles its graphs for them).
    shapes = (args.shapes or ("tiny" if args.smoke else "smollm2,llama3_8b")).split(",")
    batches = [1, 2] if args.smoke else [int(b) for b in args.batches.split(",")]
    dtype = gpu.DTYPES["float32" if args.smoke else "bfloat16"]
    prompt_len, new_tokens, num_steps = (8, 4, 4) if args.smoke else (128, 64, 4)
    for part in parts:
        start = time.perf_counter()
        log(f"== {part}")
        if part in ("reduce", "compile"):
            variants = (gpu.reduce_variants if part == "reduce" else gpu.compile_variants)(
                args.smoke
            )
            variants = [v for v in variants if only is None or v.name in only]
            results = gpu.run_variants(
                variants,
                args.device,
                args.target,
                jobs=args.jobs if part == "reduce" else 1,  # compile: timed alone
                timeout_s=args.timeout,
                fresh_caches=part == "compile",
                log=log,
            )
            if part == "reduce":
                gpu.merge_into(args.json, {"reduce": results})
            else:
                seconds = {r["variant"]["name"]: r.get("seconds") for r in results if r.get("ok")}
                gpu.merge_into(args.json, {"compile_s": seconds, "compile": results})
        elif part == "attention":
            bandwidth, rows = gpu.attention(session, device, smoke=args.smoke, log=log)
            gpu.merge_into(
                args.json,
                {
                    "machine": {"read_bandwidth_GBps": round(bandwidth, 1)},
                    "attention_decode": rows,
                },
            )
        elif part == "export":
            rows = gpu.export_graphs(
                session,
                device,
                shapes,
                batches,
                smoke=args.smoke,
                dtype=dtype,
                max_len=prompt_len + new_tokens + num_steps,
                workdir=workdir,
                log=log,
            )
            gpu.merge_into(args.json, {"export": rows})
        else:
            rows = gpu.end_to_end(
                session,
                device,
                shapes,
                batches,
                dtype=dtype,
                prompt_len=prompt_len,
                new_tokens=new_tokens,
                repeats=1 if args.smoke else 3,
                num_steps=num_steps,
                workdir=workdir,
                log=log,
            )
            gpu.merge_into(args.json, {"end_to_end": rows})
        log(f"== {part} done in {time.perf_counter() - start:.0f} s")
    log(f"results merged into {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
