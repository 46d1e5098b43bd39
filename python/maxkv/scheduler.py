"""Continuous batching with multistep decoding over a :class:`LlamaModel`.

One *round*:

1. Admit waiting requests into free batch slots (``claim``); their prompts
   are context-encoded in the same model step in which running requests
   decode their pending token (a mixed ragged step).
2. ``fetch`` covers ``K = min(num_steps, most tokens any request still needs)``
   model steps.  Between steps the next tokens stay on the device: they are
   the next step's input, and ``increment_cache_lengths`` advances the cache
   lengths on the device.  No host round trip inside a round.
3. Read the round's ``K`` tokens per request back once (one host sync),
   ``step`` the tokens written to the cache, finish requests at
   ``max_new_tokens`` or an EOS token, ``release`` them; repeat.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from max.driver import Buffer

from .manager import ContinuousBatchingKVCacheManager
from .models.llama import LlamaModel


def positions_needed(prompt_len: int, max_new_tokens: int, num_steps: int) -> int:
    """Cache positions a request needs: its prompt, all but its last generated
    token, and up to ``num_steps - 1`` steps a round may run past its end."""
    return prompt_len + max_new_tokens + num_steps - 2


@dataclass
class Request:
    """One generation request and its progress."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    seq_id: int | None = None
    #: The last generated token, not yet written to the cache.
    pending: int | None = None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output)


@dataclass
class SchedulerStats:
    """What a run did.  A host sync is one point where the host waits for
    device results (reading a round's tokens back)."""

    rounds: int = 0
    model_steps: int = 0
    generated_tokens: int = 0
    host_syncs: int = 0
    batch_slots_used: int = 0
    max_batch_size: int = 1
    elapsed_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def mean_occupancy(self) -> float:
        """Mean fraction of the batch's slots in use per model step."""
        steps = self.model_steps * self.max_batch_size
        return self.batch_slots_used / steps if steps else 0.0

    @property
    def host_syncs_per_token(self) -> float:
        return self.host_syncs / self.generated_tokens if self.generated_tokens else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "rounds": self.rounds,
            "model_steps": self.model_steps,
            "generated_tokens": self.generated_tokens,
            "host_syncs": self.host_syncs,
            "host_syncs_per_token": round(self.host_syncs_per_token, 4),
            "mean_batch_occupancy": round(self.mean_occupancy, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "elapsed_s": round(self.elapsed_s, 3),
        }


