"""The render routes: the token ids ``max serve`` would run for a request.

KV-aware routers (vllm-router's ``kv_aware`` and ``cache_aware`` policies)
hash a request's tokens in blocks and match them against the blocks each
replica announced (:mod:`maxkv.events`); they ask each replica for those
tokens first:

- ``POST /v1/completions/render``: a completions body; the answer is
  ``[{"token_ids": [...]}, ...]``, one entry per prompt;
- ``POST /v1/chat/completions/render``: a chat body; the answer is
  ``{"token_ids": [...]}``.

Each runs MAX's own route for the body (its parser, maxkv's request guard,
the tokenizer, the chat template and its options) up to the point where the
prompt is tokenized, and answers those tokens instead of generating: the
tokens are exactly those the same body would run, and a body the server
would refuse is refused the same way (HTTP 400 and its message).  Nothing
reaches the model worker.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message

from ... import seams

__all__ = ["Rendered", "add_render_routes", "prompts_of", "render_var", "with_body"]

#: Set while a render route runs MAX's route: the tokenizer answers with the
#: prompt's tokens (:class:`Rendered`) instead of a context.
render_var: ContextVar[bool] = ContextVar("maxkv_render", default=False)

Route = Callable[[Request], Awaitable[Any]]


class Rendered(BaseException):
    """The prompt's token ids, raised by the tokenizer in a render.

    A ``BaseException`` so that no ``except Exception`` of the route on its way
    up turns it into an error response.
    """

    def __init__(self, token_ids: list[int]) -> None:
        super().__init__()
        self.token_ids = token_ids


def with_body(request: Request, body: bytes) -> Request:
    """``request`` with ``body`` (the original one was read); later reads wait for
    the client's disconnect, as on the original request."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)


def _not_rendering(request: Request) -> Response | None:
    """A 501 when the served pipeline's tokenizer is not maxkv's (it would generate)."""
    pipeline = getattr(request.app.state, "pipeline", None)
    if getattr(getattr(pipeline, "tokenizer", None), "renders_tokens", False):
        return None
    return JSONResponse(
        {"error": {"message": "this server's tokenizer does not render", "code": 501}},
        status_code=501,
    )


async def _tokens(route: Route, request: Request, body: bytes) -> list[int] | Any:
    """The token ids MAX's ``route`` runs for ``body``, or the route's own answer
    (an error) when it ends before the tokenizer."""
    reset = render_var.set(True)
    try:
        return await route(with_body(request, body))
    except Rendered as rendered:
        return rendered.token_ids
    finally:
        render_var.reset(reset)


def prompts_of(body: Any) -> list[Any]:
    """A completions body's prompts one by one (a list of token ids is one prompt)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        return list(prompt)
    return [prompt]


async def render_completion(request: Request) -> Any:
    """``POST /v1/completions/render``: ``[{"token_ids": [...]}]`` per prompt."""
    route = seams.COMPLETION_ROUTE.resolve()
    refused = _not_rendering(request)
    if refused is not None:
        return refused
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # MAX's route answers it (a 400)
        body = None
    prompts = prompts_of(body)
    if len(prompts) == 1 or not isinstance(body, dict) or body.get("stream"):
        bodies = [raw]  # (a stream of several prompts: the route's own 400)
    else:
        bodies = [json.dumps({**body, "prompt": p}).encode() for p in prompts]
    answers = []
    for one in bodies:
        tokens = await _tokens(route, request, one)
        if not isinstance(tokens, list):
            return tokens
        answers.append({"token_ids": tokens})
    return JSONResponse(answers)


async def render_chat(request: Request) -> Any:
    """``POST /v1/chat/completions/render``: ``{"token_ids": [...]}``."""
    route = seams.CHAT_ROUTE.resolve()
    refused = _not_rendering(request)
    if refused is not None:
        return refused
    tokens = await _tokens(route, request, await request.body())
    if not isinstance(tokens, list):
        return tokens
    return JSONResponse({"token_ids": tokens})


def add_render_routes() -> None:
    """Adds the render routes to MAX's OpenAI routes (once per process; before the
    server's app takes them in)."""
    router = seams.OPENAI_ROUTER.resolve()
    paths = {getattr(r, "path", None) for r in router.routes}
    for path, endpoint in (
        ("/v1/completions/render", render_completion),
        ("/v1/chat/completions/render", render_chat),
    ):
        if path not in paths:
            router.add_api_route(
                path.removeprefix(router.prefix),
                endpoint,
                methods=["POST"],
                response_model=None,
                response_class=Response,
            )
