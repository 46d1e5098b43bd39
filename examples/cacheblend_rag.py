"""CacheBlend on SmolLM2-135M-Instruct: RAG prompts of 5-6 retrieved chunks (1,000+ tokens).

Each question's prompt concatenates the chat header, five or six text chunks from
`examples/data/rag_corpus.json` and the question.  Every question is answered
three ways on the same model and maxkv cache, and the time to first token
(TTFT) of each is reported:

- full: every prompt token is prefilled;
- prefix: prefix caching reuses what an earlier prompt shares with this one's
  beginning (the header and the first chunk);
- blend: CacheBlend reuses the stored KV of every chunk, wherever it sits,
  and recomputes only `--recompute-ratio` of their tokens (those whose KV
  deviates most at the check layer) plus the question.

Chunk KV is computed once per chunk (alone, as a chunk store would hold it)
before the questions.  Answers are greedy; the summary reports the median
TTFT ratios, how often blend's first token equals full prefill's, and the
token F1 and ROUGE-L of blend's and prefix's answers against full prefill's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from max.driver import CPU
from max.engine import InferenceSession

from maxkv.blend import rouge_l, token_f1
from maxkv.blend.rag import RagRunner, build_rag_prompt
from maxkv.models import ModelFetchError, ModelLoadError
from maxkv.models.resolve import open_model

CORPUS = Path(__file__).with_name("data") / "rag_corpus.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a known model name or a path")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="chunks and questions (JSON)")
    parser.add_argument("--recompute-ratio", type=float, default=0.15)
    parser.add_argument(
        "--check-layers", default="1", help="comma-separated layers where deviation is measured"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--questions", type=int, help="answer only the first N questions")
    parser.add_argument(
        "--chunk-context",
        choices=["header", "none"],
        default="header",
        help="store each chunk's KV computed after the chat header (default) or alone",
    )
    parser.add_argument("--store-dir", type=Path, help="keep chunk KV here across runs")
    parser.add_argument("--output-json", type=Path, help="write per-question results and summary")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not 0.0 <= args.recompute_ratio <= 1.0:
            raise ValueError("--recompute-ratio must be in [0, 1]")
        if args.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        if args.questions is not None and args.questions < 1:
            raise ValueError("--questions must be >= 1")
        check_layers = tuple(int(x) for x in args.check_layers.split(","))
        corpus = json.loads(args.corpus.read_text())
        questions = corpus["questions"][: args.questions]
        if not questions:
            raise ValueError("no questions to answer")
        model = open_model(args.model)
        if any(layer >= model.config.num_hidden_layers for layer in check_layers):
            raise ValueError(f"--check-layers must be below {model.config.num_hidden_layers}")
        prompts = [
            build_rag_prompt(model, [corpus["chunks"][c] for c in q["chunks"]], q["question"])
            for q in questions
        ]
    except (ModelLoadError, ModelFetchError, ValueError, KeyError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    assert model.tokenizer is not None

    device = CPU()
    session = InferenceSession(devices=[device])
    print(f"model: {model.description}; compiling (the first run takes a few minutes)...")
    started = time.perf_counter()
    runner = RagRunner(
        model,
        session,
        device,
        store_dir=args.store_dir,
        chunk_context=args.chunk_context == "header",
    )
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    for prompt in prompts:
        runner.store_segments(prompt)
        runner.seed_prefix_cache(prompt)
    store_s = time.perf_counter() - started
    print(
        f"compiled in {compile_s:.0f} s; {len(runner.store)} chunks stored and prefix cache "
        f"seeded in {store_s:.1f} s"
    )
    # Warm-up: the first call of each path pays one-time costs.
    runner.full(prompts[0], 2)
    runner.blend(prompts[0], 2, args.recompute_ratio, check_layers)

    rows = []
    for q, prompt in zip(questions, prompts, strict=True):
        full = runner.full(prompt, args.max_new_tokens)
        prefix = runner.prefix(prompt, args.max_new_tokens)
        blend = runner.blend(prompt, args.max_new_tokens, args.recompute_ratio, check_layers)
        decode = model.tokenizer.decode
        row = {
            "question": q["question"],
            "prompt_tokens": len(prompt.tokens),
            "ttft_full_s": round(full.ttft_s, 4),
            "ttft_prefix_s": round(prefix.ttft_s, 4),
            "ttft_blend_s": round(blend.ttft_s, 4),
            "prefix_reused_tokens": prefix.reused_tokens,
            "blend_reused_tokens": blend.reused_tokens,
            "blend_recomputed_tokens_per_layer": runner.prefill.tokens_per_layer[-1],
            "answer_full": decode(full.tokens),
            "answer_prefix": decode(prefix.tokens),
            "answer_blend": decode(blend.tokens),
            "first_token_match": blend.tokens[0] == full.tokens[0],
            "prefix_first_token_match": prefix.tokens[0] == full.tokens[0],
            "blend_token_f1": round(token_f1(blend.tokens, full.tokens), 4),
            "blend_rouge_l": round(rouge_l(blend.tokens, full.tokens), 4),
            "prefix_token_f1": round(token_f1(prefix.tokens, full.tokens), 4),
            "prefix_rouge_l": round(rouge_l(prefix.tokens, full.tokens), 4),
        }
        rows.append(row)
        print(
            f"\nQ: {row['question']} ({row['prompt_tokens']} prompt tokens)\n"
            f"  full   {row['ttft_full_s']:.3f} s: {row['answer_full']}\n"
            f"  prefix {row['ttft_prefix_s']:.3f} s ({prefix.reused_tokens} reused): "
            f"{row['answer_prefix']}\n"
            f"  blend  {row['ttft_blend_s']:.3f} s ({blend.reused_tokens} reused, "
            f"{row['blend_recomputed_tokens_per_layer']} recomputed per layer): "
            f"{row['answer_blend']}"
        )

    def median(key: str) -> float:
        return float(statistics.median(float(r[key]) for r in rows))  # type: ignore[arg-type]

    def mean(key: str) -> float:
        return round(sum(float(r[key]) for r in rows) / len(rows), 4)  # type: ignore[arg-type]

    summary = {
        "questions": len(rows),
        "recompute_ratio": args.recompute_ratio,
        "check_layers": list(check_layers),
        "chunk_context": args.chunk_context,
        "median_ttft_full_s": round(median("ttft_full_s"), 4),
        "median_ttft_prefix_s": round(median("ttft_prefix_s"), 4),
        "median_ttft_blend_s": round(median("ttft_blend_s"), 4),
        "median_ttft_blend_over_full": round(median("ttft_blend_s") / median("ttft_full_s"), 3),
        "median_ttft_prefix_over_full": round(median("ttft_prefix_s") / median("ttft_full_s"), 3),
        "first_token_match_rate": mean("first_token_match"),
        "prefix_first_token_match_rate": mean("prefix_first_token_match"),
        "blend_token_f1_mean": mean("blend_token_f1"),
        "blend_rouge_l_mean": mean("blend_rouge_l"),
        "prefix_token_f1_mean": mean("prefix_token_f1"),
        "prefix_rouge_l_mean": mean("prefix_rouge_l"),
        "compile_s": round(compile_s, 1),
        "store_s": round(store_s, 2),
    }
    print(f"\nsummary: {json.dumps(summary)}")
    if args.output_json:
        args.output_json.write_text(json.dumps({"questions": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
