"""What a request carries from ``max serve``'s API server to its model worker.

MAX pickles each request's context from the API server (where the prompt is
tokenized) to the model worker (where the KV adapter and the model read it).
:class:`MaxkvTextContext` is MAX's ``TextContext`` with maxkv's fields, one
per feature that must know something only the API server saw; and what a
context asks of the worker's step is answered here, once:
:func:`wants_prompt_logprobs`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from max.pipelines.context import TextContext

__all__ = ["MaxkvTextContext", "maxkv_context", "wants_prompt_logprobs"]


@dataclass(kw_only=True)
class MaxkvTextContext(TextContext):
    """MAX's ``TextContext`` with maxkv's fields."""

    blend_starts: list[int] | None = field(default=None)
    """CacheBlend: where each chunk starts in the prompt, then where the suffix
    starts (increasing, inside the prompt); ``None`` for a prompt without
    separators."""
    fork_of: str | None = field(default=None)
    """Several choices (``n``, ``best_of``): the request id of the choice whose
    prompt this one shares, whose sequence it forks once that prompt is in the
    cache; ``None`` for a request's first choice and single requests."""
    echo_prompt_length: int | None = field(default=None)
    """``echo`` with ``logprobs``: the prompt's length, whose tokens' log
    probabilities are computed (a request preempted after its first token
    starts again with its generated tokens in its "prompt": their log
    probabilities were answered already); ``None`` for other requests."""


def maxkv_context(context: TextContext, **fields: Any) -> MaxkvTextContext:
    """``context`` as a :class:`MaxkvTextContext` with ``fields`` set (the fields it
    had are kept)."""
    values = {f.name: getattr(context, f.name) for f in dataclasses.fields(context) if f.init}
    return MaxkvTextContext(**{**values, **fields})


def wants_prompt_logprobs(context: Any) -> bool:
    """Whether the step computes log probabilities of ``context``'s prompt tokens:
    a request with ``echo`` and ``logprobs`` (:attr:`MaxkvTextContext.
    echo_prompt_length`) whose prompt is not all processed.
    Its prompt is then computed whole (never taken from the prefix cache, a
    fork or CacheBlend), and the model's head reads every prompt row."""
    length = getattr(context, "echo_prompt_length", None)
    return (
        length is not None
        and context.tokens.prompt_length == length
        and context.tokens.processed_length < length
    )
