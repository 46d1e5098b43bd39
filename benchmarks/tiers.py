"""KV tiers on the real model (SmolLM2-135M-Instruct, float32, CPU), all in one run.

1. ``cross_process``: a first process computes prompts that share a ~600-token
   system message and writes their pages to Redis; this process then answers
   other questions behind the same system message, each on a fresh cache (empty
   device, empty host tier): time to first token with the Redis tier against
   its own full prefill (tiers off), medians over ``--repeats`` questions, and
   the generated tokens compared.
2. ``memory_pressure``: 32 chat requests (a ~250-token system message, answers
   up to 256 tokens, stopping at EOS), 16 in flight, on a page budget of 40% of
   what 16 requests at full length need: waiting for pages (``"wait"``) against
   preemption by swap and by recompute with the host tier, same tokens.
3. ``offload_overhead``: 32 plain questions, 128 tokens each, twice the pages
   the batch can hold: tokens/s with tiers off, the host tier, host + Redis
   (signed blocks; and signed and encrypted), nothing evicted or loaded, so the
   tiers only take writes; interleaved, medians.
4. ``block_cost``: what framing one SmolLM2 page costs, in microseconds:
   encoding and decoding unsigned, signed (HMAC-SHA256) and signed and
   encrypted (AES-256-GCM) blocks, medians.

Blocks in Redis are signed (``secret``) as ``max serve`` requires; part 1 runs
once with signed blocks and once with signed and encrypted ones.

    python benchmarks/tiers.py --json benchmarks/results/tiers_avx512.json

Needs ``redis-server`` on the PATH (``apt-get install redis-server``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from max.driver import CPU
from max.engine import InferenceSession

from maxkv import PagedKVCacheManager
from maxkv.models.decoder import DecoderModel, cache_params
from maxkv.models.resolve import LoadedModel, open_model
from maxkv.serving.scheduler import ContinuousBatchingScheduler, positions_needed
from maxkv.tiers import TierConfig
from maxkv.tiers.local_server import LocalRedisServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from maxkv_bench.real import QUESTIONS
from maxkv_bench.report import machine_info
from maxkv_bench.sequence_ops import SYSTEM_PROMPT as CHAT_SYSTEM
from serve import SYSTEM_PROMPT as LONG_SYSTEM

PAGE = 16
MODEL_ID = "smollm2-135m-instruct-gguf"
#: The secret the benchmark's processes share (a throwaway).
SECRET = "maxkv-benchmark-secret-0123456789"


@contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; yields its URL."""
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    with tempfile.TemporaryDirectory() as directory, LocalRedisServer(Path(directory)) as server:
        yield server.url


class Bench:
    """The model compiled once for 16-token pages; a fresh manager per measurement."""

    def __init__(self, model: LoadedModel, session: InferenceSession) -> None:
        self.model = model
        self.session = session
        self.llama: DecoderModel | None = None

    def manager(
        self, num_pages: int, batch: int, tiers: TierConfig | None = None
    ) -> PagedKVCacheManager:
        config = self.model.config
        manager = PagedKVCacheManager(
            cache_params(config),
            PAGE,
            num_pages,
            batch,
            1024,
            config.num_hidden_layers,
            [CPU()],
            self.session,
            enable_prefix_caching=True,
            tiers=tiers,
        )
        if self.llama is None:
            self.llama = DecoderModel(
                config, self.model.weights, manager, self.session, quantized=self.model.quantized
            )
        return manager

    def run(
        self,
        manager: PagedKVCacheManager,
        prompts: list[list[int]],
        new_tokens: int,
        batch: int,
        *,
        preemption: str = "wait",
        stop_at_eos: bool = True,
    ) -> dict[str, Any]:
        assert self.llama is not None
        scheduler = ContinuousBatchingScheduler(
            self.llama,
            manager,
            batch,
            num_steps=4,
            stop_at_eos=stop_at_eos,
            preemption=preemption,
        )
        for prompt in prompts:
            scheduler.submit(prompt, new_tokens)
        first: list[float] = []
        start = time.perf_counter()
        outputs, stats = scheduler.run(
            on_round=lambda s, n: first.append(time.perf_counter() - start) if not first else None
        )
        return {"outputs": outputs, "stats": stats, "ttft_s": first[0]}


def chat(model: LoadedModel, system: str, question: str) -> list[int]:
    assert model.tokenizer is not None
    return model.tokenizer.encode_chat(question, system=system)


