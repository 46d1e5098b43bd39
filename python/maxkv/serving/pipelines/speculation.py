"""Prompt-lookup speculative decoding inside MAX's pipelines (``max serve``, ``max generate``).

Turned on by :data:`SPECULATIVE_ENV` (``MAXKV_SPECULATIVE=ngram``); the drafts
and their checks are :mod:`maxkv.serving.speculative`'s, the step is
:meth:`MaxkvTextGenerationPipeline._execute
<maxkv.serving.pipelines.architecture.MaxkvTextGenerationPipeline>`'s:

1. :meth:`ServeSpeculation.propose`: per request of the batch, drafts found
   in its own tokens (prompt and output), as many as its acceptance pays for
   (:class:`~maxkv.serving.speculative.SpeculationPolicy`), within what it may
   still generate and what its cache may still hold.  Only requests whose
   next tokens the model's argmax decides draft (:func:`can_speculate`).
2. The adapter reserves the drafts' cache rows; where the pages are not free
   the step runs without drafts (drafts never preempt).
3. One model step over every request's pending token and drafts; the head
   reads every drafted row.  MAX's sampler and log-probability graph run on
   each request's first row as in a step without drafts.
4. :meth:`ServeSpeculation.accept`: the drafts that equal the model's argmax
   stand, and one token from the model follows them.  The pipeline appends
   them one by one, stopping where the request ends (EOS, ``max_tokens``,
   a stop string), and the cache commits only the rows of appended tokens.

So a greedy request's text is the text it gets without speculation, token for
token.  Requests that sample (temperature above 0 and ``top_k`` other than 1),
and those with penalties, ``min_tokens`` still pending, logits processors or
structured output, decode one token per step beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from max.pipelines.speculative.utils import _SpeculativeDecodingMetrics

from ... import settings
from ..speculative import PromptLookup, SpeculationPolicy, SpeculativeConfig, accept_greedy

#: ``ngram`` turns on prompt-lookup speculative decoding in MAX's pipelines.
SPECULATIVE_ENV = settings.SPECULATIVE.name
#: The methods :data:`SPECULATIVE_ENV` takes.
SPECULATIVE_METHODS = settings.SPECULATIVE_METHODS
#: Most draft tokens per request per step, unless MAX passes ``--num-speculative-tokens``.
NUM_SPECULATIVE_TOKENS_ENV = settings.NUM_SPECULATIVE_TOKENS.name
#: Shortest and longest n-gram matched (vLLM's ``prompt_lookup_min`` / ``_max``).
PROMPT_LOOKUP_MIN_ENV = settings.PROMPT_LOOKUP_MIN.name
PROMPT_LOOKUP_MAX_ENV = settings.PROMPT_LOOKUP_MAX.name
#: ``0``: every request drafts ``num_speculative_tokens`` whenever a match is found
#: (no cost model); default ``1``.
SPECULATIVE_ADAPTIVE_ENV = settings.SPECULATIVE_ADAPTIVE.name
#: The cost model's ``row_cost`` (:class:`~maxkv.serving.speculative.SpeculationPolicy`).
SPECULATIVE_ROW_COST_ENV = settings.SPECULATIVE_ROW_COST.name
#: What one more row adds to a ``max serve`` decode step, relative to a one-row
#: step: 0.08-0.10 measured for SmolLM2-135M float32 on two CPU cores (a step of
#: one row about 13.5 ms, each further row about 1.2 ms, drafted or not), where
#: reading the float32 weights dominates a small step.
SERVE_ROW_COST = settings.SPECULATIVE_ROW_COST.default
#: Most rows (pending tokens and drafts) of a ``max serve`` decode step.
SPECULATIVE_MAX_BATCH_TOKENS_ENV = settings.SPECULATIVE_MAX_BATCH_TOKENS.name
SERVE_MAX_BATCH_TOKENS = settings.SPECULATIVE_MAX_BATCH_TOKENS.default


def speculative_config(pipeline_config: Any = None) -> SpeculativeConfig | None:
    """The speculation :data:`SPECULATIVE_ENV` asks for; ``None`` when it is unset.

    ``num_speculative_tokens`` is MAX's ``--num-speculative-tokens`` where MAX
    passes it to the pipeline (``pipeline_config.speculative``), else
    :data:`NUM_SPECULATIVE_TOKENS_ENV`, else 4.  (MAX 26.7 passes it only with
    ``--speculative-method``, whose methods run MAX's own speculative
    pipeline: in practice the variable sets it.)

    Raises:
        ValueError: For a method other than :data:`SPECULATIVE_METHODS`, or
            settings that are not positive integers (the message names the
            variable).
    """
    if settings.SPECULATIVE.read() is None:
        return None
    defaults = SpeculativeConfig()
    max_speculative = getattr(pipeline_config, "speculative", None)
    from_max = getattr(max_speculative, "num_speculative_tokens", None)
    k = settings.NUM_SPECULATIVE_TOKENS.read()
    k = from_max or (defaults.num_speculative_tokens if k is None else k)
    lookup_min = settings.PROMPT_LOOKUP_MIN.read()
    lookup_max = settings.PROMPT_LOOKUP_MAX.read()
    adaptive = settings.SPECULATIVE_ADAPTIVE.read()
    cost = settings.SPECULATIVE_ROW_COST.read()
    try:
        return SpeculativeConfig(
            num_speculative_tokens=k,
            prompt_lookup_min=defaults.prompt_lookup_min if lookup_min is None else lookup_min,
            prompt_lookup_max=defaults.prompt_lookup_max if lookup_max is None else lookup_max,
            adaptive=adaptive,
            row_cost=cost,
            max_batch_tokens=settings.SPECULATIVE_MAX_BATCH_TOKENS.read(),
        )
    except ValueError as error:
        raise ValueError(f"{SPECULATIVE_ENV}: {error}") from None


def can_speculate(ctx: Any) -> bool:
    """Whether ``ctx``'s next tokens are its logits' argmax at every row: greedy
    (``top_k`` 1, as temperature 0 sets), no penalty (they depend on the tokens
    before each row), ``min_tokens`` met, no logits processors, no structured
    output; and a decode step (one pending token)."""
    params = ctx.sampling_params
    return (
        params.top_k == 1
        and params.frequency_penalty == 0
        and params.presence_penalty == 0
        and params.repetition_penalty == 1
        and ctx.tokens.generated_length >= (params.min_new_tokens or 0)
        and not params.logits_processors
        and getattr(ctx, "matcher", None) is None
        and getattr(ctx, "json_schema", None) is None
        and getattr(ctx, "grammar", None) is None
        and ctx.tokens.active_length == 1
        and ctx.tokens.generated_length > 0
    )


class SpeculationMetrics(_SpeculativeDecodingMetrics):
    """MAX's per-batch speculation metrics (its scheduler logs them), counting
    the drafts each request really proposed (MAX's own assume ``k`` each)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        super().__init__(num_speculative_tokens=num_speculative_tokens)
        self.drafted = 0
        self.emitted = 0

    @property
    def draft_tokens_generated(self) -> int:
        return self.drafted

    @property
    def output_tokens(self) -> int:
        return self.emitted


@dataclass
class ServeSpeculation:
    """Drafts and checks for the requests of MAX's batches (one pipeline's state).

    Args:
        config: The speculation settings.
        vocab_size: Ids at or past it are never chosen (MAX's sampler's bound:
            the tokenizer's vocabulary); ``None``: every logit.
    """

    config: SpeculativeConfig
    vocab_size: int | None = None
    lookup: PromptLookup = field(init=False)
    policy: SpeculationPolicy = field(init=False)
    metrics: SpeculationMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.lookup = self.config.lookup()
        self.policy = self.config.policy()
        self.metrics = SpeculationMetrics(self.config.num_speculative_tokens)

    def propose(self, batch: Sequence[Any], room: Callable[[Any], int]) -> list[list[int]]:
        """Step 1: each request's drafts this step (``[]`` for most).

        Args:
            batch: MAX's contexts of the step.
            room: Cache positions a request may take past its pending tokens.
        """
        drafts: list[list[int]] = []
        for ctx in batch:
            if not can_speculate(ctx):
                drafts.append([])
                continue
            # A step emits one token more than its accepted drafts.
            left = ctx.max_length - ctx.tokens.current_position - 1
            most = min(left, room(ctx))
            k = min(self.policy.draft_length(ctx.request_id, len(batch)), most) if most > 0 else 0
            drafts.append(self.lookup.propose(ctx.tokens.all, k) if k > 0 else [])
        return drafts

    def accept(
        self, ctx: Any, drafts: Sequence[int], first: int, rows: npt.NDArray[np.floating]
    ) -> list[int]:
        """Step 4: the tokens after ``first`` (MAX's sampled token at the request's
        first row) that the model's rows confirm: accepted drafts, then the
        model's token after them.  ``rows``: float32 ``[len(drafts) + 1, vocab]``,
        the logits of the pending token's row and of each draft's."""
        if not drafts:
            return []
        limit = rows.shape[1] if self.vocab_size is None else self.vocab_size
        argmax = rows[:, :limit].argmax(axis=-1)
        argmax[0] = first
        out = accept_greedy(drafts, argmax)
        accepted = len(out) - 1
        self.policy.record(ctx.request_id, len(drafts), accepted)
        self.metrics.num_verifications += 1
        self.metrics.drafted += len(drafts)
        assert self.metrics.accepted_per_position is not None
        for position in range(min(accepted, len(self.metrics.accepted_per_position))):
            self.metrics.accepted_per_position[position] += 1
        return [int(t) for t in out[1:]]

    def take_metrics(self, emitted: int) -> SpeculationMetrics:
        """The batch's metrics (``emitted``: tokens it gave every request), then fresh ones."""
        metrics, self.metrics = self.metrics, SpeculationMetrics(self.config.num_speculative_tokens)
        metrics.emitted = emitted
        return metrics

    def forget(self, request_id: Hashable) -> None:
        """A request ended: drops its acceptance record."""
        self.policy.forget(request_id)


def completes_stop_string(
    decode: Callable[[list[int]], str], generated: npt.NDArray[np.integer], stops: Sequence[str]
) -> bool:
    """Whether the last of ``generated`` completes one of ``stops`` in the decoded
    text (the text of the tokens before it does not hold it yet).  Reads a tail
    of the tokens long enough for the longest stop string."""
    if not stops or len(generated) == 0:
        return False
    tail = [int(t) for t in generated[-(4 * max(len(s) for s in stops) + 8) :]]
    after = decode(tail)
    if not any(s in after for s in stops):
        return False
    before = decode(tail[:-1])
    return not any(s in before for s in stops)
