"""Replicas of ``max serve`` on maxkv behind vllm-router: routing blind or by KV events.

    python benchmarks/cluster.py --json benchmarks/results/cluster.json

A multi-tenant chat workload: ``--tenants`` tenants, each with its own system
prompt of about ``--system-tokens`` tokens (a slice of the GPL-3 text in
``/usr/share/common-licenses``, each tenant's from another place), and
``--questions`` questions per tenant, interleaved (every tenant's first
question, then every tenant's second, ..., each round in a seeded order),
``--concurrency`` in flight, greedy, ``--max-tokens`` new tokens.  There are
``--replicas`` replicas of ``max serve`` on maxkv (SmolLM2 by default), each
with a KV budget (``MAXKV_KV_CACHE_GB``; default: the pages of half the
tenants' prompts and of the requests in flight) and no host tier, behind
vllm-router with each policy in turn:

- ``round_robin``: blind;
- ``cache_aware``: the router's approximate prefix tree of what it sent where
  (no events);
- ``kv_aware``: maxkv's KV events (``MAXKV_KV_EVENTS_ENDPOINT``) and the render
  routes;
- ``kv_aware+redis``: the same, with a shared signed Redis tier behind the
  replicas (a throwaway ``redis-server`` on loopback).

The replicas start once for the first three policies (their prefix caches are
reset between them: ``POST /reset_prefix_cache``) and again with Redis for the
fourth.  Per policy: the prefix-cache hit rate (cached prompt tokens over
prompt tokens, from each answer's ``usage``), time to first token p50/p90,
output tokens/s (all output tokens over the wall time), and the texts (how
many equal round_robin's).  ``--sides vllm`` runs the same with replicas of
vLLM's CPU backend publishing its own events (``--kv-events-config``), behind
the same router (``../shared/notes/peer-servers-on-cpu.md`` installs it).

``--publish-overhead`` instead measures what publishing costs: one replica,
``--concurrency`` distinct short questions in flight, with and without
``MAXKV_KV_EVENTS_ENDPOINT``, alternating ``--repeats`` times; output tokens/s
of each and the events published and dropped (from the server's log).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from maxkv_bench.report import machine_info
from serve import (
    LONG_DOCUMENT_PATH,
    QUESTIONS,
    Request,
    free_port,
    model_directory,
    percentiles,
    server,
    stream_chat,
)

POLICIES = ("round_robin", "cache_aware", "kv_aware", "kv_aware+redis")
#: Tokens per block (maxkv's page); vLLM's CPU attention takes multiples of 32 only.
BLOCK = {"maxkv": 16, "vllm": 32}
#: Characters of the GPL-3 text per system-prompt token (SmolLM2's tokenizer, about).
CHARS_PER_TOKEN = 4.3


def tenant_prompts(tenants: int, tokens: int) -> list[str]:
    """Each tenant's system prompt: its name, then its own slice of the GPL-3 text."""
    text = LONG_DOCUMENT_PATH.read_text()
    size = int(tokens * CHARS_PER_TOKEN)
    step = max(1, (len(text) - size) // max(1, tenants))
    return [
        f"You are the assistant of tenant {t}. Answer from this document.\n\n"
        + text[t * step : t * step + size]
        for t in range(tenants)
    ]


def workload(args: argparse.Namespace) -> list[Request]:
    prompts = tenant_prompts(args.tenants, args.system_tokens)
    # Every tenant asks once a round, in a seeded order of its own each round (a fixed
    # order would let round_robin put each tenant on the same replica every time).
    tenants = range(args.tenants)
    rounds = [random.Random(q).sample(tenants, args.tenants) for q in range(args.questions)]
    return [
        Request(
            f"t{t}/q{q}",
            [
                {"role": "system", "content": prompts[t]},
                {"role": "user", "content": QUESTIONS[(q * 7 + t) % len(QUESTIONS)]},
            ],
            args.max_tokens,
        )
        for q, order in enumerate(rounds)
        for t in order
    ]


async def drive(url: str, model: str, requests: list[Request], concurrency: int) -> float:
    """Sends ``requests`` in order, ``concurrency`` in flight; the wall time."""
    import httpx

    queue = list(reversed(requests))

    async def worker(client: Any) -> None:
        while queue:
            await stream_chat(client, url, model, queue.pop())

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(900)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return time.perf_counter() - started


@contextlib.contextmanager
def router(
    policy: str, workers: list[str], sources: list[tuple[str, str]], block: int, log: Path
) -> Iterator[str]:
    """vllm-router with ``policy`` in front of ``workers``; ``sources``: each worker's
    event and replay endpoints (kv_aware)."""
    port = free_port()
    command = [
        shutil.which("vllm-router") or "vllm-router",
        *("--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers),
        *("--policy", policy.split("+")[0], "--prometheus-port", str(free_port())),
        *("--log-level", "debug"),
    ]
    if policy.startswith("kv_aware"):
        for worker, (events, replay) in zip(workers, sources, strict=True):
            command += ["--kv-event-source", f"{worker}={events}"]
            command += ["--kv-event-replay-source", f"{worker}={replay}"]
        command += ["--kv-event-block-size", str(block), "--kv-event-model", "bench"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vllm-router did not start:\n{log.read_text()[-3000:]}")
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5):
                        break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    time.sleep(1)
            yield url
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def server_args(args: argparse.Namespace, side: str, env: dict[str, str]) -> argparse.Namespace:
    """The namespace :func:`serve.server` reads, for one replica."""
    flags = ["--enable-prefix-caching", "--kv-cache-page-size", str(BLOCK["maxkv"])]
    # Eager: its compiled start takes 3 minutes here for about the same speed on this model.
    vllm_args = ["--enable-prefix-caching", "--block-size", str(BLOCK["vllm"]), "--enforce-eager"]
    vllm_args += ["--enable-prompt-tokens-details", "--enable-scale-out"]  # usage, render
    if args.kv_cache_gb and side == "vllm":
        block_bytes = kv_bytes_per_token(args.model_dir) * BLOCK["vllm"]
        blocks = int(args.kv_cache_gb * 2**30 / block_bytes)
        vllm_args += ["--num-gpu-blocks-override", str(blocks)]
    if side == "vllm" and "events" in env:
        # vLLM's publisher binds only an endpoint with a wildcard host (it connects to
        # any other, for a broker); the router connects to it on loopback.
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": env["events"].replace("127.0.0.1", "*"),
            "replay_endpoint": env["replay"].replace("127.0.0.1", "*"),
            "topic": "",
        }
        vllm_args += ["--kv-events-config", json.dumps(config)]
    vllm_args += args.vllm_arg
    return argparse.Namespace(
        max_length=args.max_length,
        server_args=[] if side == "vllm" else flags,
        maxkv_env=[f"{k}={v}" for k, v in env.items() if k.startswith("MAXKV_")],
        server_timeout=900.0,
        vllm=args.vllm,
        vllm_args=vllm_args,
        vllm_env=dict(kv.split("=", 1) for kv in args.vllm_env),
        api="chat",
    )


@contextlib.contextmanager
def replicas(
    args: argparse.Namespace, side: str, model_dir: Path, logs: Path, redis_url: str | None
) -> Iterator[tuple[list[str], list[tuple[str, str]]]]:
    """``--replicas`` servers, one after the other started; their URLs and event endpoints."""
    with contextlib.ExitStack() as stack:
        urls, sources = [], []
        for i in range(args.replicas):
            events = f"tcp://127.0.0.1:{free_port()}"
            replay = f"tcp://127.0.0.1:{free_port()}"
            env = {
                "MAXKV_KV_EVENTS_ENDPOINT": events,
                "MAXKV_KV_EVENTS_REPLAY_ENDPOINT": replay,
                "MAXKV_HOST_TIER_GB": "0",
                "MAXKV_KV_CACHE_GB": str(args.kv_cache_gb),
                "events": events,
                "replay": replay,
            }
            if redis_url is not None:
                env.update(MAXKV_REDIS_URL=redis_url, MAXKV_TIER_SECRET="bench-secret-0123456789")
            name = f"{side}{'_redis' if redis_url else ''}_{i}"
            print(f"[{name}] starting ...", file=sys.stderr, flush=True)
            urls.append(
                stack.enter_context(
                    server(
                        side,
                        model_dir,
                        args.concurrency,
                        server_args(args, side, env),
                        logs / f"{name}.log",
                    )
                )
            )
            sources.append((events, replay))
        yield urls, sources


def run_policy(
    args: argparse.Namespace,
    policy: str,
    urls: list[str],
    sources: list[tuple[str, str]],
    model: str,
    logs: Path,
    side: str,
) -> dict[str, Any]:
    for url in urls:  # every policy starts from empty prefix caches
        request = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
        with contextlib.suppress(urllib.error.URLError):
            urllib.request.urlopen(request, timeout=30).close()
    time.sleep(2.0)
    log = logs / f"router_{side}_{policy}.log"
    with router(policy, urls, sources, BLOCK[side], log) as url:
        requests = workload(args)
        elapsed = asyncio.run(drive(url, model, requests, args.concurrency))
    ok = [r for r in requests if r.error is None]
    ttft = [r.chunk_times[0] - r.sent for r in ok if r.chunk_times]
    prompt = sum(r.prompt_tokens for r in ok)
    tokens = sum(r.output_tokens for r in ok)
    row = {
        "side": side,
        "policy": policy,
        "requests": len(requests),
        "failed": len(requests) - len(ok),
        "errors": sorted({r.error for r in requests if r.error})[:3],
        "prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        "prompt_tokens": prompt,
        "ttft_p50_s": percentiles(ttft)["p50"],
        "ttft_p90_s": percentiles(ttft)["p90"],
        "tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "output_tokens": tokens,
        "duration_s": elapsed,
        "texts": {r.key: r.text for r in requests},
    }
    hit = row["prefix_hit_rate"]
    print(
        f"[{side} {policy}] hit rate {hit if hit is None else round(hit, 3)}, TTFT p50 "
        f"{row['ttft_p50_s']:.2f} s, {row['tokens_per_s']:.1f} tok/s, failed {row['failed']}",
        file=sys.stderr,
        flush=True,
    )
    return row


def compare(rows: list[dict[str, Any]]) -> None:
    """Per side, how many texts equal its round_robin run's, and the ratios the goals name."""
    for side in {r["side"] for r in rows}:
        mine = [r for r in rows if r["side"] == side]
        base = next((r for r in mine if r["policy"] == "round_robin"), None)
        for row in mine:
            if base is not None:
                same = sum(row["texts"][k] == v for k, v in base["texts"].items())
                row["texts_equal_round_robin"] = f"{same}/{len(base['texts'])}"
                for name in ("ttft_p50_s", "tokens_per_s", "prefix_hit_rate"):
                    if base[name] and row[name] is not None:
                        row[f"{name}_vs_round_robin"] = row[name] / base[name]


def publish_overhead(args: argparse.Namespace, model_dir: Path, logs: Path) -> list[dict[str, Any]]:
    """Output tokens/s of one replica with and without KV events, alternating."""
    runs = []
    for repeat in range(args.repeats):
        for events in (False, True):
            env: dict[str, str] = {}
            if events:
                env["MAXKV_KV_EVENTS_ENDPOINT"] = f"tcp://127.0.0.1:{free_port()}"
            name = f"overhead_{'events' if events else 'plain'}_{repeat}"
            log = logs / f"{name}.log"
            namespace = server_args(args, "maxkv", env)
            with server("maxkv", model_dir, args.concurrency, namespace, log) as url:
                subscriber = None
                if events:  # a subscriber, as a router would be
                    import zmq

                    subscriber = zmq.Context.instance().socket(zmq.SUB)
                    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
                    subscriber.connect(env["MAXKV_KV_EVENTS_ENDPOINT"])
                questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(3 * args.concurrency)]
                requests = [
                    Request(f"q{i}", [{"role": "user", "content": q}], 64)
                    for i, q in enumerate(questions)
                ]
                elapsed = asyncio.run(drive(url, str(model_dir), requests, args.concurrency))
                received: list[int] = []
                if subscriber is not None:
                    while subscriber.poll(200):
                        received.append(int.from_bytes(subscriber.recv_multipart()[1], "big"))
                    subscriber.close(linger=0)
            text = log.read_text()
            tokens = sum(r.output_tokens for r in requests if r.error is None)
            runs.append(
                {
                    "events": events,
                    "repeat": repeat,
                    "tokens_per_s": tokens / elapsed,
                    "failed": sum(r.error is not None for r in requests),
                    # The publisher logs every batch it drops (queue full); a subscriber
                    # sees any it missed as a gap in the sequence numbers.
                    "drop_warnings": text.count("KV event queue full"),
                    "batches_received": len(received) if events else None,
                    "sequence_gaps": (
                        received[-1] - received[0] + 1 - len(received) if received else None
                    ),
                }
            )
            print(f"[{name}] {runs[-1]}", file=sys.stderr, flush=True)
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="maxkv model name or HF dir")
    parser.add_argument("--sides", default="maxkv", help="maxkv, vllm or both (maxkv,vllm)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"of {','.join(POLICIES)}")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--questions", type=int, default=4, help="per tenant")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        default=0.0,
        help="each replica's KV budget (default: half the tenants' prompts and the requests "
        "in flight)",
    )
    parser.add_argument("--vllm", default="/tmp/vllm-venv/bin/vllm", help="vLLM's CLI")
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra vllm serve flag")
    parser.add_argument("--vllm-env", action="append", default=[], help="NAME=VALUE for vLLM")
    parser.add_argument("--publish-overhead", action="store_true")
    parser.add_argument("--repeats", type=int, default=2, help="--publish-overhead's A/B pairs")
    parser.add_argument("--logs", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    args.policies = [p for p in args.policies.split(",") if p]
    if set(args.policies) - set(POLICIES) or set(args.sides) - {"maxkv", "vllm"}:
        parser.error(f"policies are {POLICIES}; sides maxkv and vllm")
    return args


def kv_bytes_per_token(model_dir: Path) -> int:
    """Bytes of one token's keys and values in float32, every layer."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(2 * config["num_hidden_layers"] * heads * head_dim * 4)


def default_kv_budget(args: argparse.Namespace, model_dir: Path) -> float:
    """GiB of half the tenants' prompts and of the requests in flight (float32 KV)."""
    block = max(BLOCK.values())
    tokens = (args.tenants // 2) * args.system_tokens + args.concurrency * (args.max_tokens + block)
    return round(tokens * kv_bytes_per_token(model_dir) / 2**30, 4)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = model_directory(args.model)
    args.model_dir = model_dir
    logs = args.logs or Path(tempfile.mkdtemp(prefix="maxkv_cluster_"))
    logs.mkdir(parents=True, exist_ok=True)
    if not args.kv_cache_gb:
        args.kv_cache_gb = default_kv_budget(args, model_dir)
    started = time.time()
    results: dict[str, Any] = {
        "machine": machine_info("cpu"),
        "model": str(model_dir),
        "settings": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("json", "logs")
        },
    }
    if args.publish_overhead:
        results["publish_overhead"] = publish_overhead(args, model_dir, logs)
    else:
        rows: list[dict[str, Any]] = []
        for side in args.sides:
            plain = [p for p in args.policies if not p.endswith("+redis")]
            if plain:
                with replicas(args, side, model_dir, logs, None) as (urls, sources):
                    for policy in plain:
                        row = run_policy(args, policy, urls, sources, str(model_dir), logs, side)
                        rows.append(row)
            if "kv_aware+redis" in args.policies and side == "maxkv":
                from maxkv.tiers.local_server import LocalRedisServer

                (logs / "redis").mkdir(exist_ok=True)

                with (
                    LocalRedisServer(logs / "redis") as redis,
                    replicas(args, side, model_dir, logs, redis.url) as (urls, sources),
                ):
                    policy = "kv_aware+redis"
                    row = run_policy(args, policy, urls, sources, str(model_dir), logs, side)
                    rows.append(row)
        compare(rows)
        results["rows"] = rows
        print_rows(rows)
    results["elapsed_s"] = time.time() - started
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    print(f"logs: {logs}", file=sys.stderr)
    return 0


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'side':6} {'policy':15} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'tok/s':>7} {'texts = rr':>10} failed")  # fmt: skip
    for r in rows:
        hit = "-" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.3f}"
        print(
            f"{r['side']:6} {r['policy']:15} {hit:>8} {r['ttft_p50_s']:>9.2f} "
            f"{r['ttft_p90_s']:>9.2f} {r['tokens_per_s']:>7.1f} "
            f"{r.get('texts_equal_round_robin', '-'):>10} {r['failed']}"
        )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