_FIRST_PROCESS = """
import json, sys
from max.driver import CPU
from max.engine import InferenceSession
from maxkv import PagedKVCacheManager
from maxkv.models.decoder import DecoderModel, cache_params
from maxkv.models.resolve import open_model
from maxkv.serving.scheduler import ContinuousBatchingScheduler
from maxkv.tiers import TierConfig
from maxkv.tiers.local_server import LocalRedisServer

url, model_id, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
security = json.loads(sys.argv[4])
model = open_model("smollm2-135m", progress=False)
session = InferenceSession(devices=[CPU()])
config = model.config
manager = PagedKVCacheManager(
    cache_params(config), 16, 256, 4, 1024, config.num_hidden_layers, [CPU()], session,
    enable_prefix_caching=True, tiers=TierConfig(model_id=model_id, redis_url=url, **security),
)
llama = DecoderModel(config, model.weights, manager, session, quantized=model.quantized)
scheduler = ContinuousBatchingScheduler(llama, manager, 4, num_steps=4)
for prompt in prompts:
    scheduler.submit(prompt, 8)
scheduler.run()
manager.close()
print(json.dumps(manager.tiers.stats.as_dict()))
"""


def cross_process(bench: Bench, url: str, repeats: int, encrypt: bool) -> dict[str, Any]:
    model = bench.model
    first_prompts = [chat(model, LONG_SYSTEM, q) for q in QUESTIONS[:2]]
    # Its own namespace: the blocks of an earlier part are not read here.
    security = {"secret": SECRET, "encrypt": encrypt, "redis_namespace": f"x{time.time()}"}
    done = subprocess.run(
        [
            *(sys.executable, "-c", _FIRST_PROCESS),
            *(url, MODEL_ID, json.dumps(first_prompts), json.dumps(security)),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        check=True,
    )
    writer = json.loads(done.stdout.strip().splitlines()[-1])
    rows = []
    for i in range(repeats):
        prompt = chat(model, LONG_SYSTEM, QUESTIONS[2 + i])
        result: dict[str, Any] = {}
        order = ["redis", "full"] if i % 2 == 0 else ["full", "redis"]
        for kind in order:
            tiers = None
            if kind == "redis":
                tiers = TierConfig(model_id=MODEL_ID, redis_url=url, **security)  # type: ignore[arg-type]
            manager = bench.manager(128, 1, tiers)
            run = bench.run(manager, [prompt], 16, 1)
            result[kind] = run
            if kind == "redis":
                result["loaded_tokens"] = manager.tier_hit_tokens
                result["redis_hits"] = manager.tiers.stats.redis_hits  # type: ignore[union-attr]
            manager.close()
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "loaded_tokens": result["loaded_tokens"],
                "redis_hits": result["redis_hits"],
                "ttft_redis_s": result["redis"]["ttft_s"],
                "ttft_full_prefill_s": result["full"]["ttft_s"],
                "same_tokens": result["redis"]["outputs"] == result["full"]["outputs"],
            }
        )
        print(
            f"  cross-process {i}: {len(prompt)} tokens, {result['loaded_tokens']} from Redis: "
            f"TTFT {rows[-1]['ttft_redis_s'] * 1e3:.0f} ms vs full prefill "
            f"{rows[-1]['ttft_full_prefill_s'] * 1e3:.0f} ms, same tokens {rows[-1]['same_tokens']}"
        )
    redis_ttft = statistics.median(r["ttft_redis_s"] for r in rows)
    full_ttft = statistics.median(r["ttft_full_prefill_s"] for r in rows)
    return {
        "blocks": "signed and encrypted" if encrypt else "signed",
        "first_process_tier_stats": writer,
        "rows": rows,
        "median_ttft_redis_s": redis_ttft,
        "median_ttft_full_prefill_s": full_ttft,
        "ratio": redis_ttft / full_ttft,
        "same_tokens": all(r["same_tokens"] for r in rows),
    }