class ContinuousBatchingScheduler:
    """Runs requests through a model with at most ``max_batch_size`` in flight.

    Args:
        model: The compiled model.
        manager: The cache the model's graph was built for; needs at least
            ``max_batch_size`` free slots.
        max_batch_size: Requests decoded together.
        num_steps: Model steps per ``fetch`` (multistep decoding).
        stop_at_eos: Finish a request at the model's EOS token; ``False``
            always generates ``max_new_tokens`` (for benchmarks).
    """

    def __init__(
        self,
        model: LlamaModel,
        manager: ContinuousBatchingKVCacheManager,
        max_batch_size: int,
        num_steps: int = 1,
        *,
        stop_at_eos: bool = True,
    ) -> None:
        if max_batch_size < 1 or num_steps < 1:
            raise ValueError(
                f"max_batch_size and num_steps must be >= 1, got {max_batch_size}, {num_steps}"
            )
        if max_batch_size > manager.slots_remaining:
            raise ValueError(
                f"max_batch_size {max_batch_size} exceeds the manager's "
                f"{manager.slots_remaining} free slots"
            )
        self.model = model
        self.manager = manager
        self.max_batch_size = max_batch_size
        self.num_steps = num_steps
        self.eos = set(model.config.eos_token_ids) if stop_at_eos else set()
        if num_steps > 1:
            manager.warm_up()  # plan once: keep the compile out of the decode loop
        self._waiting: deque[Request] = deque()
        self._requests: list[Request] = []
        self._decode_offsets = [
            Buffer.from_numpy(np.arange(n + 1, dtype=np.uint32)).to(model.device)
            for n in range(max_batch_size + 1)
        ]

    def submit(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """Queues a request; returns its index (the order of :meth:`run`'s outputs).

        Raises:
            ValueError: On an empty prompt, a token outside the vocabulary, a
                non-positive ``max_new_tokens``, or a request that cannot fit
                in the cache (prompt + new tokens + ``num_steps``).
        """
        tokens = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not tokens:
            raise ValueError("prompt must not be empty")
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        needed = positions_needed(len(tokens), max_new_tokens, self.num_steps)
        limit = min(self.manager.max_seq_len, self.model.max_positions)
        if needed > limit:
            raise ValueError(
                f"prompt of {len(tokens)} + {max_new_tokens} new tokens (+{self.num_steps - 1} "
                f"multistep) needs {needed} cache positions; the limit is {limit}"
            )
        request = Request(len(self._requests), tokens, max_new_tokens)
        self._requests.append(request)
        self._waiting.append(request)
        return request.index

    def run(
        self,
        on_round: Callable[[SchedulerStats, int], None] | None = None,
        on_complete: Callable[[int, list[int]], None] | None = None,
    ) -> tuple[list[list[int]], SchedulerStats]:
        """Runs every submitted request to completion.

        Args:
            on_round: Called after each round with the stats so far and the
                number of tokens that round generated (for progress bars).
            on_complete: Called when a request finishes, with its index and
                its generated ids (ending with the EOS token if it stopped there).

        Returns:
            The generated ids of each request, in submission order, and the stats.
        """
        stats = SchedulerStats(max_batch_size=self.max_batch_size)
        running: list[Request] = []
        start = time.perf_counter()
        while self._waiting or running:
            new = self._admit(len(running))
            batch = running + new
            produced = self._round(batch, stats)
            running = []
            for request in batch:
                if request.remaining > 0 and request.output[-1] not in self.eos:
                    running.append(request)
                else:
                    self.manager.release(_seq_id(request))
                    request.seq_id = None
                    if on_complete is not None:
                        on_complete(request.index, list(request.output))
            stats.elapsed_s = time.perf_counter() - start
            if on_round is not None:
                on_round(stats, produced)
        return [list(r.output) for r in self._requests], stats

    def _admit(self, running: int) -> list[Request]:
        count = min(self.max_batch_size - running, len(self._waiting))
        if count == 0:
            return []
        new = [self._waiting.popleft() for _ in range(count)]
        for request, seq_id in zip(new, self.manager.claim(count), strict=True):
            request.seq_id = seq_id
        return new

    def _round(self, batch: list[Request], stats: SchedulerStats) -> int:
        first_tokens = [r.prompt if r.pending is None else [r.pending] for r in batch]
        active = [len(t) for t in first_tokens]
        steps = min(self.num_steps, max(r.remaining for r in batch))
        seq_ids = [_seq_id(r) for r in batch]
        kv = self.manager.fetch(seq_ids, steps, active_lengths=active)

        device = self.model.device
        tokens = Buffer.from_numpy(np.concatenate(first_tokens).astype(np.int64)).to(device)
        offsets = Buffer.from_numpy(np.concatenate([[0], np.cumsum(active)]).astype(np.uint32)).to(
            device
        )
        outputs: list[Buffer] = []
        for step in range(steps):
            next_tokens = self.model.execute(tokens, offsets, kv[0])
            outputs.append(next_tokens)
            stats.model_steps += 1
            stats.batch_slots_used += len(batch)
            if step + 1 < steps:
                kv = self.manager.increment_cache_lengths(kv, (tokens, offsets))
                tokens, offsets = next_tokens, self._decode_offsets[len(batch)]

        # The round's only host sync: read every step's tokens back at once.
        generated = np.stack([o.to_numpy() for o in outputs], axis=1)
        stats.host_syncs += 1
        stats.rounds += 1
        self.manager.step({s: n + steps - 1 for s, n in zip(seq_ids, active, strict=True)})
        produced = 0
        for request, row in zip(batch, generated, strict=True):
            for token in row.tolist():
                if request.remaining == 0 or (request.output and request.output[-1] in self.eos):
                    break
                request.output.append(int(token))
                produced += 1
            request.pending = int(row[-1])
        stats.generated_tokens += produced
        return produced


def _seq_id(request: Request) -> int:
    if request.seq_id is None:
        raise RuntimeError(f"request {request.index} holds no cache slot")
    return request.seq_id
