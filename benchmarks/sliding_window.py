"""Sliding-window memory: KV bytes per sequence, and ``max serve`` on long chats.

    python benchmarks/sliding_window.py memory --json benchmarks/results/sliding_window_memory.json
    python benchmarks/sliding_window.py serve --json benchmarks/results/sliding_window_serve.json
    python benchmarks/sliding_window.py perplexity \
        --json benchmarks/results/sliding_window_perplexity.json

``memory``: for Gemma-3-1B (26 layers, 22 with a 512-token window) and
Mistral-7B v0.1 (32 layers, all with a 4096-token window), published shapes,
one sequence is prefilled in chunks of 512 tokens and decoded to 2k, 8k and
32k tokens through maxkv's own managers (the hybrid cache for Gemma 3, the
paged cache giving pages back for Mistral), and the pages each group holds
are counted after the last step; bytes are those pages at the model's real
page size (KV heads x head_dim x layers in the group x float32).  Against
the same model's full cache (every page kept: maxkv before, or
``MAXKV_KEEP_WINDOW_PAGES=1``).  The managers' pages buffers are allocated
with 1 KV head of 2 values (the bookkeeping does not depend on it), so the
32k-token sequences fit this machine.

``serve``: ``max serve`` on a small Mistral-architecture model with a
512-token window (``family_models.py``'s ``mistral-tiny-w512``, random
weights, SmolLM2's tokenizer), the same KV memory budget for both runs
(``--device-memory-utilization`` chosen for about ``--budget-sequences``
full-length sequences; the cache size each server logged is reported), C
conversations in flight, each a different ~3,900-token slice of the GPL-3
text (``/usr/share/common-licenses/GPL-3``) as system prompt then 4 turns
resent with the history (64 new tokens each, greedy): up to ~4,200 tokens.
Run once giving pages back (the default) and once with
``MAXKV_KEEP_WINDOW_PAGES=1``.  Per run: the most sequences alive at once
(from ``MAXKV_EVENT_LOG``), output tokens/s, TTFT and inter-token latency
percentiles, preemptions, and whether the texts equal the other run's.

``perplexity``: SmolLM2-135M-Instruct (the README's model) reads the GPL-3
text, then the GPL-3 text again (~15k tokens, past its 8,192-token
context), one token a step through maxkv's paged cache, and the perplexity
of each next token is taken from the model's logits, per 1,024-token
stretch: with full attention (the first 8,192 tokens: its context), with a
window of ``--window`` tokens only (no sinks), and with the window and
``--sinks`` sink tokens (StreamingLLM; the sinks are kept in one page of
16).  Every run reads the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

#: Published shapes (benchmarks/family_models.py) measured by ``memory``.
MEMORY_MODELS = ("gemma-3-1b", "mistral-7b-v0.1")
LENGTHS = (2048, 8192, 32768)
CHUNK = 512
GPL = Path("/usr/share/common-licenses/GPL-3")


# ------------------------------------------------------------------ memory


def decoder_config(name: str) -> Any:
    """The :class:`~maxkv.models.DecoderConfig` of a published shape (no weights)."""
    from family_models import SHAPES
    from transformers import AutoConfig

    from maxkv.models.registry import family_for

    model_type, fields = SHAPES[name]
    hf = AutoConfig.for_model(model_type, **fields).to_dict()
    hf["architectures"] = [
        {"gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM"}[model_type]
    ]
    return family_for(hf).read(hf)


def held_bytes(config: Any, page_size: int, length: int, keep: bool) -> dict[str, Any]:
    """Runs one sequence to ``length`` tokens; the bytes of the pages it holds then,
    and the most it held after any step (a chunked prefill's pages included)."""
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession

    from maxkv import HybridKVCacheManager, KVCacheParams, PagedKVCacheManager
    from maxkv.cache.paged import UNUSED_PAGE
    from maxkv.models.decoder import cache_params

    real = cache_params(config)
    tiny = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=2)
    device = CPU()
    session = InferenceSession(devices=[device])
    pages = math.ceil(length / page_size) + 8
    windows = (None,) * config.num_hidden_layers if keep else config.layer_windows
    groups: list[PagedKVCacheManager]
    manager: PagedKVCacheManager | HybridKVCacheManager
    if None in windows and any(w is not None for w in windows):
        manager = HybridKVCacheManager(
            tiny, page_size, [pages, pages], 1, length, windows, [device], session
        )
        groups = manager.groups
    else:
        window = None if None in windows else max(w for w in windows if w)
        manager = PagedKVCacheManager(
            tiny,
            page_size,
            pages,
            1,
            length,
            config.num_hidden_layers,
            [device],
            session,
            sliding_window=window,
        )
        groups = [manager]
    page_bytes = [
        PagedKVCacheManager.estimated_memory_size(real, page_size, 1, g.num_layers, [device])
        for g in groups
    ]

    def now(seq: int) -> int:
        return sum(
            b * sum(1 for p in g.pages(seq) if p != UNUSED_PAGE)
            for g, b in zip(groups, page_bytes, strict=True)
        )

    (seq,) = manager.claim(1)
    peak = 0
    done = 0
    while done < length:
        new = min(CHUNK, length - done) if done < length - 16 else 1
        manager.fetch([seq], 1, active_lengths=[new])
        peak = max(peak, now(seq))
        manager.step({seq: new})
        done += new
    return {"bytes": now(seq), "peak_bytes": peak}