def memory_pressure(bench: Bench, requests: int, batch: int, new_tokens: int) -> dict[str, Any]:
    """Two page budgets, each 40% of a need: of the worst case (every request of a full
    batch at its longest answer: what ``"wait"`` reserves), and of the peak pages the
    workload really holds (measured on a run with pages for everything)."""
    prompts = [
        chat(bench.model, CHAT_SYSTEM, QUESTIONS[i % len(QUESTIONS)]) for i in range(requests)
    ]
    per_request = -(-positions_needed(max(len(p) for p in prompts), new_tokens, 4) // PAGE)
    worst_case = batch * per_request
    manager = bench.manager(worst_case, batch)
    free_run = bench.run(manager, prompts, new_tokens, batch, preemption="swap")
    peak = free_run["stats"].peak_units_in_use
    manager.close()
    print(f"  pages: {worst_case} for the worst case, {peak} at the peak of a run without limit")
    budgets = []
    for need_name, need in (("worst_case", worst_case), ("peak_use", peak)):
        pages = max(per_request, int(0.4 * need))
        rows = []
        for policy in ("wait", "swap", "recompute"):
            tiers = None if policy == "wait" else TierConfig(model_id=MODEL_ID)
            manager = bench.manager(pages, batch, tiers)
            run = bench.run(manager, prompts, new_tokens, batch, preemption=policy)
            stats = run["stats"]
            rows.append(
                {
                    "policy": policy,
                    "tiers": "host" if tiers else "none",
                    "tokens_per_s": stats.tokens_per_s,
                    "elapsed_s": stats.elapsed_s,
                    "generated_tokens": stats.generated_tokens,
                    "mean_batch_occupancy": stats.mean_occupancy,
                    "preemptions": stats.preemptions,
                    "recomputed_tokens": stats.recomputed_tokens,
                    "page_waits": stats.page_waits,
                    "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
                    "tier_hit_tokens": manager.tier_hit_tokens,
                    "same_tokens": run["outputs"] == free_run["outputs"],
                }
            )
            manager.close()
            print(
                f"  {need_name} x 0.4 = {pages} pages, {policy:9s}: {stats.tokens_per_s:6.1f} "
                f"tok/s, occupancy {stats.mean_occupancy:.2f}, {stats.preemptions} preemptions,"
                f" {stats.recomputed_tokens} recomputed, same tokens {rows[-1]['same_tokens']}"
            )
        wait = rows[0]["tokens_per_s"]
        budgets.append(
            {
                "budget_of": need_name,
                "need_pages": need,
                "pages": pages,
                "rows": rows,
                "swap_vs_wait": rows[1]["tokens_per_s"] / wait,
                "recompute_vs_wait": rows[2]["tokens_per_s"] / wait,
            }
        )
    return {
        "requests": requests,
        "batch": batch,
        "max_new_tokens": new_tokens,
        "budgets": budgets,
    }


def offload_overhead(
    bench: Bench, url: str, requests: int, batch: int, new_tokens: int, repeats: int
) -> dict[str, Any]:
    prompts = [chat(bench.model, "", QUESTIONS[i % len(QUESTIONS)]) for i in range(requests)]
    # Twice the pages the batch can hold: released prefixes stay cached, nothing is evicted.
    pages = 2 * batch * -(-positions_needed(max(len(p) for p in prompts), new_tokens, 4) // PAGE)
    configs = {
        "off": None,
        "host": TierConfig(model_id=MODEL_ID),
        "host+redis": TierConfig(
            model_id=MODEL_ID, redis_url=url, redis_namespace=f"o{time.time()}", secret=SECRET
        ),
        "host+redis encrypted": TierConfig(
            model_id=MODEL_ID,
            redis_url=url,
            redis_namespace=f"e{time.time()}",
            secret=SECRET,
            encrypt=True,
        ),
    }
    samples: dict[str, list[float]] = {k: [] for k in configs}
    evictions = {}
    outputs = {}
    bench.run(bench.manager(pages, batch), prompts[:batch], 8, batch)  # warm up
    for _ in range(repeats):
        for name, tiers in configs.items():
            manager = bench.manager(pages, batch, tiers)
            run = bench.run(manager, prompts, new_tokens, batch, stop_at_eos=False)
            samples[name].append(run["stats"].tokens_per_s)
            evictions[name] = manager.prefix_cache_stats.evictions
            outputs[name] = run["outputs"]
            manager.close()
        print("  offload overhead: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()))
    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "requests": requests,
        "batch": batch,
        "new_tokens": new_tokens,
        "pages": pages,
        "tokens_per_s": samples,
        "median_tokens_per_s": medians,
        "slowdown_host": 1 - medians["host"] / medians["off"],
        "slowdown_host_redis": 1 - medians["host+redis"] / medians["off"],
        "slowdown_host_redis_encrypted": 1 - medians["host+redis encrypted"] / medians["off"],
        "device_evictions": evictions,
        "same_tokens": all(o == outputs["off"] for o in outputs.values()),
    }


def block_cost(bench: Bench, repeats: int) -> dict[str, Any]:
    """Microseconds to encode and decode one page of the model, per framing."""
    import numpy as np

    from maxkv.tiers import Keyring, decode_block, encode_block

    manager = bench.manager(2, 1)
    layout = manager.block_layout(MODEL_ID)
    manager.close()
    page = np.random.default_rng(0).standard_normal(layout.page_shape()).astype(np.float32)
    key = bytes(range(16))
    rows = []
    for name, keyring in (
        ("unsigned (CRC-32 only)", None),
        ("signed (HMAC-SHA256)", Keyring(SECRET)),
        ("signed and encrypted (AES-256-GCM)", Keyring(SECRET, encrypt=True)),
    ):
        encode, decode = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            data = encode_block(layout, key, page, keyring=keyring, tenant="t")
            t1 = time.perf_counter()
            back, _ = decode_block(layout, key, data, keyring=keyring, tenant="t")
            t2 = time.perf_counter()
            encode.append(t1 - t0)
            decode.append(t2 - t1)
        assert np.array_equal(back, page)
        rows.append(
            {
                "framing": name,
                "page_bytes": int(page.nbytes),
                "block_bytes": len(data),
                "encode_us": statistics.median(encode) * 1e6,
                "decode_us": statistics.median(decode) * 1e6,
            }
        )
        print(
            f"  {name:36s} encode {rows[-1]['encode_us']:7.0f} us, decode "
            f"{rows[-1]['decode_us']:7.0f} us per {page.nbytes / 1e6:.2f} MB page"
        )
    base = rows[0]
    for row in rows[1:]:
        row["added_encode_us"] = row["encode_us"] - base["encode_us"]
        row["added_decode_us"] = row["decode_us"] - base["decode_us"]
    return {"repeats": repeats, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="where to save the results")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="questions of cross_process, rounds of offload_overhead",
    )
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    parser.add_argument(
        "--only",
        choices=["cross_process", "memory_pressure", "offload_overhead", "block_cost"],
        action="append",
        help="run only these parts (repeatable; --json then keeps the file's other parts)",
    )
    args = parser.parse_args(argv)
    model = open_model("smollm2-135m", progress=False)
    bench = Bench(model, InferenceSession(devices=[CPU()]))
    results: dict[str, Any] = {"machine": machine_info("cpu"), "model": "SmolLM2-135M-Instruct"}
    quick = args.quick
    parts = args.only or ["cross_process", "memory_pressure", "offload_overhead", "block_cost"]
    with redis_server() as url:
        if "cross_process" in parts:
            print("cross-process prefix through Redis")
            results["cross_process"] = cross_process(
                bench, url, 2 if quick else args.repeats, encrypt=False
            )
            print("cross-process prefix through Redis, encrypted blocks")
            results["cross_process_encrypted"] = cross_process(
                bench, url, 2 if quick else args.repeats, encrypt=True
            )
        if "memory_pressure" in parts:
            print("memory pressure")
            results["memory_pressure"] = memory_pressure(
                bench, 8 if quick else 32, 4 if quick else 16, 64 if quick else 256
            )
        if "offload_overhead" in parts:
            print("offload overhead")
            results["offload_overhead"] = offload_overhead(
                bench,
                url,
                8 if quick else 32,
                4 if quick else 16,
                32 if quick else 128,
                1 if quick else args.repeats,
            )
        if "block_cost" in parts:
            print("block cost")
            results["block_cost"] = block_cost(bench, 20 if quick else 200)
    print()
    for part in ("cross_process", "cross_process_encrypted"):
        if part not in results:
            continue
        c = results[part]
        print(
            f"second process TTFT / full prefill, {c['blocks']} blocks: {c['ratio']:.3f} "
            f"({c['median_ttft_redis_s'] * 1e3:.0f}"
            f" / {c['median_ttft_full_prefill_s'] * 1e3:.0f} ms, same tokens {c['same_tokens']})"
        )
    for b in results.get("memory_pressure", {}).get("budgets", []):
        print(
            f"memory pressure, 40% of {b['budget_of']} ({b['pages']} pages): tokens/s vs wait: "
            f"swap {b['swap_vs_wait']:.2f}x, recompute {b['recompute_vs_wait']:.2f}x"
        )
    if "offload_overhead" in results:
        o = results["offload_overhead"]
        print(
            f"offload overhead: host {o['slowdown_host'] * 100:+.1f}%, host+Redis (signed) "
            f"{o['slowdown_host_redis'] * 100:+.1f}%, encrypted "
            f"{o['slowdown_host_redis_encrypted'] * 100:+.1f}% (same tokens {o['same_tokens']})"
        )
    for row in results.get("block_cost", {}).get("rows", [])[1:]:
        print(
            f"{row['framing']}: +{row['added_encode_us']:.0f} us to encode, "
            f"+{row['added_decode_us']:.0f} us to decode a page"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        if args.only and args.json.exists():  # the other parts stay as they were
            results = {**json.loads(args.json.read_text()), **results}
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
