"""Continuous batching with multistep decoding over a :class:`DecoderModel`.

One *round*:

1. Admit waiting requests into free batch rows (``claim``, or
   ``claim_prefix`` with prefix caching: only the uncached rest of a prompt is
   computed); their prompts are context-encoded in the same model step in
   which running requests decode their pending token (a mixed ragged step).
   A round that admits requests runs one step, so they get their first token
   at once; other rounds run ``K = min(num_steps, most tokens any request
   still needs)`` steps per ``fetch``.
2. Between the steps of a round the next tokens stay on the device: they are
   the next step's input, and ``increment_cache_lengths`` advances the cache
   lengths on the device.  No host round trip inside a round.
3. Read the round's tokens back once (one host sync), ``step`` the tokens
   written to the cache (with their ids, which prefix caching records),
   finish requests at ``max_new_tokens`` or an EOS token, ``release`` them.

Over a paged cache (:class:`~maxkv.PagedKVCacheManager`, or the hybrid cache of a
model with windowed layers: every layer group) the scheduler runs
one of three policies for pages (``preemption=``):

- ``"wait"`` (the default): a request is admitted only when the pages it can
  need at most (every completion's prompt and generated tokens, ignoring
  pages that prefixes and forks share) fit beside those of the requests in
  flight; otherwise it waits for a release, so a fetch never runs out of pages.
- ``"swap"``: a request is admitted when its prompt's pages are free (and one
  page per running request); when a round's fetch runs out of pages, the most
  recently admitted requests are swapped out to host memory
  (:meth:`~maxkv.PagedKVCacheManager.swap_out`) until it fits, and swapped
  back in, before any new request is admitted, when pages free up.  Nothing
  is recomputed.
- ``"recompute"``: admission as for ``"swap"``; a preempted request releases
  its pages and is queued again with its prompt and generated tokens as the
  prompt (vLLM's and MAX's default): with prefix caching, the full pages the
  device or a KV tier still holds are reused, the rest recomputed.

With a model built with ``output="logits"`` the scheduler samples on the
host instead (per-request temperature and seeded generator; temperature 0 is
greedy), one step per round, and a request may ask for ``n`` completions:
after its prompt is encoded, ``n - 1`` children ``fork`` its cache at
``len(prompt) - 1`` and each samples its own continuation.

With ``speculative=`` (:class:`~maxkv.serving.speculative.SpeculativeConfig`,
a model built with ``head_rows="given"``, one step per round) each request
may append draft tokens found by prompt lookup in its own prompt and output
after its pending tokens; the model's head reads every drafted row in the
same step, the drafts that match what the model would have chosen are
committed with one more token of the model's, and the rows of the others
are left uncommitted (``step`` commits fewer tokens than were fetched, and
a paged cache gives back pages past the committed length).  Greedy outputs
are the tokens decoding one at a time gives; sampled ones keep its
distribution (speculative sampling).  Drafts never preempt: a round whose
drafts do not fit the free pages runs without them.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from max.driver import Buffer

from ..cache.paged import SwappedSequence
from ..cache.prefix import common_prefix_length
from ..cache.protocol import KVCacheManagerBase
from ..errors import CacheFullError
from ..models.decoder import DecoderModel
from .speculative import SpeculativeConfig, accept_greedy, accept_sampled


def positions_needed(prompt_len: int, max_new_tokens: int, num_steps: int) -> int:
    """Cache positions a request needs: its prompt, all but its last generated
    token, and up to ``num_steps - 1`` steps a round may run past its end."""
    return prompt_len + max_new_tokens + num_steps - 2


@dataclass
class Request:
    """One generation request (or one completion of it) and its progress."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    n: int = 1
    seed: int = 0
    output: list[int] = field(default_factory=list)
    seq_id: int | None = None
    #: Tokens to feed in the next step (the prompt's uncached rest, or the
    #: last generated token), not yet in the cache.
    pending: list[int] = field(default_factory=list)
    #: Prompt tokens found in the prefix cache.
    cached_tokens: int = 0
    #: Wall time of the round that encoded this request's prompt.
    prefill_s: float | None = None
    #: For a forked completion: the request it belongs to and its number.
    parent: Request | None = None
    completion: int = 0
    completions: list[Request] = field(default_factory=list)
    rng: np.random.Generator | None = None
    #: Storage units (pages) set aside for this completion at admission.
    reserved_units: int = 0
    #: Its cache while swapped out (``preemption="swap"``).
    swapped: SwappedSequence | None = None
    #: Whether its prefix's blocks were asked to come to host memory (KV tiers).
    prefetched: bool = False
    #: Whether it was admitted before (``preemption="recompute"`` counts it once).
    admitted: bool = False

    @property
    def context(self) -> list[int]:
        """The prompt and the tokens generated so far."""
        return self.prompt + self.output

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
    prompt_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    forks: int = 0
    #: Times admission waited for units (pages or slots) held by running requests.
    page_waits: int = 0
    #: Requests preempted (swapped out, or released to be recomputed).
    preemptions: int = 0
    #: Tokens computed again after a preemption by recompute.
    recomputed_tokens: int = 0
    #: Most units (pages, or slots of a contiguous cache) held at once, after a
    #: round's fetch (:attr:`KVCacheManagerBase.total_units`).
    peak_units_in_use: int = 0
    #: Draft tokens proposed, and those accepted (speculative decoding).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    #: Rounds whose drafts did not fit the free pages and ran without them.
    drafts_dropped: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones (0 without drafts)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def mean_occupancy(self) -> float:
        """Mean fraction of the batch's rows in use per model step."""
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
            "prompt_tokens": self.prompt_tokens,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "forks": self.forks,
            "page_waits": self.page_waits,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "peak_units_in_use": self.peak_units_in_use,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "drafts_dropped": self.drafts_dropped,
        }


