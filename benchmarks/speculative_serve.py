"""Prompt-lookup speculative decoding in ``max serve`` on maxkv, against vLLM's.

The requests of ``benchmarks/speculative.py`` (``grounded``: copy or lightly
edit a given license passage; ``summarize``; ``chat``), as streamed chat
completions, greedy, up to ``--new-tokens`` tokens, with C requests in flight
(``--concurrency``, default 1, 4, 16).  Sides, one server at a time, each
started per concurrency with ``--max-batch-size C``:

- ``maxkv``: ``max serve`` on maxkv, one token per request per step;
- ``maxkv-ngram``: the same with ``MAXKV_SPECULATIVE=ngram``
  (``MAXKV_NUM_SPECULATIVE_TOKENS``: ``--k``);
- ``vllm`` and ``vllm-ngram``: vLLM's CPU backend, without and with
  ``--speculative-config '{"method": "ngram", "num_speculative_tokens": k,
  "prompt_lookup_min": 2, "prompt_lookup_max": 4}'``, with the Intel OpenMP
  of vLLM's environment preloaded (``LD_PRELOAD``, as vLLM asks for
  speculative decoding on CPU).

Per side, workload and concurrency: output tokens/s, inter-token latency
(gaps between streamed chunks; a chunk may carry several tokens) and time
per output token per request (its decode time over its tokens after the
first) at p50/p90, the drafts and acceptance the server logged (maxkv: MAX's
``Draft Tokens`` line per batch), and how many texts equal the side without
speculation's.  ``--repeats R`` runs each workload R times per server, in
turns, and keeps the median's numbers.

    python benchmarks/speculative_serve.py --json benchmarks/results/speculative_serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from maxkv_bench.report import machine_info
from serve import Request, model_directory, percentiles, request_stats, server, stream_chat
from speculative import workload_prompts

SIDES = ("maxkv", "maxkv-ngram", "vllm", "vllm-ngram")
_DRAFTS = re.compile(r"Draft Tokens: (\d+)/(\d+)")


async def run_workload(
    url: str, model: str, prompts: list[str], concurrency: int, new_tokens: int
) -> tuple[list[Request], float]:
    """Sends ``prompts`` with ``concurrency`` in flight; returns them and the wall time."""
    import httpx

    requests = [
        Request(f"{i}", [{"role": "user", "content": p}], new_tokens) for i, p in enumerate(prompts)
    ]
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                await stream_chat(client, url, model, queue.get_nowait())

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return requests, elapsed


def summarize(requests: list[Request], elapsed: float, log: str) -> dict[str, Any]:
    """``serve.request_stats``, each request's time per output token, and the
    drafts the server's log (a stretch of it) counts."""
    tpot = [
        (r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1)
        for r in requests
        if r.error is None and r.chunk_times and r.output_tokens > 1
    ]
    accepted = drafted = 0
    for match in _DRAFTS.finditer(log):
        accepted += int(match.group(1))
        drafted += int(match.group(2))
    return {
        **request_stats(requests, elapsed),
        "tpot_s": percentiles(tpot),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "texts": {r.key: r.text for r in requests},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="maxkv model name or HF dir")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--workloads", default="grounded,summarize,chat")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=0, help="per workload (default 4 x C)")
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=4, help="most draft tokens per step")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--vllm", default="/tmp/vllm-venv/bin/vllm", help="vLLM's CLI")
    parser.add_argument("--server-timeout", type=float, default=900.0)
    parser.add_argument("--logs", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if set(args.sides) - set(SIDES):
        parser.error(f"sides are {SIDES}")
    return args


def side_settings(side: str, args: argparse.Namespace) -> argparse.Namespace:
    """``serve.server``'s settings for ``side``."""
    settings = argparse.Namespace(
        max_length=args.max_length,
        server_timeout=args.server_timeout,
        vllm=args.vllm,
        server_args=[],
        maxkv_env=[],
    )
    if side == "maxkv-ngram":
        settings.maxkv_env = ["MAXKV_SPECULATIVE=ngram", f"MAXKV_NUM_SPECULATIVE_TOKENS={args.k}"]
    if side.startswith("vllm"):
        # vLLM asks for Intel's OpenMP preloaded for speculative decoding on CPU.
        iomp = Path(args.vllm).resolve().parents[1] / "lib" / "libiomp5.so"
        settings.vllm_env = {"LD_PRELOAD": str(iomp)} if iomp.is_file() else {}
    if side == "vllm-ngram":
        ngram = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
        settings.vllm_args = ["--speculative-config", json.dumps(ngram)]
    return settings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = model_directory(args.model)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="maxkv_spec_serve_"))
    logs.mkdir(parents=True, exist_ok=True)
    most = args.requests or max(8, 2 * max(args.concurrency))
    prompts = {w: workload_prompts(w, most) for w in args.workloads}
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    for concurrency in args.concurrency:
        count = args.requests or max(8, 2 * concurrency)
        for side in args.sides:
            kind = "vllm" if side.startswith("vllm") else "maxkv"
            settings = side_settings(side, args)
            log_path = logs / f"{side}_c{concurrency}.log"
            print(f"[{side}] starting, C={concurrency} ...", file=sys.stderr, flush=True)
            try:
                runs += run_side(side, kind, model_dir, concurrency, settings, log_path, prompts,
                                 count, args)  # fmt: skip
            except RuntimeError as error:  # a server that does not start: reported, not fatal
                failures.append(f"{side} C={concurrency}: {str(error)[-600:]}")
                print(f"[{side}] failed: {error}", file=sys.stderr, flush=True)
    table = compare(runs)
    print_table(runs, table)
    for failure in failures:
        print(f"FAILED {failure}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine_info("cpu"),
                    "model": str(model_dir),
                    "settings": {k: str(v) for k, v in vars(args).items()},
                    "comparison": table,
                    "failures": failures,
                    "runs": runs,
                },
                indent=1,
            )
        )
    print(f"server logs: {logs}", file=sys.stderr)
    return 0


