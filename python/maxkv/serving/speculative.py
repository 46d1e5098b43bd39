"""Speculative decoding by prompt lookup: drafts found in a sequence's own
tokens, checked by the target model in one step, the rejected ones rolled back.

A decode step with speculation, for each sequence (the scheduler's loop):

1. ``SpeculationPolicy.draft_length`` says how many tokens the sequence may
   draft this step (0: speculation is paused for it, or the batch is too
   large for drafts to pay).
2. ``PromptLookup.propose`` finds the longest recent n-gram that ends the
   sequence (prompt and output) earlier in it and proposes the tokens that
   followed it there.
3. The scheduler appends the drafts after the sequence's pending token:
   ``1 + len(drafts)`` new rows in one ragged step; the model gives the next
   token's distribution at every row.
4. ``accept_greedy`` (temperature 0: a draft stands while it equals the
   argmax) or ``accept_sampled`` (speculative sampling: the output keeps the
   model's distribution exactly) return the tokens to commit: the accepted
   drafts and one more token from the model, never fewer than one.
5. The cache commits the pending token and the accepted drafts; the rows of
   rejected drafts are dropped (``pop_n`` / ``step`` with fewer tokens), and
   ``SpeculationPolicy.record`` updates the sequence's acceptance.

This module is host-side arithmetic on token ids and probabilities: it
imports no cache, graph or model.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..validation import require_int

__all__ = [
    "PromptLookup",
    "SpeculationPolicy",
    "SpeculativeConfig",
    "accept_greedy",
    "accept_sampled",
]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup, as vLLM's ``--speculative-config
    '{"method": "ngram", ...}'`` names it.

    Args:
        num_speculative_tokens: Most draft tokens per sequence per step (k).
        prompt_lookup_min: Shortest n-gram matched.
        prompt_lookup_max: Longest n-gram matched.
        adaptive: Draft per sequence what its acceptance pays for and cap
            the rows of a step (:class:`SpeculationPolicy`); ``False`` drafts
            ``num_speculative_tokens`` whenever a match is found.
        row_cost: With ``adaptive``: what one more row adds to a decode step,
            relative to a one-row step.
        max_batch_tokens: With ``adaptive``: most rows per decode step.
    """

    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    adaptive: bool = True
    row_cost: float = 0.3
    max_batch_tokens: int = 32

    def __post_init__(self) -> None:
        require_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        require_int("max_batch_tokens", self.max_batch_tokens, 1)
        self.lookup()  # validates the n-gram lengths
        # and the policy's settings, those an adaptive policy would use included
        SpeculationPolicy(
            self.num_speculative_tokens, self.row_cost, max_batch_tokens=self.max_batch_tokens
        )

    def lookup(self) -> PromptLookup:
        """The drafter these settings describe."""
        return PromptLookup(self.prompt_lookup_min, self.prompt_lookup_max)

    def policy(self) -> SpeculationPolicy:
        """A fresh policy (per-sequence records) for one scheduler."""
        if self.adaptive:
            return SpeculationPolicy(
                self.num_speculative_tokens,
                row_cost=self.row_cost,
                max_batch_tokens=self.max_batch_tokens,
            )
        return SpeculationPolicy(self.num_speculative_tokens, adaptive=False)


