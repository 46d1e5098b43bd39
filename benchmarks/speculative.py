"""Prompt-lookup speculative decoding in maxkv's scheduler, SmolLM2-135M-Instruct.

Three workloads of real text, greedy, one scheduler run per (workload, batch,
side), requests ``batch`` at a time:

- ``grounded``: copy or lightly edit a given passage (paragraphs of Debian's
  GPL-3 text and of the Apache-2.0 license): the answer repeats the prompt.
- ``summarize``: summarize the same passages in two sentences.
- ``chat``: the end-to-end benchmark's short questions.

Sides: ``plain`` (the model's usual graph, one step per round) and
``speculative`` (``head_rows="given"`` and a ``SpeculativeConfig``); both give
the same tokens (checked and reported).  Each side runs ``--repeats`` times,
in turns; reports the median's tokens/s, model steps and acceptance.

    python benchmarks/speculative.py --json benchmarks/results/speculative_avx512.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from max.driver import CPU
from max.engine import InferenceSession

sys.path.insert(0, str(Path(__file__).resolve().parent))

from maxkv_bench.real import QUESTIONS
from maxkv_bench.report import machine_info

from maxkv import ContinuousBatchingKVCacheManager
from maxkv.models.decoder import DecoderModel, cache_params
from maxkv.models.resolve import open_model
from maxkv.serving.scheduler import ContinuousBatchingScheduler
from maxkv.serving.speculative import SpeculativeConfig

LICENSES = [Path("/usr/share/common-licenses/GPL-3"), Path("/usr/share/common-licenses/Apache-2.0")]
GROUNDED = [
    "Copy the following passage exactly, word for word:\n\n{p}",
    "Rewrite the following passage, keeping every sentence but writing 'the user' "
    "instead of 'you':\n\n{p}",
    "Quote the following passage in full and then say which license it comes from:\n\n{p}",
    "Fix any typos in the following passage and print it again in full:\n\n{p}",
]


def passages(count: int, low: int = 300, high: int = 900) -> list[str]:
    """Paragraphs of ``low`` to ``high`` characters from the license texts, in order."""
    found: list[str] = []
    for path in LICENSES:
        for block in path.read_text().split("\n\n"):
            text = " ".join(block.split())
            if low <= len(text) <= high:
                found.append(text)
    if len(found) < count:
        raise SystemExit(f"only {len(found)} passages of {low}-{high} characters found")
    return found[:count]


def workload_prompts(name: str, count: int) -> list[str]:
    if name == "grounded":
        return [GROUNDED[i % len(GROUNDED)].format(p=p) for i, p in enumerate(passages(count))]
    if name == "summarize":
        return [f"Summarize in two sentences:\n\n{p}" for p in passages(count)]
    if name == "chat":
        return QUESTIONS[:count]
    raise SystemExit(f"unknown workload {name!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="grounded,summarize,chat")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--requests", type=int, default=16, help="requests per run")
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup", default="2,4", help="prompt_lookup_min,max")
    parser.add_argument("--no-adaptive", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, in turns")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    low, high = (int(x) for x in args.lookup.split(","))
    setting = SpeculativeConfig(
        num_speculative_tokens=args.k,
        prompt_lookup_min=low,
        prompt_lookup_max=high,
        adaptive=not args.no_adaptive,
    )
    model = open_model("smollm2-135m")
    assert model.tokenizer is not None
    session = InferenceSession(devices=[CPU()])
    batches = [int(b) for b in args.batches.split(",")]
    workloads = {
        w: [model.tokenizer.encode_chat(t) for t in workload_prompts(w, args.requests)]
        for w in args.workloads.split(",")
    }
    max_len = max(len(p) for ps in workloads.values() for p in ps) + args.new_tokens + 8
    config = model.config

    def manager(batch: int) -> ContinuousBatchingKVCacheManager:
        return ContinuousBatchingKVCacheManager(
            cache_params(config), batch, max_len, config.num_hidden_layers, [CPU()], session
        )

    print("compiling the two graphs ...", flush=True)
    plain = DecoderModel(config, model.weights, manager(1), session, quantized=model.quantized)
    given = DecoderModel(
        config, model.weights, manager(1), session, quantized=model.quantized, head_rows="given"
    )

    def run(prompts: list[list[int]], batch: int, speculative: bool) -> dict[str, Any]:
        cache = manager(batch)
        scheduler = ContinuousBatchingScheduler(
            given if speculative else plain,
            cache,
            batch,
            speculative=setting if speculative else None,
        )
        for p in prompts:
            scheduler.submit(p, args.new_tokens)
        start = time.perf_counter()
        outputs, stats = scheduler.run()
        elapsed = time.perf_counter() - start
        return {"outputs": outputs, "s": elapsed, **stats.as_dict()}

    rows = []
    for workload, prompts in workloads.items():
        for batch in batches:
            run(prompts[:batch], batch, False)  # warm-up
            runs: dict[str, list[dict[str, Any]]] = {"plain": [], "speculative": []}
            for _ in range(args.repeats):  # in turns, so drifts of the machine hit both
                runs["plain"].append(run(prompts, batch, False))
                runs["speculative"].append(run(prompts, batch, True))
            sides = {
                side: {**results[0], "s": statistics.median(r["s"] for r in results)}
                for side, results in runs.items()
            }
            base = sides["plain"]
            for side, r in sides.items():
                tokens = int(r["generated_tokens"])
                row = {
                    "workload": workload,
                    "batch": batch,
                    "side": side,
                    "requests": len(prompts),
                    "prompt_tokens_median": statistics.median(len(p) for p in prompts),
                    "generated_tokens": tokens,
                    "s": round(r["s"], 3),
                    "s_runs": [round(x["s"], 3) for x in runs[side]],
                    "tokens_per_s": round(tokens / r["s"], 1),
                    "x_plain": round(base["s"] / r["s"], 3),
                    "model_steps": r["model_steps"],
                    "draft_tokens": r["draft_tokens"],
                    "accepted_tokens": r["accepted_tokens"],
                    "acceptance_rate": r["acceptance_rate"],
                    "same_tokens_as_plain": r["outputs"] == base["outputs"],
                }
                rows.append(row)
                print(
                    f"{workload:9s} batch {batch:2d} {side:11s} {row['tokens_per_s']:7.1f} tok/s "
                    f"({row['x_plain']:.2f}x)  steps {row['model_steps']:4d}  "
                    f"accepted {row['accepted_tokens']}/{row['draft_tokens']}  "
                    f"same tokens: {row['same_tokens_as_plain']}",
                    flush=True,
                )
    if args.json:
        result = {
            "machine": machine_info("cpu"),
            "setting": vars(setting),
            "new_tokens": args.new_tokens,
            "rows": rows,
        }
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