def memory(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name in MEMORY_MODELS:
        config = decoder_config(name)
        for page_size in args.page_sizes:
            for length in LENGTHS:
                full = held_bytes(config, page_size, length, keep=True)
                given_back = held_bytes(config, page_size, length, keep=False)
                row = {
                    "model": name,
                    "page_size": page_size,
                    "tokens": length,
                    "full_cache_bytes": full["bytes"],
                    "window_bytes": given_back["bytes"],
                    "ratio": given_back["bytes"] / full["bytes"],
                    "window_peak_bytes": given_back["peak_bytes"],
                }
                rows.append(row)
                print(
                    f"{name:16s} page {page_size:4d} {length:6d} tokens: full "
                    f"{full['bytes'] / 2**20:9.1f} MiB, given back "
                    f"{given_back['bytes'] / 2**20:8.1f} MiB ({row['ratio']:.3f}x; "
                    f"peak in prefill chunks of {CHUNK}: "
                    f"{given_back['peak_bytes'] / 2**20:.1f} MiB)",
                    flush=True,
                )
    return {"rows": rows, "chunk": CHUNK}


# ------------------------------------------------------------------- serve


def gpl_slices(tokenizer: Any, count: int, tokens: int) -> list[str]:
    """``count`` different ``tokens``-token stretches of the GPL-3 text."""
    ids = tokenizer(GPL.read_text())["input_ids"]
    step = max(1, (len(ids) - tokens) // max(1, count - 1))
    return [tokenizer.decode(ids[i * step : i * step + tokens]) for i in range(count)]


QUESTIONS = [
    "What does this text say about conveying copies?",
    "Which obligations does it put on someone who modifies the program?",
    "Summarize the previous answer in one sentence.",
    "What is said about warranties?",
]


def alive_at_once(events: Path) -> int:
    """Most sequences alive at once, from ``MAXKV_EVENT_LOG``'s alloc/release lines."""
    alive = most = 0
    for line in events.read_text().splitlines():
        event = json.loads(line)["event"]
        alive += 1 if event == "alloc" else -1
        most = max(most, alive)
    return most


async def chats(url: str, model: str, contexts: list[str], args: argparse.Namespace) -> Any:
    import httpx
    from serve import Request, stream_chat

    done: list[Any] = []
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64)) as c:

        async def conversation(i: int, context: str) -> None:
            history: list[dict[str, str]] = []
            for turn, question in enumerate(QUESTIONS[: args.turns]):
                messages = [
                    {"role": "system", "content": context},
                    *history,
                    {"role": "user", "content": question},
                ]
                request = Request(f"chat{i}/t{turn}", messages, args.new_tokens)
                await stream_chat(c, url, model, request)
                done.append(request)
                history += [messages[-1], {"role": "assistant", "content": request.text}]

        start = time.perf_counter()
        await asyncio.gather(*(conversation(i, ctx) for i, ctx in enumerate(contexts)))
        return done, time.perf_counter() - start


