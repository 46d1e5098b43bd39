"""maxkv's scheduler on SmolLM2-135M with and without the exact greedy head, in one run.

Both models share one manager, prompts and settings (``num_steps`` 4, 64 new
tokens, no early stop); repeats alternate between them and the first is a
warm-up.  The weights are the GGUF's dequantized (the greedy head decodes heads
held in float32; a head held as blocks is read as blocks).  Prints tokens/s per
batch size, their ratio and whether the tokens are identical, and writes them as
JSON with ``--json``.

    python benchmarks/greedy_head_ab.py --json benchmarks/results/greedy_head_avx512.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from max.driver import CPU
from max.engine import InferenceSession
from maxkv_bench.real import QUESTIONS

from maxkv import ContinuousBatchingKVCacheManager
from maxkv.models.decoder import DecoderModel, cache_params
from maxkv.models.resolve import open_model
from maxkv.serving.scheduler import ContinuousBatchingScheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats after a warm-up")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    device = CPU()
    session = InferenceSession(devices=[device])
    model = open_model("smollm2-135m")
    config = model.config
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), max(batches), 256, config.num_hidden_layers, [device], session
    )
    # The greedy head reads a head held in float32: the GGUF's weights, dequantized.
    dense = {name: model.weights[name] for name in model.weights}
    models: dict[str, DecoderModel] = {}
    for name, flag in (("greedy_head", "1"), ("all_logits", "0")):
        os.environ["MAXKV_GREEDY_HEAD"] = flag
        models[name] = DecoderModel(config, dense, manager, session)
    os.environ.pop("MAXKV_GREEDY_HEAD")
    if not models["greedy_head"].greedy_head:
        raise SystemExit("this CPU has neither AVX-512 VNNI nor AVX2: the greedy head is off")
    if model.tokenizer is None:
        raise SystemExit("the model has no tokenizer to encode the questions with")
    tokenizer = model.tokenizer
    rows = []
    for batch in batches:
        prompts = [tokenizer.encode_chat(q) for q in QUESTIONS[:batch]]
        rates: dict[str, list[float]] = {name: [] for name in models}
        tokens: dict[str, list[list[int]]] = {}
        for repeat in range(args.repeats + 1):
            for name, llama in models.items():
                scheduler = ContinuousBatchingScheduler(llama, manager, batch, 4, stop_at_eos=False)
                for prompt in prompts:
                    scheduler.submit(prompt, args.new_tokens)
                start = time.perf_counter()
                tokens[name], _ = scheduler.run()
                seconds = time.perf_counter() - start
                if repeat:
                    rates[name].append(batch * args.new_tokens / seconds)
        row = {
            "batch": batch,
            "greedy_head_tokens_per_s": float(np.median(rates["greedy_head"])),
            "all_logits_tokens_per_s": float(np.median(rates["all_logits"])),
            "same_tokens": tokens["greedy_head"] == tokens["all_logits"],
        }
        row["ratio"] = row["greedy_head_tokens_per_s"] / row["all_logits_tokens_per_s"]
        rows.append(row)
        print(
            f"batch {batch:3d}: greedy head {row['greedy_head_tokens_per_s']:7.1f} tok/s, "
            f"all logits {row['all_logits_tokens_per_s']:7.1f} tok/s, "
            f"ratio {row['ratio']:.3f}, same tokens {row['same_tokens']}",
            flush=True,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"greedy_head_ab": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