def run_side(
    side: str,
    kind: str,
    model_dir: Path,
    concurrency: int,
    settings: argparse.Namespace,
    log_path: Path,
    prompts: dict[str, list[str]],
    count: int,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """One server of ``side``: every workload, ``--repeats`` times each."""
    runs = []
    with server(kind, model_dir, concurrency, settings, log_path) as url:
        asyncio.run(run_workload(url, str(model_dir), ["Say one word."], 1, 8))  # warm-up
        for workload in args.workloads:
            per_repeat = []
            for _ in range(args.repeats):
                offset = log_path.stat().st_size
                requests, elapsed = asyncio.run(
                    run_workload(
                        url, str(model_dir), prompts[workload][:count], concurrency,
                        args.new_tokens,
                    )
                )  # fmt: skip
                time.sleep(1.5)  # the last batch's log line
                with log_path.open() as log:
                    log.seek(offset)
                    text = log.read()
                per_repeat.append(summarize(requests, elapsed, text))
            median = sorted(per_repeat, key=lambda r: r["tokens_per_s"])[len(per_repeat) // 2]
            run = {
                "side": side,
                "workload": workload,
                "concurrency": concurrency,
                "tokens_per_s_all": [r["tokens_per_s"] for r in per_repeat],
                **median,
            }
            runs.append(run)
            print(
                f"[{side}] {workload} C={concurrency}: {run['tokens_per_s']:.1f} tok/s, "
                f"ITL p90 {run['itl_s']['p90']}, acceptance {run['acceptance']}, "
                f"failed {run['failed']}",
                file=sys.stderr,
                flush=True,
            )
    return runs


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each speculative side against its side without speculation (and maxkv's
    against vLLM's), per workload and concurrency."""
    by_key = {(r["side"], r["workload"], r["concurrency"]): r for r in runs}
    rows = []
    pairs = [("maxkv-ngram", "maxkv"), ("vllm-ngram", "vllm"), ("maxkv-ngram", "vllm-ngram")]
    for (side, workload, concurrency), ours in sorted(by_key.items()):
        for a, b in pairs:
            theirs = by_key.get((b, workload, concurrency))
            if side != a or theirs is None:
                continue
            same = sum(1 for k, t in ours["texts"].items() if theirs["texts"].get(k) == t and t)
            rows.append(
                {
                    "workload": workload,
                    "concurrency": concurrency,
                    "side": a,
                    "against": b,
                    "throughput_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
                    "itl_p90_ratio": _ratio(ours["itl_s"]["p90"], theirs["itl_s"]["p90"]),
                    "tpot_p90_ratio": _ratio(ours["tpot_s"]["p90"], theirs["tpot_s"]["p90"]),
                    "same_texts": same,
                    "requests": len(ours["texts"]),
                }
            )
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_table(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.1f}"

    print(
        f"{'workload':<10} {'C':>3} {'side':<12} {'tok/s':>7} {'ITL p50/p90 ms':>15} "
        f"{'TPOT p50/p90 ms':>16} {'accepted':>14} {'failed':>6}"
    )
    for r in runs:
        acc = "-" if r["acceptance"] is None else f"{r['accepted']}/{r['drafted']}"
        print(
            f"{r['workload']:<10} {r['concurrency']:>3} {r['side']:<12} {r['tokens_per_s']:>7.1f} "
            f"{ms(r['itl_s']['p50']):>7}/{ms(r['itl_s']['p90']):>7} "
            f"{ms(r['tpot_s']['p50']):>8}/{ms(r['tpot_s']['p90']):>7} {acc:>14} {r['failed']:>6}"
        )
    print()
    for row in rows:
        print(
            f"{row['workload']:<10} C={row['concurrency']:<3} {row['side']}/{row['against']}: "
            f"throughput {row['throughput_ratio']:.2f}x, ITL p90 {_fmt(row['itl_p90_ratio'])}, "
            f"TPOT p90 {_fmt(row['tpot_p90_ratio'])}; same texts "
            f"{row['same_texts']}/{row['requests']}"
        )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