def serve(args: argparse.Namespace) -> dict[str, Any]:
    from family_models import make
    from serve import log_counters, server, summarize
    from transformers import AutoTokenizer

    from maxkv.models.export import export_hf_directory
    from maxkv.models.resolve import open_model

    work = Path(args.models)
    model_dir = work / "mistral-tiny-w512"
    if not (model_dir / "config.json").exists():
        smollm2 = Path(tempfile.mkdtemp(prefix="smollm2_"))
        export_hf_directory(open_model("smollm2-135m"), smollm2)
        make("mistral-tiny-w512", model_dir, smollm2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    contexts = gpl_slices(tokenizer, args.conversations, args.context_tokens)
    per_token = 2 * 6 * 2 * 64 * 4  # layers x KV heads x head_dim x float32, K and V
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    from max.driver import CPU

    free = int(CPU().stats["free_memory"])
    budget = args.budget_sequences * args.max_length * per_token
    utilization = (weights + budget) / free
    logs = Path(args.logs or tempfile.mkdtemp(prefix="maxkv_window_serve_"))
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    for keep in (False, True):
        name = "pages kept" if keep else "pages given back"
        events = logs / f"events_keep{int(keep)}.jsonl"
        events.unlink(missing_ok=True)
        args.maxkv_env = [
            f"MAXKV_EVENT_LOG={events}",
            f"MAXKV_KEEP_WINDOW_PAGES={int(keep)}",
        ]
        args.server_args = [f"--device-memory-utilization={utilization:.6f}"]
        log_path = logs / f"serve_keep{int(keep)}.log"
        print(f"[{name}] starting max serve ...", file=sys.stderr, flush=True)
        with server("maxkv", model_dir, args.conversations, args, log_path) as url:
            requests, elapsed = asyncio.run(chats(url, str(model_dir), contexts, args))
            time.sleep(1.5)
        text = log_path.read_text()
        cache = re.search(r"maxkv: .*?(paged cache: [^\n]*)", text)
        run = {
            "run": name,
            "cache_log": cache.group(1) if cache else None,
            "most_sequences_at_once": alive_at_once(events),
            **summarize(requests, elapsed, log_counters(text)),
        }
        runs.append(run)
        print(
            f"[{name}] {run['most_sequences_at_once']} sequences at once, "
            f"{run['tokens_per_s']:.1f} tok/s, preemptions {run['preemptions_logged']}, "
            f"failed {run['failed']}; {run['cache_log']}",
            file=sys.stderr,
            flush=True,
        )
    same = sum(runs[0]["texts"][k] == runs[1]["texts"].get(k) for k in runs[0]["texts"])
    return {
        "model": "mistral-tiny-w512 (random weights, window 512)",
        "settings": {
            "conversations": args.conversations,
            "turns": args.turns,
            "context_tokens": args.context_tokens,
            "new_tokens": args.new_tokens,
            "max_length": args.max_length,
            "budget_sequences": args.budget_sequences,
            "device_memory_utilization": utilization,
        },
        "same_texts": f"{same}/{len(runs[0]['texts'])}",
        "concurrency_ratio": runs[0]["most_sequences_at_once"]
        / max(1, runs[1]["most_sequences_at_once"]),
        "runs": runs,
    }


# -------------------------------------------------------------- perplexity


def perplexity(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from max.driver import CPU, Buffer
    from max.engine import InferenceSession

    from maxkv import PagedKVCacheManager
    from maxkv.models import DecoderModel
    from maxkv.models.decoder import cache_params
    from maxkv.models.resolve import open_model

    loaded = open_model("smollm2-135m")
    assert loaded.tokenizer is not None
    config = loaded.config
    text = GPL.read_text()
    ids = loaded.tokenizer.encode(text) + loaded.tokenizer.encode(text, add_special_tokens=False)
    ids = ids[: args.tokens]
    context = config.max_position_embeddings
    device = CPU()
    session = InferenceSession(devices=[device])
    page = 16
    manager = PagedKVCacheManager(
        cache_params(config),
        page,
        context // page + 8,
        1,
        context,
        config.num_hidden_layers,
        [device],
        session,
        key_rotation=config.key_rotation(),
    )
    model = DecoderModel(
        config, loaded.weights, manager, session, output="logits", quantized=loaded.quantized
    )
    runs: dict[str, Any] = {}
    for name, sinks in (("full attention", None), ("window", 0), ("window + sinks", args.sinks)):
        limit = min(len(ids), context) if sinks is None else len(ids)
        (seq,) = manager.claim(1)
        if sinks is not None:
            manager.enable_sliding_window(seq, args.window, sinks)
        nll = []
        started = time.perf_counter()
        for i in range(limit - 1):
            (kv,) = manager.fetch([seq], 1)
            token = Buffer.from_numpy(np.array([ids[i]], dtype=np.int64))
            offsets = Buffer.from_numpy(np.array([0, 1], dtype=np.uint32))
            logits = model.execute(token, offsets, kv).to_numpy()[0].astype(np.float64)
            manager.step({seq: 1})
            top = logits.max()
            nll.append(top + math.log(np.exp(logits - top).sum()) - logits[ids[i + 1]])
        elapsed = time.perf_counter() - started
        manager.release(seq)
        stretches = [
            {
                "tokens": [start + 1, min(start + 1024, limit - 1)],
                "perplexity": float(math.exp(np.mean(nll[start : start + 1024]))),
            }
            for start in range(0, len(nll), 1024)
        ]
        runs[name] = {
            "tokens_read": limit,
            "perplexity": float(math.exp(np.mean(nll))),
            "perplexity_first_4096": float(math.exp(np.mean(nll[:4095]))),
            "per_1024_tokens": stretches,
            "seconds": elapsed,
        }
        print(
            f"{name:15s}: perplexity {runs[name]['perplexity']:.2f} over {limit} tokens, "
            f"first 4096: {runs[name]['perplexity_first_4096']:.2f}; per 1024: "
            + ", ".join(f"{s['perplexity']:.1f}" for s in stretches),
            flush=True,
        )
    full = runs["full attention"]["perplexity_first_4096"]
    return {
        "model": "smollm2-135m",
        "text": f"{GPL} twice",
        "window": args.window,
        "sinks": args.sinks,
        "context": context,
        "ratio_to_full_first_4096": {
            name: run["perplexity_first_4096"] / full for name, run in runs.items()
        },
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("memory", "serve", "perplexity"))
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=15000)
    parser.add_argument("--page-sizes", default="16,128")
    parser.add_argument("--models", default="/work/bench_models", help="checkpoints folder")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context-tokens", type=int, default=3900)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=4608)
    parser.add_argument("--budget-sequences", type=float, default=4.0)
    parser.add_argument("--server-timeout", type=float, default=900.0)
    parser.add_argument("--request-timeout", type=float, default=1800.0)
    parser.add_argument("--logs", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.page_sizes = [int(p) for p in args.page_sizes.split(",")]
    from maxkv_bench.report import machine_info

    started = time.time()
    result = {"memory": memory, "serve": serve, "perplexity": perplexity}[args.part](args)
    result = {"machine": machine_info("cpu"), "elapsed_s": time.time() - started, **result}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