class ContinuousBatchingScheduler:
    """Runs requests through a model with at most ``max_batch_size`` in flight.

    Args:
        model: The compiled model: ``output="tokens"`` decodes greedily on
            the device (multistep); ``output="logits"`` samples on the host.
        manager: The cache the model's graph was built for; needs at least
            ``max_batch_size`` free sequences.  With prefix caching enabled
            on it, prompts reuse cached prefixes.
        max_batch_size: Sequences decoded together (completions included).
        num_steps: Model steps per ``fetch`` (multistep decoding, greedy only).
        stop_at_eos: Finish a request at the model's EOS token; ``False``
            always generates ``max_new_tokens`` (for benchmarks).
        preemption: ``"wait"``, ``"swap"`` or ``"recompute"`` (see the module
            docstring); the last two need the paged or the hybrid cache (its
            ``swap`` / ``pages`` capability) and greedy decoding
            (a forked request's completions are never preempted apart).
        speculative: Prompt-lookup speculative decoding (see the module
            docstring); needs a model built with ``head_rows="given"``, which
            runs one step per round (``num_steps == 1``).
    """

    def __init__(
        self,
        model: DecoderModel,
        manager: KVCacheManagerBase,
        max_batch_size: int,
        num_steps: int = 1,
        *,
        stop_at_eos: bool = True,
        preemption: str = "wait",
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        if preemption not in ("wait", "swap", "recompute"):
            raise ValueError(
                f"preemption must be 'wait', 'swap' or 'recompute', got {preemption!r}"
            )
        needs = {"wait": None, "swap": "swap", "recompute": "pages"}[preemption]
        if needs is not None and not getattr(manager.capabilities, needs):
            raise ValueError(
                f"preemption={preemption!r} needs a cache with the {needs!r} capability "
                f"(the paged or the hybrid cache), not {type(manager).__name__}"
            )
        if max_batch_size < 1 or num_steps < 1:
            raise ValueError(
                f"max_batch_size and num_steps must be >= 1, got {max_batch_size}, {num_steps}"
            )
        free = manager.max_batch_size - len(manager.cache_lengths)
        if max_batch_size > free:
            raise ValueError(
                f"max_batch_size {max_batch_size} exceeds the manager's {free} free slots"
            )
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(
                f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}"
            )
        head_rows = getattr(model, "head_rows", "last")
        if speculative is not None and head_rows != "given":
            raise ValueError(
                "speculative decoding reads every drafted row: build the model with "
                "head_rows='given'"
            )
        if head_rows == "given" and num_steps != 1:
            raise ValueError(
                "a head_rows='given' model (speculative decoding) runs one model step per "
                "round (num_steps=1)"
            )
        self.model = model
        self.manager = manager
        self.speculative = speculative
        #: Whether the model's head reads given rows (every round then runs
        #: :meth:`_checked_round`).
        self.head_rows = head_rows
        self._lookup = speculative.lookup() if speculative else None
        self._policy = speculative.policy() if speculative else None
        self.max_batch_size = max_batch_size
        self.sampling = getattr(model, "output", "tokens") == "logits"
        self.num_steps = 1 if self.sampling else num_steps
        self.eos = set(model.config.eos_token_ids) if stop_at_eos else set()
        self.prefix_caching = manager.prefix_caching
        self.preemption = preemption
        if preemption != "wait" and self.sampling:
            raise ValueError(
                "preemption by swap or recompute is for greedy (output='tokens') models"
            )
        self._swapped: deque[Request] = deque()
        if self.num_steps > 1 or self.prefix_caching:
            manager.warm_up()  # plan once: keep compiles out of the decode loop
        self._waiting: deque[Request] = deque()
        self._requests: list[Request] = []
        self._reserved_units = 0
        self._decode_offsets = [
            Buffer.from_numpy(np.arange(n + 1, dtype=np.uint32)).to(model.device)
            for n in range(max_batch_size + 1)
        ]

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        n: int = 1,
        seed: int = 0,
    ) -> int:
        """Queues a request; returns its index (the order of :meth:`run`'s outputs).

        Args:
            prompt: Token ids.
            max_new_tokens: Tokens to generate (fewer when EOS comes first).
            temperature: Sampling temperature (0: greedy); needs a model with
                ``output="logits"`` when positive.
            n: Completions of this prompt (forked after its prompt is
                encoded); needs a ``"logits"`` model when above 1.
            seed: Seed of the request's generator (completion *i* uses
                ``seed + i``).

        Raises:
            ValueError: On an empty prompt, a token outside the vocabulary, a
                non-positive ``max_new_tokens`` or ``n``, sampling on a
                greedy model, ``n > 1`` on a cache that cannot copy rows
                (``copies_supported``), or a request that
                cannot fit in the cache.
        """
        tokens = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not tokens:
            raise ValueError("prompt must not be empty")
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if (temperature > 0 or n > 1) and not self.sampling:
            raise ValueError("sampling and n > 1 need a model built with output='logits'")
        if n > 1 and not self.manager.copies_supported:
            raise ValueError("n > 1 forks the prompt's cache, which this cache cannot copy")
        if n > self.max_batch_size:
            raise ValueError(f"n={n} completions do not fit a batch of {self.max_batch_size}")
        needed = positions_needed(len(tokens), max_new_tokens, self.num_steps)
        limit = min(self.manager.max_seq_len, self.model.max_positions)
        if needed > limit:
            raise ValueError(
                f"prompt of {len(tokens)} + {max_new_tokens} new tokens (+{self.num_steps - 1} "
                f"multistep) needs {needed} cache positions; the limit is {limit}"
            )
        units = n * self.manager.units_for(needed)
        if units > self.manager.total_units:
            kind = "pages" if self.manager.capabilities.pages else "slots"
            raise ValueError(
                f"{n} completion(s) of {needed} cache positions need up to {units} {kind}; "
                f"the cache has {self.manager.total_units}"
            )
        request = Request(
            len(self._requests), tokens, max_new_tokens, temperature, n, seed, pending=tokens
        )
        request.rng = np.random.default_rng(seed)
        request.completions = [request]
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
            on_complete: Called when a request finishes (all its completions),
                with its index and its first completion's ids (ending with
                the EOS token if it stopped there).

        Returns:
            The generated ids of each request (its first completion), in
            submission order, and the stats; :meth:`completions` has all.
        """
        stats = SchedulerStats(max_batch_size=self.max_batch_size)
        running: list[Request] = []
        start = time.perf_counter()
        while self._waiting or running or self._swapped:
            new = self._admit(running, stats)
            self._prefetch_waiting()
            if not running and not new:
                raise RuntimeError("no request could be admitted: the cache has no room")
            batch = running + new
            round_start = time.perf_counter()
            batch = self._fit(batch, new, stats)
            new = [r for r in new if r in batch]
            produced = self._round(batch, stats, prefill=bool(new))
            round_s = time.perf_counter() - round_start
            # Other completions fork their prompt's cache while it is still held.
            running = self._fork_completions(new, stats)
            for request in batch:
                if request.prefill_s is None:
                    request.prefill_s = round_s
                if request.remaining > 0 and (not self.eos or request.output[-1] not in self.eos):
                    running.append(request)
                else:
                    if self._policy is not None:
                        self._policy.forget(_seq_id(request))
                    self.manager.release(_seq_id(request))
                    request.seq_id = None
                    self._reserved_units -= request.reserved_units
                    request.reserved_units = 0
                    self._finish(request, on_complete)
            stats.elapsed_s = time.perf_counter() - start
            if on_round is not None:
                on_round(stats, produced)
        return [list(r.output) for r in self._requests], stats

    def completions(self) -> list[list[list[int]]]:
        """Every completion of every request, in submission order."""
        return [[list(c.output) for c in r.completions] for r in self._requests]

    def requests(self) -> list[Request]:
        """The submitted requests (with their timing and prefix-cache figures)."""
        return list(self._requests)

    # ------------------------------------------------------------ admission

    def _admit(self, running_requests: list[Request], stats: SchedulerStats) -> list[Request]:
        running = len(running_requests)
        if self.preemption != "wait":
            return self._admit_optimistic(running_requests, stats)
        room = self.max_batch_size - running
        new: list[Request] = []
        while len(new) < room and self._waiting:
            request = self._waiting[0]
            if self.prefix_caching and new and self._shares_uncached_prefix(request, new):
                break  # wait one round: the shared prefix is computed once, then reused
            # Room for the request and the completions it will fork.
            if len(new) + request.n > room:
                break
            units = self.manager.units_for(
                positions_needed(len(request.prompt), request.max_new_tokens, self.num_steps)
            )
            if self._reserved_units + request.n * units > self.manager.total_units:
                stats.page_waits += 1
                break  # wait for a release: the units it may need are not all free
            self._reserved_units += request.n * units
            request.reserved_units = units
            self._waiting.popleft()
            if self.prefix_caching:
                seq_id, cached = self.manager.claim_prefix(request.prompt)
                request.seq_id, request.cached_tokens = seq_id, cached
                request.pending = request.prompt[cached:]
                stats.prefix_cache_hit_tokens += cached
            else:
                (request.seq_id,) = self.manager.claim(1)
            stats.prompt_tokens += len(request.prompt)
            new.append(request)
        return new

    def _admit_optimistic(self, running: list[Request], stats: SchedulerStats) -> list[Request]:
        """Admission under ``preemption="swap"`` / ``"recompute"``: swapped-out requests
        first (oldest first), then waiting ones, each when its prompt's pages are free
        beside one page per request already in the batch."""
        manager = self.manager
        room = self.max_batch_size - len(running)
        new: list[Request] = []
        while len(new) < room and self._swapped:
            request = self._swapped[0]
            assert request.swapped is not None
            pages = manager.swap_in_pages(request.swapped)
            if manager.free_pages < pages + len(running) + len(new):
                return new  # nothing new overtakes a swapped-out request
            try:
                request.seq_id = manager.swap_in(request.swapped)
            except CacheFullError:
                return new
            request.swapped = None
            self._swapped.popleft()
            new.append(request)
        while len(new) < room and self._waiting:
            request = self._waiting[0]
            if self.prefix_caching and new and self._shares_uncached_prefix(request, new):
                break
            tokens = request.context
            pages = manager.pages_to_claim(tokens)
            if manager.free_pages < pages + len(running) + len(new):
                stats.page_waits += 1
                break
            self._waiting.popleft()
            if self.prefix_caching:
                seq_id, cached = self.manager.claim_prefix(tokens)
            else:
                (seq_id,) = self.manager.claim(1)
                cached = 0
            request.seq_id = seq_id
            request.pending = tokens[cached:]
            if request.admitted:  # again, after a preemption by recompute
                stats.recomputed_tokens += len(request.pending)
            else:
                request.admitted = True
                request.cached_tokens = cached
                stats.prefix_cache_hit_tokens += cached
                stats.prompt_tokens += len(request.prompt)
            new.append(request)
        return new

    def _prefetch_waiting(self) -> None:
        """KV tiers: the disk / Redis blocks of the next requests in the queue start
        coming to host memory while this round runs (not those admitted now, whose
        claim just read them: a prefetch would only compete with it)."""
        if not self.manager.prefix_caching:
            return
        for request in itertools.islice(self._waiting, self.max_batch_size):
            if not request.prefetched:
                request.prefetched = True
                self.manager.prefetch(request.context)

    def _fit(
        self, batch: list[Request], new: list[Request], stats: SchedulerStats
    ) -> list[Request]:
        """Preempts the most recently admitted requests until this round's pages fit
        (``"swap"`` / ``"recompute"``; ``"wait"`` never runs out)."""
        if self.preemption == "wait":
            return batch
        manager = self.manager
        batch = list(batch)
        while len(batch) > 1:
            # The manager's own reservation decides (copy-on-write included); a
            # refusal changes nothing, and the round's fetch finds the pages there.
            steps = 1 if any(r in new for r in batch) else self._steps(batch)
            lengths = manager.cache_lengths
            try:
                manager.reserve(
                    {_seq_id(r): lengths[_seq_id(r)] + len(r.pending) + steps - 1 for r in batch}
                )
                break
            except CacheFullError:
                pass
            victim = batch.pop()
            stats.preemptions += 1
            seq_id = _seq_id(victim)
            victim.seq_id = None
            if self.preemption == "swap":
                try:
                    victim.swapped = manager.swap_out(seq_id)
                    self._swapped.append(victim)
                    continue
                except CacheFullError:
                    pass  # the swap space is full: this one is recomputed instead
            manager.release(seq_id)
            victim.pending = []
            self._waiting.appendleft(victim)
        return batch

    def _steps(self, batch: list[Request]) -> int:
        return min(self.num_steps, max(r.remaining for r in batch))

    def _shares_uncached_prefix(self, request: Request, admitted: list[Request]) -> bool:
        cached = self.manager.cached_prefix_length(request.prompt)
        block = self.manager.prefix_block_size
        for other in admitted:
            shared = common_prefix_length(request.prompt, other.prompt)
            if shared - cached >= block:
                return True
        return False

    def _fork_completions(self, new: list[Request], stats: SchedulerStats) -> list[Request]:
        """Forks the other completions of requests whose prompt was just encoded.

        Each child holds the prompt but its last token, which it feeds in its
        first step, so it samples its own first token from the same logits.
        """
        children = []
        for request in new:
            if request.parent is not None or request.n == 1:
                continue
            for i in range(1, request.n):
                child = Request(
                    request.index,
                    request.prompt,
                    request.max_new_tokens,
                    request.temperature,
                    1,
                    request.seed + i,
                    pending=[request.prompt[-1]],
                    parent=request,
                    completion=i,
                )
                child.rng = np.random.default_rng(request.seed + i)
                child.reserved_units = request.reserved_units
                child.seq_id = self.manager.fork(_seq_id(request), len(request.prompt) - 1)
                child.cached_tokens = len(request.prompt) - 1
                request.completions.append(child)
                stats.forks += 1
                children.append(child)
        return children

    def _finish(
        self, request: Request, on_complete: Callable[[int, list[int]], None] | None
    ) -> None:
        owner = request.parent or request
        done = all(c.seq_id is None and c.output for c in owner.completions)
        done = done and len(owner.completions) == owner.n
        if done and on_complete is not None:
            on_complete(owner.index, list(owner.output))

    # ---------------------------------------------------------------- steps

    def _round(self, batch: list[Request], stats: SchedulerStats, prefill: bool) -> int:
        if self.head_rows == "given":
            return self._checked_round(batch, stats)
        first_tokens = [r.pending for r in batch]
        active = [len(t) for t in first_tokens]
        steps = 1 if prefill else self._steps(batch)
        seq_ids = [_seq_id(r) for r in batch]
        kv = self.manager.fetch(seq_ids, steps, active_lengths=active)
        self._count_units(stats)

        device = self.model.device
        tokens = Buffer.from_numpy(np.concatenate(first_tokens).astype(np.int64)).to(device)
        offsets = Buffer.from_numpy(np.concatenate([[0], np.cumsum(active)]).astype(np.uint32)).to(
            device
        )
        outputs: list[Buffer] = []
        for step in range(steps):
            result = self.model.execute(tokens, offsets, kv[0])
            outputs.append(result)
            stats.model_steps += 1
            stats.batch_slots_used += len(batch)
            if step + 1 < steps:
                kv = self.manager.increment_cache_lengths(kv, (tokens, offsets))
                tokens, offsets = result, self._decode_offsets[len(batch)]

        # The round's only host sync: read every step's results back at once.
        if self.sampling:
            generated = self._sample(batch, outputs[0].to_numpy())[:, None]
        else:
            generated = np.stack([o.to_numpy() for o in outputs], axis=1)
        stats.host_syncs += 1
        stats.rounds += 1
        committed = {
            s: list(first) + [int(t) for t in row[: steps - 1]]
            for s, first, row in zip(seq_ids, first_tokens, generated, strict=True)
        }
        self.manager.step(
            {s: len(ids) for s, ids in committed.items()},
            tokens=committed if self.prefix_caching else None,
        )
        return self._append_outputs(batch, [row.tolist() for row in generated], stats)

    def _checked_round(self, batch: list[Request], stats: SchedulerStats) -> int:
        """One step whose head reads given rows: each request's last pending
        token and, with speculation, the draft tokens appended after it."""
        drafts = [self._drafts(r, len(batch)) for r in batch]
        seq_ids = [_seq_id(r) for r in batch]
        try:
            kv = self.manager.fetch(
                seq_ids,
                active_lengths=[
                    len(r.pending) + len(d) for r, d in zip(batch, drafts, strict=True)
                ],
            )
        except CacheFullError:
            if not any(drafts):
                raise
            stats.drafts_dropped += 1  # drafts never preempt: this round runs without them
            drafts = [[] for _ in batch]
            kv = self.manager.fetch(seq_ids, active_lengths=[len(r.pending) for r in batch])
        self._count_units(stats)
        fed = [r.pending + d for r, d in zip(batch, drafts, strict=True)]
        active = [len(t) for t in fed]
        ends = np.cumsum(active)
        # The rows the head reads: a request's last pending token and its drafts.
        rows = np.concatenate(
            [np.arange(end - len(d) - 1, end) for end, d in zip(ends, drafts, strict=True)]
        ).astype(np.int64)
        device = self.model.device
        result = self.model.execute(
            Buffer.from_numpy(np.concatenate(fed).astype(np.int64)).to(device),
            Buffer.from_numpy(np.concatenate([[0], ends]).astype(np.uint32)).to(device),
            kv[0],
            Buffer.from_numpy(rows).to(device),
        ).to_numpy()
        stats.model_steps += 1
        stats.batch_slots_used += len(batch)
        stats.host_syncs += 1
        stats.rounds += 1
        generated: list[list[int]] = []
        committed: dict[int, list[int]] = {}
        row = 0
        for request, seq_id, draft, tokens in zip(batch, seq_ids, drafts, fed, strict=True):
            head = result[row : row + len(draft) + 1]
            row += len(draft) + 1
            if not self.sampling:
                out = accept_greedy(draft, head)
            elif request.temperature == 0:
                out = accept_greedy(draft, head.argmax(axis=-1))
            else:
                assert request.rng is not None
                out = accept_sampled(draft, _softmax(head, request.temperature), request.rng)
            accepted = len(out) - 1
            if draft:
                stats.draft_tokens += len(draft)
                stats.accepted_tokens += accepted
                assert self._policy is not None
                self._policy.record(seq_id, len(draft), accepted)
            committed[seq_id] = tokens[: len(request.pending) + accepted]
            generated.append(out)
        self.manager.step(
            {s: len(ids) for s, ids in committed.items()},
            tokens=committed if self.prefix_caching else None,
        )
        return self._append_outputs(batch, generated, stats)

    def _drafts(self, request: Request, batch_size: int) -> list[int]:
        """Prompt-lookup drafts for ``request`` this round (none without speculation).

        At most ``remaining - 1``: a step commits one token more than the drafts
        it accepts, so the cache never holds more than a request without
        speculation may need (:func:`positions_needed`).
        """
        if self._policy is None or self._lookup is None or request.remaining < 2:
            return []
        k = min(self._policy.draft_length(_seq_id(request), batch_size), request.remaining - 1)
        return self._lookup.propose(request.context, k) if k else []

    def _count_units(self, stats: SchedulerStats) -> None:
        held = self.manager.total_units - self.manager.free_units
        stats.peak_units_in_use = max(stats.peak_units_in_use, held)

    def _append_outputs(
        self, batch: list[Request], generated: list[list[int]], stats: SchedulerStats
    ) -> int:
        """Appends each request's new tokens, stopping at ``max_new_tokens`` or
        after an EOS token; its last new token is its next pending one."""
        produced = 0
        for request, tokens in zip(batch, generated, strict=True):
            for token in tokens:
                if request.remaining == 0 or (
                    request.output and self.eos and request.output[-1] in self.eos
                ):
                    break
                request.output.append(int(token))
                produced += 1
            request.pending = [int(tokens[-1])]
        stats.generated_tokens += produced
        return produced

    def _sample(self, batch: list[Request], logits: np.ndarray) -> np.ndarray:
        """One token per row: argmax at temperature 0, else a seeded softmax draw."""
        chosen = np.empty(len(batch), dtype=np.int64)
        for row, request in enumerate(batch):
            if request.temperature == 0:
                chosen[row] = int(np.argmax(logits[row]))
                continue
            probs = _softmax(logits[row], request.temperature)
            assert request.rng is not None
            chosen[row] = int(request.rng.choice(len(probs), p=probs))
        return chosen


def _seq_id(request: Request) -> int:
    if request.seq_id is None:
        raise RuntimeError(f"request {request.index} holds no cache slot")
    return request.seq_id


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Row-wise next-token probabilities at ``temperature`` (> 0), in float64."""
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    normalized: np.ndarray = probs / probs.sum(axis=-1, keepdims=True)
    return normalized
