"""Log probabilities of a request's prompt tokens (``echo`` with ``logprobs``), in
the model worker.

Evaluation harnesses (lm-evaluation-harness's ``local-completions``) score a
text by sending it as a prompt with ``echo: true`` and ``logprobs``: the
answer must hold the log probability of every prompt token after the first,
with the top ``logprobs`` alternatives.  Where each part sits:

1. **Admission** (the KV adapter's ``alloc``): such a request's prompt is
   computed whole: never taken from the prefix cache, a fork or CacheBlend
   (:func:`~maxkv.serving.pipelines.context.wants_prompt_logprobs`), since the
   log probability of a token comes from the row before it, and a cached
   row has no logits.  Its pages still enter the prefix cache for others.
2. **The step** (:meth:`MaxkvPipelineModel.prepare_speculative_inputs`): the
   head (``head_rows="given"``) reads every prompt row of those requests
   only; other requests read their last row.  :class:`PromptRows` records,
   per such request, which token each row predicts.
3. **Log probabilities** (:meth:`MaxkvPipelineModel.compute_log_probabilities`):
   :func:`token_log_probabilities` of the rows, kept across the chunks of a
   chunked prefill (:class:`PromptLogProbabilities`); after the last chunk
   the request's first generated token carries them all, then its own, as
   one entry (prompt token 1 to the end, then the sampled token) that the API
   server splits (:mod:`~maxkv.serving.pipelines.choices`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from max.pipelines.context import LogProbabilities

__all__ = ["PromptLogProbabilities", "PromptRows", "joined", "token_log_probabilities"]


@dataclass(frozen=True)
class PromptRows:
    """One request's prompt rows among one step's head rows."""

    request_id: object
    """The request (MAX's ``RequestID``)."""
    item: int
    """Its index in the step's batch."""
    start: int
    """Its first row among the step's head rows."""
    position: int
    """Where its rows start in the prompt (0 for the first chunk)."""
    rows: int
    """Its rows: its tokens of this step."""
    targets: npt.NDArray[np.int64]
    """The token each row predicts (the next prompt token); one fewer than
    :attr:`rows` when the step ends the prompt: the last row then predicts
    the token the sampler draws."""
    top_n: int
    """Alternatives per token (``logprobs``)."""

    def __post_init__(self) -> None:
        if self.targets.size not in (self.rows, self.rows - 1):
            raise ValueError(
                f"{self.rows} prompt rows predict {self.rows - 1} or {self.rows} tokens, "
                f"not {self.targets.size}"
            )

    @property
    def final(self) -> bool:
        """Whether this step processes the end of the prompt."""
        return self.targets.size < self.rows


#: Rows whose log-softmax is computed at once (bounds the host memory it takes).
ROWS_AT_ONCE = 256


def token_log_probabilities(
    logits: npt.NDArray[np.float32], targets: npt.NDArray[np.int64], top_n: int
) -> LogProbabilities:
    """Per row of ``logits`` (float32 ``[rows, vocab]``), the log probability of its
    ``targets`` entry (int ``[rows]``) and the ``top_n`` most likely tokens (the
    target among them, as MAX's log-probability graph answers: added when it is
    not one of them); ``log_softmax`` accumulated in float64, :data:`ROWS_AT_ONCE`
    rows at a time."""
    return joined(
        [
            _block_log_probabilities(
                logits[i : i + ROWS_AT_ONCE], targets[i : i + ROWS_AT_ONCE], top_n
            )
            for i in range(0, len(targets), ROWS_AT_ONCE)
        ]
    )


def joined(parts: list[LogProbabilities]) -> LogProbabilities:
    """``parts`` (of consecutive tokens) as one."""
    return LogProbabilities(
        token_log_probabilities=[v for p in parts for v in p.token_log_probabilities],
        top_log_probabilities=[v for p in parts for v in p.top_log_probabilities],
        sampled_token_ids=[v for p in parts for v in p.sampled_token_ids],
    )


def _block_log_probabilities(
    logits: npt.NDArray[np.float32], targets: npt.NDArray[np.int64], top_n: int
) -> LogProbabilities:
    rows = np.asarray(logits, dtype=np.float32)
    peak = rows.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(rows - peak).sum(axis=1, dtype=np.float64)) + peak[:, 0]
    index = np.arange(rows.shape[0])
    chosen = rows[index, targets].astype(np.float64) - log_sum
    top: list[dict[int, float]] = []
    if top_n > 0:
        best = np.argpartition(rows, -top_n, axis=1)[:, -top_n:]
        values = rows[index[:, None], best].astype(np.float64) - log_sum[:, None]
        for r in range(rows.shape[0]):
            order = np.argsort(-values[r], kind="stable")
            entry = {int(best[r, i]): float(values[r, i]) for i in order}
            entry[int(targets[r])] = float(chosen[r])
            top.append(entry)
    else:
        top = [{int(t): float(c)} for t, c in zip(targets, chosen, strict=True)]
    return LogProbabilities(
        token_log_probabilities=[float(c) for c in chosen],
        top_log_probabilities=top,
        sampled_token_ids=[int(t) for t in targets],
    )


class PromptLogProbabilities:
    """The prompt log probabilities of requests in a chunked prefill, until their
    last chunk (one per model worker)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: request id -> (the prompt position the next chunk starts at, the chunks' parts)
        self._kept: dict[object, tuple[int, list[LogProbabilities]]] = {}

    def add(
        self, item: PromptRows, logits: npt.NDArray[np.float32], sampled: int
    ) -> LogProbabilities | None:
        """Adds the log probabilities of ``item``'s rows (``logits``: those rows); at
        the end of its prompt (``sampled``: the token drawn after it), returns them
        all, the prompt's tokens after the first then ``sampled``; else ``None``.
        A request whose prompt starts again (preempted, recomputed) starts again
        here; chunks that do not follow each other are a ``ValueError``."""
        targets = item.targets
        if item.final:
            targets = np.concatenate([targets, np.array([sampled], dtype=np.int64)])
        part = token_log_probabilities(logits, targets, item.top_n)
        with self._lock:
            position, kept = self._kept.pop(item.request_id, (0, []))
            if item.position == 0:
                position, kept = 0, []
            if item.position != position:
                raise ValueError(
                    f"prompt log probabilities of request {item.request_id}: a chunk at "
                    f"position {item.position}, the last ended at {position}"
                )
            kept.append(part)
            if not item.final:
                self._kept[item.request_id] = (position + item.rows, kept)
                return None
        return joined(kept)

    def forget(self, request_id: object) -> None:
        """Drops what is kept of a request that ended (cancelled, preempted)."""
        with self._lock:
            self._kept.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)
