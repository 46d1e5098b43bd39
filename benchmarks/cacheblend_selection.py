"""CacheBlend's first token vs full prefill's, across token-selection variants.

    python benchmarks/cacheblend_selection.py --json F [--questions N]

(``benchmarks/results/cacheblend_selection.json`` holds a run with ``--questions 12``.)

On the questions of ``examples/cacheblend_rag.py`` (SmolLM2-135M-Instruct,
chunks stored after the chat header), it prints full prefill's first-token
logit margin per question, then for each variant of CacheBlend's selection the
share of first tokens equal to full prefill's and the median blended-prefill
time, then a sweep of ``recompute_ratio`` at check layer 1.  Variants:

- ``k_deviation``: maxkv's executor (squared K deviation, check layer 1).
- ``relative_k_deviation``: the same deviation divided by the fresh K's norm.
- ``gradual_0.30_0.15`` / ``gradual_0.50_0.15``: the paper's gradual filtering,
  that share of the retrieved tokens kept at layer 1, narrowed to 0.15 at layer 2.
- ``check_layer_0`` / ``check_layer_2``: selection at another layer.
- ``chunk_heads_8`` / ``chunk_heads_32``: maxkv's selection plus the first 8 or
  32 tokens of every chunk (EPIC's remedy for the attention each chunk's first
  tokens draw when it is computed alone).
- ``question_attention``: the tokens the question attends to most at the check
  layer (softmax of its fresh Q against the fresh K, summed over its tokens and
  heads) instead of the most deviating ones; ``question_attention_x_deviation``:
  ranked by that attention times the K deviation's norm.

Every row also records, per question, the blended logit margin of full
prefill's first token (its logit minus the best other one: negative where the
blend picks another token), so a shift that selection does not undo shows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from max.driver import CPU
from max.engine import InferenceSession

from maxkv.blend import CacheBlendExecutor
from maxkv.blend.executor import Rerotate
from maxkv.blend.rag import RagPrompt, RagRunner, build_rag_prompt
from maxkv.models.resolve import open_model

CORPUS = Path(__file__).resolve().parent.parent / "examples" / "data" / "rag_corpus.json"


class VariantExecutor(CacheBlendExecutor):
    """maxkv's executor with a share of retrieved tokens per check layer and,
    optionally, deviation relative to the fresh K's norm."""

    def __init__(
        self,
        rerotate: Rerotate,
        shares: Sequence[float],
        check_layers: Sequence[int],
        *,
        relative: bool = False,
    ) -> None:
        super().__init__(rerotate, shares[0], check_layers)
        self.shares = dict(zip(check_layers, shares, strict=True))
        self.relative = relative

    def blend(self, layer_id: int, *args: Any, **kwargs: Any) -> Any:
        if layer_id in self.shares:
            earlier = [s for layer, s in self.shares.items() if layer < layer_id]
            self.recompute_ratio = self.shares[layer_id] / (earlier[-1] if earlier else 1.0)
        return super().blend(layer_id, *args, **kwargs)

    def _select(
        self, fresh_k: np.ndarray, retrieved_k: np.ndarray, valid: np.ndarray, current: np.ndarray
    ) -> np.ndarray:
        if not self.relative:
            return super()._select(fresh_k, retrieved_k, valid, current)
        assert self._starts is not None
        fresh = fresh_k.astype(np.float64).reshape(len(fresh_k), -1)
        old = retrieved_k.astype(np.float64).reshape(len(fresh_k), -1)
        deviation = np.square(fresh - old).sum(1) / (np.square(fresh).sum(1) + 1e-12)
        keep = ~valid
        for start, end in itertools.pairwise(np.searchsorted(current, self._starts)):
            rows = np.arange(start, end)
            candidates = rows[valid[rows]]
            count = math.ceil(self.recompute_ratio * candidates.shape[0])
            if count:
                keep[candidates[np.argsort(-deviation[candidates], kind="stable")[:count]]] = True
        return np.nonzero(keep)[0]


class ChunkHeadsExecutor(CacheBlendExecutor):
    """maxkv's selection plus the first ``head`` tokens of each segment after the first."""

    def __init__(self, rerotate: Rerotate, head: int, segment_starts: Sequence[int]) -> None:
        super().__init__(rerotate, 0.15, (1,))
        self.head = head
        self.segment_starts = list(segment_starts)

    def _select(
        self, fresh_k: np.ndarray, retrieved_k: np.ndarray, valid: np.ndarray, current: np.ndarray
    ) -> np.ndarray:
        keep = np.zeros(current.shape[0], dtype=bool)
        keep[super()._select(fresh_k, retrieved_k, valid, current)] = True
        for start in self.segment_starts[1:]:
            keep |= (current >= start) & (current < start + self.head)
        return np.nonzero(keep)[0]