@dataclass(frozen=True)
class PromptLookup:
    """Prompt-lookup drafting (n-gram matching over the sequence's own tokens).

    Args:
        prompt_lookup_min: Shortest n-gram matched (>= 1).
        prompt_lookup_max: Longest n-gram matched (>= ``prompt_lookup_min``).

    The longest n-gram length is tried first; among the earlier occurrences
    of that n-gram the most recent wins (the nearest context is the likeliest
    to repeat).
    """

    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        low = require_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        require_int("prompt_lookup_max", self.prompt_lookup_max, low)

    def propose(self, tokens: Sequence[int] | npt.NDArray[np.integer], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (prompt + output so far).

        For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``: if
        the last ``n`` tokens also occur earlier, ending before the last token,
        the tokens that followed their most recent such occurrence are the
        draft (fewer than ``k`` where the sequence ends first).  No match, or
        ``k == 0``: an empty draft.
        """
        k = require_int("k", k, 0)
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"tokens must be one sequence of ids, got shape {ids.shape}")
        length = len(ids)
        if k == 0 or length < self.prompt_lookup_min + 1:
            return []
        # Candidate starts of an n-gram ending at `end` (exclusive): the
        # positions whose token equals the sequence's last one, before it.
        ends = np.flatnonzero(ids[:-1] == ids[-1]) + 1
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            match = ends[ends >= n]
            if n > 1 and len(match):
                suffix = ids[length - n : length - 1]
                windows = match[:, None] - n + np.arange(n - 1)
                match = match[(ids[windows] == suffix).all(axis=1)]
            if len(match):
                start = int(match[-1])
                return [int(t) for t in ids[start : start + k]]
        return []


def accept_greedy(drafts: Sequence[int], argmax: npt.NDArray[np.integer]) -> list[int]:
    """The tokens a greedy step commits: the drafts while each equals the
    model's argmax at its row, then the model's own next token.

    ``argmax[j]`` is the model's choice after the pending token and the first
    ``j`` drafts (``len(drafts) + 1`` rows).  The result has ``a + 1`` tokens,
    ``a`` the accepted drafts: exactly the tokens decoding one at a time would
    give.
    """
    if len(argmax) != len(drafts) + 1:
        raise ValueError(
            f"argmax needs len(drafts) + 1 = {len(drafts) + 1} rows, got {len(argmax)}"
        )
    out: list[int] = []
    for j, draft in enumerate(drafts):
        if int(argmax[j]) != int(draft):
            break
        out.append(int(draft))
    out.append(int(argmax[len(out)]))
    return out


def accept_sampled(
    drafts: Sequence[int], probs: npt.NDArray[np.floating], rng: np.random.Generator
) -> list[int]:
    """The tokens a sampled step commits, by speculative sampling.

    ``probs[j]`` is the model's next-token distribution after the pending
    token and the first ``j`` drafts (temperature, top-k and the like already
    applied; ``len(drafts) + 1`` rows).  A prompt-lookup draft is a single
    token with probability 1, so draft ``d`` stands with probability
    ``probs[j, d]``; at the first rejection the next token is drawn from
    ``probs[j]`` without ``d`` (renormalized), else after every draft from
    the last row.  Each committed token is distributed exactly as sampling
    one token at a time would give (Leviathan et al., 2023, with a one-hot
    draft distribution).
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != len(drafts) + 1:
        raise ValueError(
            f"probs needs shape [len(drafts) + 1, vocab] = [{len(drafts) + 1}, V], got {p.shape}"
        )
    vocab = p.shape[1]
    out: list[int] = []
    for j, draft in enumerate(drafts):
        d = int(draft)
        if not 0 <= d < vocab:
            raise ValueError(f"draft token {d} is outside the vocabulary of {vocab}")
        if rng.random() < p[j, d]:
            out.append(d)
            continue
        residual = p[j].copy()
        residual[d] = 0.0
        out.append(int(rng.choice(vocab, p=residual / residual.sum())))
        return out
    out.append(int(rng.choice(vocab, p=p[-1] / p[-1].sum())))
    return out


@dataclass
class _SequenceRecord:
    accepted: float  # decayed count of drafts that stood
    checked: float  # decayed count of drafts checked up to the first rejection
    paused: int = 0  # steps left without drafts
    backoff: int = 0  # the next pause's length


@dataclass
class SpeculationPolicy:
    """How many tokens each sequence drafts, so that speculation only runs
    where it pays.

    A sequence's acceptance ``a`` is the chance that a draft token stands
    given that those before it did: decayed counts of the drafts that stood
    over those checked up to each step's first rejection, starting from
    ``prior`` (worth two drafts).  In a step of ``B`` sequences, in units of
    a one-row step, ``k`` drafts of one sequence add ``a + ... + a^k`` tokens
    on average to the step's ``B`` and ``k x row_cost`` to its cost ``1 +
    (B - 1) x row_cost``; the sequence drafts the ``k`` that gives the most
    tokens per cost.  At batch 1 any acceptance that beats ``row_cost`` pays
    for a draft; at larger batches, whose steps already do more work per
    token, only a higher one does.  When no ``k`` beats not drafting the
    sequence pauses (1 step, then 2, 4, ... up to ``max_pause``) and then
    tries one draft again.

    Args:
        num_speculative_tokens: Most drafts per sequence per step.
        row_cost: What one more row adds to a decode step, relative to a
            one-row step (SmolLM2-135M on two CPU cores: about 0.3; a large
            model at small batch, whose step reads its weights whatever the
            rows: near 0).
        prior: Acceptance assumed before a sequence's first draft.
        max_batch_tokens: Most rows (pending tokens and drafts) a decode step
            may hold: past it drafts are shortened, so a large batch, whose
            step costs grow with its rows, speculates less or not at all.
        decay: Weight of the history in the counts, per step.
        max_pause: Longest pause, in steps.
        adaptive: ``False``: every sequence drafts ``num_speculative_tokens``
            whenever it can (no cost model, no cap on a step's rows).
    """

    num_speculative_tokens: int
    row_cost: float = 0.3
    prior: float = 0.5
    max_batch_tokens: int = 32
    decay: float = 0.8
    max_pause: int = 64
    adaptive: bool = True
    _records: dict[Hashable, _SequenceRecord] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        require_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        require_int("max_batch_tokens", self.max_batch_tokens, 1)
        require_int("max_pause", self.max_pause, 1)
        if not 0.0 <= self.row_cost <= 1.0:
            raise ValueError(f"row_cost must be in [0, 1], got {self.row_cost}")
        if not 0.0 < self.prior < 1.0:
            raise ValueError(f"prior must be in (0, 1), got {self.prior}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")

    def _record(self, seq_id: Hashable) -> _SequenceRecord:
        record = self._records.get(seq_id)
        if record is None:
            record = self._records[seq_id] = _SequenceRecord(2 * self.prior, 2.0)
        return record

    def best_length(self, acceptance: float, most: int, batch_size: int = 1) -> int:
        """The draft length up to ``most`` that gives a step of ``batch_size``
        sequences the most tokens per cost (the shortest of equals)."""
        base_tokens = float(batch_size)
        base_cost = 1 + (batch_size - 1) * self.row_cost
        best, best_value = 0, base_tokens / base_cost
        extra, term = 0.0, 1.0
        for k in range(1, most + 1):
            term *= acceptance
            extra += term
            value = (base_tokens + extra) / (base_cost + k * self.row_cost)
            if value > best_value * (1 + 1e-9):
                best, best_value = k, value
        return best

    def draft_length(self, seq_id: Hashable, batch_size: int) -> int:
        """Drafts sequence ``seq_id`` may propose in a step of ``batch_size`` sequences."""
        batch_size = require_int("batch_size", batch_size, 1)
        if not self.adaptive:
            return self.num_speculative_tokens
        record = self._record(seq_id)
        share = max(0, (self.max_batch_tokens - batch_size) // batch_size)
        most = min(self.num_speculative_tokens, share)
        if most == 0:
            return 0
        if record.paused > 0:
            record.paused -= 1
            return 1 if record.paused == 0 else 0  # the probe after a pause
        k = self.best_length(self.acceptance(seq_id), most, batch_size)
        if k == 0:
            record.backoff = min(self.max_pause, max(1, 2 * record.backoff))
            record.paused = record.backoff
        return k

    def record(self, seq_id: Hashable, proposed: int, accepted: int) -> None:
        """Sequence ``seq_id`` proposed ``proposed`` drafts and ``accepted`` stood."""
        proposed = require_int("proposed", proposed, 0)
        accepted = require_int("accepted", accepted, 0)
        if accepted > proposed:
            raise ValueError(f"accepted ({accepted}) exceeds proposed ({proposed})")
        if proposed == 0:
            return
        record = self._record(seq_id)
        record.accepted = self.decay * record.accepted + accepted
        record.checked = self.decay * record.checked + accepted + (accepted < proposed)
        if accepted:
            record.backoff = 0

    def acceptance(self, seq_id: Hashable) -> float:
        """The running acceptance of ``seq_id`` (``prior`` before any draft)."""
        record = self._records.get(seq_id)
        if record is None:
            return self.prior
        return record.accepted / record.checked if record.checked else self.prior

    def forget(self, seq_id: Hashable) -> None:
        """Drops a finished sequence's record (its id may be reused)."""
        self._records.pop(seq_id, None)
