"""What ``max serve``'s OpenAI routes accept when maxkv serves the model.

MAX 26.7's routes accept ``n`` (several completions of one prompt) and
return one choice whatever ``n`` says.  Its pipeline produces one sequence per
request, so a server on maxkv refuses ``n > 1`` (and ``best_of > 1``) with
HTTP 400 and a message that says so, instead of silently answering once.

:func:`refuse_unsupported_requests` installs the check by wrapping the
routes' body parser (``max.serve.router.openai_routes._parse_openai_request_body``,
pinned to MAX 26.7 with the rest of :mod:`maxkv.pipelines`); the routes turn
its :class:`~max.pipelines.context.exceptions.InputError` into a 400.
"""

from __future__ import annotations

import functools
from typing import Any

#: Request fields whose value must be at most 1.
SINGLE_CHOICE_FIELDS = ("n", "best_of")


def check_single_choice(request: Any) -> None:
    """Raises ``InputError`` if a parsed OpenAI request asks for more than one choice."""
    from max.pipelines.context.exceptions import InputError

    for name in SINGLE_CHOICE_FIELDS:
        value = getattr(request, name, None)
        if value is not None and value > 1:
            raise InputError(
                f"`{name}`={value}: maxkv serves one completion per request; send the "
                f"request {value} times (with different seeds to sample different ones)"
            )


def refuse_unsupported_requests() -> None:
    """Makes the OpenAI routes refuse requests maxkv cannot serve (once per process)."""
    from max.serve.router import openai_routes

    parse = openai_routes._parse_openai_request_body
    if getattr(parse, "_maxkv_checked", False):
        return

    @functools.wraps(parse)
    async def parse_and_check(*args: Any, **kwargs: Any) -> Any:
        request = await parse(*args, **kwargs)
        check_single_choice(request)
        return request

    parse_and_check._maxkv_checked = True  # type: ignore[attr-defined]
    openai_routes._parse_openai_request_body = parse_and_check