class QuestionAttentionExecutor(CacheBlendExecutor):
    """Selects the retrieved tokens the non-retrieved ones (the question) attend to
    most at the check layer, optionally weighted by their K deviation."""

    def __init__(self, rerotate: Rerotate, groups: int, *, times_deviation: bool) -> None:
        super().__init__(rerotate, 0.15, (1,))
        self.groups = groups
        self.times_deviation = times_deviation
        self._fresh_q: np.ndarray | None = None

    def blend(self, layer_id: int, *args: Any, **kwargs: Any) -> Any:
        self._fresh_q = kwargs["fresh_q"] if "fresh_q" in kwargs else args[4]
        return super().blend(layer_id, *args, **kwargs)

    def _select(
        self, fresh_k: np.ndarray, retrieved_k: np.ndarray, valid: np.ndarray, current: np.ndarray
    ) -> np.ndarray:
        assert self._fresh_q is not None
        queries = np.nonzero(~valid)[0]
        q = self._fresh_q[queries].astype(np.float64)
        k = np.repeat(fresh_k.astype(np.float64), self.groups, axis=1)
        scores = np.einsum("qhd,thd->hqt", q, k) / math.sqrt(q.shape[-1])
        scores[:, np.arange(len(k))[None, :] > queries[:, None]] = -np.inf  # causal
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attention = (weights / weights.sum(axis=-1, keepdims=True)).sum(axis=(0, 1))
        if self.times_deviation:
            deviation = np.square(fresh_k.astype(np.float64) - retrieved_k.astype(np.float64))
            attention = attention * np.sqrt(deviation.reshape(len(k), -1).sum(axis=1))
        candidates = np.nonzero(valid)[0]
        count = math.ceil(self.recompute_ratio * candidates.shape[0])
        keep = ~valid
        keep[candidates[np.argsort(-attention[candidates], kind="stable")[:count]]] = True
        return np.nonzero(keep)[0]


def margin(logits: np.ndarray, token: int) -> float:
    """``token``'s logit minus the best other one."""
    return float(logits[token] - np.delete(logits, token).max())


def first_logits(
    runner: RagRunner, prompt: RagPrompt, executor: CacheBlendExecutor
) -> tuple[np.ndarray, float]:
    """Blended prefill's last-token logits and its wall time."""
    tokens = np.array(prompt.tokens, dtype=np.int64)
    (seq,) = runner.manager.claim(1)
    try:
        task = runner.retriever.new_request([tokens], [prompt.starts])
        start = time.perf_counter()
        logits = runner.prefill.prefill(tokens, task, executor, runner.manager, seq)
        return logits, time.perf_counter() - start
    finally:
        runner.manager.release(seq)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--questions", type=int, help="only the first N questions of the corpus")
    args = parser.parse_args()
    if args.questions is not None and args.questions < 1:
        parser.error("--questions must be >= 1")

    corpus = json.loads(CORPUS.read_text())
    model = open_model("smollm2-135m")
    prompts = [
        build_rag_prompt(model, [corpus["chunks"][c] for c in q["chunks"]], q["question"])
        for q in corpus["questions"][: args.questions]
    ]
    device = CPU()
    runner = RagRunner(model, InferenceSession(devices=[device]), device)
    for prompt in prompts:
        runner.store_segments(prompt)
    rerotate = runner.prefill.rerotate
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    full = [first_logits(runner, p, runner.prefill.executor(1.0))[0] for p in prompts]
    full_tokens = [int(np.argmax(logits)) for logits in full]
    margins = [margin(logits, token) for logits, token in zip(full, full_tokens, strict=True)]
    for i, (token, gap) in enumerate(zip(full_tokens, margins, strict=True)):
        print(f"question {i}: full prefill's first token {token!r} by a margin of {gap:.3f}")

    def measure(make: Callable[[RagPrompt], CacheBlendExecutor]) -> dict[str, Any]:
        matches, seconds, margins_of_full = [], [], []
        for prompt, token in zip(prompts, full_tokens, strict=True):
            logits, elapsed = first_logits(runner, prompt, make(prompt))
            matches.append(int(np.argmax(logits)) == token)
            margins_of_full.append(round(margin(logits, token), 3))
            seconds.append(elapsed)
        return {
            "first_token_matches": sum(matches),
            "questions": len(matches),
            "missed": [i for i, match in enumerate(matches) if not match],
            "margins_of_full_token": margins_of_full,
            "median_blend_prefill_s": round(statistics.median(seconds), 4),
        }

    variants: dict[str, Callable[[RagPrompt], CacheBlendExecutor]] = {
        "k_deviation": lambda _: runner.prefill.executor(0.15, (1,)),
        "relative_k_deviation": lambda _: VariantExecutor(rerotate, [0.15], [1], relative=True),
        "gradual_0.30_0.15": lambda _: VariantExecutor(rerotate, [0.30, 0.15], [1, 2]),
        "gradual_0.50_0.15": lambda _: VariantExecutor(rerotate, [0.50, 0.15], [1, 2]),
        "check_layer_0": lambda _: runner.prefill.executor(0.15, (0,)),
        "check_layer_2": lambda _: runner.prefill.executor(0.15, (2,)),
        "chunk_heads_8": lambda p: ChunkHeadsExecutor(rerotate, 8, p.starts),
        "chunk_heads_32": lambda p: ChunkHeadsExecutor(rerotate, 32, p.starts),
        "question_attention": lambda _: QuestionAttentionExecutor(
            rerotate, groups, times_deviation=False
        ),
        "question_attention_x_deviation": lambda _: QuestionAttentionExecutor(
            rerotate, groups, times_deviation=True
        ),
    }
    results: dict[str, Any] = {
        "full_first_tokens": full_tokens,
        "full_margins": [round(m, 3) for m in margins],
        "variants": {},
        "ratio_sweep": {},
    }
    for name, make in variants.items():
        results["variants"][name] = row = measure(make)
        print(f"{name}: {row}", flush=True)
    for ratio in (0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 0.9):

        def at_ratio(_: RagPrompt, r: float = ratio) -> CacheBlendExecutor:
            return runner.prefill.executor(r, (1,))

        results["ratio_sweep"][str(ratio)] = row = measure(at_ratio)
        print(f"recompute_ratio {ratio}: {row}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
