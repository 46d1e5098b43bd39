"""Several choices per request (``n``, ``best_of``) and the prompt echoed with its
log probabilities (``echo``), on ``max serve``'s OpenAI routes.

MAX 26.7's routes run one sequence per prompt and answer its text alone.
maxkv wraps ``POST /v1/completions`` and ``POST /v1/chat/completions``; a
request that asks for none of this goes to MAX's route untouched.  Otherwise:

1. **Choices** (API server): the request runs as ``best_of`` (default ``n``)
   copies of itself through MAX's own route (its parser, maxkv's guard, the
   tokenizer, the chat template), each with ``n`` and ``best_of`` taken out
   and, when ``seed`` is given, ``seed + j`` for choice ``j`` (so seeded
   choices differ, and the same request draws the same choices again).
   Choice ``j > 0`` carries the request id of choice 0 (``fork_of``,
   :class:`~maxkv.serving.pipelines.context.MaxkvTextContext`).
2. **Fork** (model worker, the KV adapter's ``alloc``): choice 0 computes the
   prompt; every other choice waits until it has, then forks its sequence
   (every page shared, the last partial page copied) and recomputes the
   prompt's last token only, whose logits draw its own first token.  A choice
   is one row of the batch, not one prompt.  Where choice 0 is gone (it
   ended, or was preempted) a choice computes the prompt as any request does,
   from the prefix cache where it holds it.
3. **Answer** (API server, :func:`merge_completions`, :func:`merge_chats`):
   the choices in OpenAI's order (``index`` = prompt x ``n`` + choice); with
   ``best_of > n``, the ``n`` of highest cumulative log probability of their
   tokens (computed for every choice, returned only where asked); usage: the
   prompt's tokens and cached tokens once per prompt (choice 0's), the
   completion tokens of every choice generated (as OpenAI bills ``best_of``).
   A stream (``n`` choices, no ``best_of`` beyond it) interleaves the
   choices' chunks as they come, each with its index, then one usage chunk
   (``stream_options.include_usage``) and one ``[DONE]``.

Where one choice fails, the request is answered with its error and the others
are cancelled (:mod:`~maxkv.serving.pipelines.cancels`).

``echo`` (completions): the answer's text starts with the prompt (the string
given, or the prompt's tokens decoded); with ``logprobs``, its
``token_logprobs``, ``top_logprobs``, ``tokens`` and ``text_offset`` cover
the prompt's tokens then the generated ones, the first prompt token's entry
``null``, as vLLM and OpenAI answer (:mod:`~maxkv.serving.pipelines.
prompt_logprobs` computes them in the worker).  ``max_tokens: 0`` with
``echo`` answers the prompt alone (one token is drawn and dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException
from sse_starlette.sse import EventSourceResponse
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ... import seams, settings
from .cancels import prompts_end_with_request
from .render import prompts_of, with_body

__all__ = [
    "ChoicePlan",
    "choice_order",
    "choice_seed",
    "choice_var",
    "fork_source",
    "plan_choices",
    "wrap_choice_routes",
]

Route = Callable[[Request], Awaitable[Any]]

#: The seed of a choice whose seed comes to 0 (MAX draws a random one for 0).
ZERO_SEED = 2**63 - 1
#: Choice ``j`` samples with ``seed + j * SEED_STRIDE``: MAX keys a row's draw on
#: its seed plus its token count, so choices this far apart never share a draw
#: (as MAX's own batch ``generate`` spaces its rows).
SEED_STRIDE = 2**32
#: How long a choice waits for choice 0's request to be sent to the worker, in
#: seconds (then it is sent anyway, and computes its prompt if it arrives first).
FIRST_WAIT_S = 10.0


@dataclass
class _Choice:
    """Choice ``own`` of the request whose choice 0 is ``first`` (request id prefixes)."""

    first: str
    own: str
    sent: dict[str, asyncio.Event]
    """Per request id of choice 0 (one per prompt): set once it is on its way to
    the worker (the choices forking it are sent after it)."""

    def event(self, request_id: str) -> asyncio.Event:
        return self.sent.setdefault(request_id, asyncio.Event())


#: Set while a choice of a request runs MAX's route (:class:`_Choice`); the
#: tokenizer marks the contexts of choices after the first to fork choice 0's.
choice_var: ContextVar[_Choice | None] = ContextVar("maxkv_choice", default=None)


def fork_source(request_id: str) -> str | None:
    """The request id of the sequence the request ``request_id`` forks (choice 0's
    of the same prompt), or ``None`` for choice 0 and requests of one choice."""
    choice = choice_var.get()
    if choice is None or choice.first == choice.own or not request_id.startswith(choice.own):
        return None
    return choice.first + request_id[len(choice.own) :]


@asynccontextmanager
async def choice_order(request_id: str) -> AsyncIterator[None]:
    """Around the making of a request's context: choice 0's is marked sent after it
    (the worker receives it first, as contexts are sent in order); a later
    choice's waits for that (at most :data:`FIRST_WAIT_S`), so that choice 0's
    sequence is there to fork when it arrives."""
    choice = choice_var.get()
    if choice is None:
        yield
        return
    source = fork_source(request_id)
    if source is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(choice.event(source).wait(), FIRST_WAIT_S)
        await asyncio.sleep(0)  # (choice 0's submission runs on, without awaiting)
        yield
        return
    try:
        yield
    finally:
        if choice.first == choice.own:
            choice.event(request_id).set()


def choice_seed(seed: Any, j: int) -> Any:
    """The ``seed`` choice ``j`` samples with: ``seed + j * SEED_STRIDE`` modulo
    2^64, as an int64 (0 becomes :data:`ZERO_SEED`: MAX draws a random seed for
    0).  A seed MAX's schema would not read as an integer, or outside int64,
    is left as it is, for MAX's 400."""
    value: int | None = None
    if isinstance(seed, int):  # (bool included, as MAX's schema reads it)
        value = int(seed)
    elif isinstance(seed, float) and seed.is_integer():
        value = int(seed)
    elif isinstance(seed, str) and re.fullmatch(r"\s*[+-]?\d{1,20}\s*", seed):
        value = int(seed)
    if value is None or not -(2**63) <= value < 2**63:
        return seed
    drawn = (value + j * SEED_STRIDE) % 2**64
    return (drawn - 2**64 if drawn >= 2**63 else drawn) or ZERO_SEED


def _error(message: str) -> HTTPException:
    return HTTPException(status_code=400, detail=message)


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(f"`{name}` must be an integer, got {json.dumps(value)}")
    return value


@dataclass(frozen=True)
class ChoicePlan:
    """What a request asks beyond one plain choice per prompt."""

    n: int
    """Choices returned per prompt."""
    best_of: int
    """Choices generated per prompt (``>= n``)."""
    echo: bool
    """The prompt is returned before each choice's text (completions)."""
    logprobs: bool
    """The request asked for log probabilities."""
    max_tokens_zero: bool
    """``max_tokens: 0``: nothing is generated (with ``echo``)."""
    stream: bool
    token_ids: bool
    """The request asked for MAX's ``return_token_ids``."""

    def body(self, body: dict[str, Any], j: int) -> dict[str, Any]:
        """The body choice ``j`` runs through MAX's route."""
        one = {k: v for k, v in body.items() if k not in ("n", "best_of")}
        if body.get("seed") is not None:
            one["seed"] = choice_seed(body["seed"], j)
        if self.best_of > self.n:  # the choices are ranked by their log probability
            if "messages" in body:
                one["logprobs"] = True
                if not body.get("top_logprobs"):
                    one["top_logprobs"] = 1
            elif not body.get("logprobs"):
                one["logprobs"] = 1
        if self.echo:  # choice 0's prompt log probabilities serve every choice
            one["echo"] = bool(self.logprobs) and j == 0
            if not self.stream:  # (the prompt's and the choice's tokens, to lay them out)
                one["return_token_ids"] = True
        if self.max_tokens_zero:
            one["max_tokens"] = 1
        return one


def plan_choices(body: Any, chat: bool) -> ChoicePlan | None:
    """What ``body`` asks beyond MAX's one choice per prompt; ``None``: nothing
    (MAX's route answers it as it is).

    Raises:
        HTTPException: 400 for ``n`` / ``best_of`` out of range (``1 <= n <=
            best_of <= MAXKV_MAX_CHOICES``), ``best_of > n`` streamed, a stream
            of prompt log probabilities, ``max_tokens: 0`` without ``echo``.
    """
    if not isinstance(body, dict):
        return None
    n = _int_field(body, "n")
    best_of = None if chat else _int_field(body, "best_of")
    max_tokens = _int_field(body, "max_tokens")
    echo = not chat and body.get("echo") is True
    if n in (None, 1) and best_of in (None, 1) and not echo and max_tokens != 0:
        return None
    limit = settings.MAX_CHOICES.read()
    n = 1 if n is None else n
    best_of = n if best_of is None else best_of
    if not 1 <= n <= limit:
        raise _error(f"`n`={n}: this server returns 1 to {limit} choices (MAXKV_MAX_CHOICES)")
    if not n <= best_of <= limit:
        raise _error(f"`best_of`={best_of}: from `n` ({n}) to {limit} (MAXKV_MAX_CHOICES)")
    stream = body.get("stream") is True
    logprobs = bool(body.get("logprobs"))
    if stream and best_of > n:
        raise _error("`best_of` greater than `n` cannot stream: the best are known at the end")
    if stream and echo and logprobs:
        raise _error("`echo` with `logprobs` does not stream: leave out `stream`")
    if max_tokens == 0 and not echo:
        raise _error("`max_tokens`=0 returns nothing without `echo`")
    if max_tokens == 0 and stream:
        raise _error("`max_tokens`=0 does not stream: leave out `stream`")
    return ChoicePlan(
        n=n,
        best_of=best_of,
        echo=echo,
        logprobs=logprobs,
        max_tokens_zero=max_tokens == 0,
        stream=stream,
        token_ids=body.get("return_token_ids") is True,
    )


# ---------------------------------------------------------------- running


def _choice_request(request: Request, body: bytes, j: int) -> Request:
    """``request`` with ``body``, as choice ``j``: its own request id (MAX names each
    prompt's sequence after it)."""
    state = dict(request.scope.get("state") or {})
    state["request_id"] = f"{state.get('request_id', 'request')}-{j}"
    return with_body(Request({**request.scope, "state": state}, request.receive), body)


async def _run_choices(
    route: Route, request: Request, bodies: list[dict[str, Any]]
) -> list[Any] | Response:
    """Runs each body through ``route`` at once (choice 0 first); their answers, or
    the first error answer (the others cancelled)."""
    base = str(getattr(request.state, "request_id", "request"))
    first = f"{base}-0"
    sent: dict[str, asyncio.Event] = {}

    async def one(j: int, body: dict[str, Any]) -> Any:
        choice_var.set(_Choice(first, f"{base}-{j}", sent))
        return await route(_choice_request(request, json.dumps(body).encode(), j))

    tasks = [asyncio.ensure_future(one(j, b)) for j, b in enumerate(bodies)]
    try:
        answers = await asyncio.gather(*tasks)
    except BaseException:  # a choice failed, or the client left: end every choice
        for task in tasks:
            task.cancel()
        for answer in await asyncio.gather(*tasks, return_exceptions=True):
            if not isinstance(answer, BaseException):
                await _close(answer)
        raise
    for answer in answers:
        if isinstance(answer, Response) and not isinstance(answer, EventSourceResponse):
            for other in answers:
                await _close(other)
            return answer
    return list(answers)


async def _close(answer: Any) -> None:
    """Ends a choice's stream that will not be read (the request ends with it)."""
    iterator = getattr(answer, "body_iterator", None)
    if iterator is not None and hasattr(iterator, "aclose"):
        await iterator.aclose()


def _as_dict(answer: Any) -> dict[str, Any]:
    if isinstance(answer, dict):
        return answer
    dumped: dict[str, Any] = answer.model_dump(mode="json")
    return dumped


# ---------------------------------------------------------------- answers


def _rank(choices: list[dict[str, Any]], n: int, chat: bool) -> list[dict[str, Any]]:
    """The ``n`` of ``choices`` (all of one prompt, in choice order) with the highest
    cumulative log probability of their generated tokens (ties: the earlier)."""
    if len(choices) == n:
        return choices

    def total(choice: dict[str, Any]) -> float:
        logprobs = choice.get("logprobs") or {}
        if chat:
            return float(sum(t["logprob"] for t in logprobs.get("content") or []))
        values = logprobs.get("token_logprobs") or []
        return float(sum(v for v in values[choice.get("_prompt_entries", 0) :] if v is not None))

    order = sorted(range(len(choices)), key=lambda k: -total(choices[k]))
    return [choices[k] for k in sorted(order[:n])]


def _decoded(tokenizer: Any, ids: list[int]) -> str:
    """``ids`` as text (the prompt a stream echoes)."""
    delegate = getattr(tokenizer, "delegate", tokenizer)
    return str(delegate.decode(ids, skip_special_tokens=True))


def _token_texts(tokenizer: Any, ids: list[int]) -> tuple[list[str], list[int]]:
    """Each token of ``ids`` as text (special tokens by name), and where each starts
    in the answer's text (where special tokens have no text)."""
    delegate = getattr(tokenizer, "delegate", tokenizer)
    names, offsets, at = [], [], 0
    for token in ids:
        names.append(str(delegate.decode([token], skip_special_tokens=False)))
        offsets.append(at)
        at += len(str(delegate.decode([token], skip_special_tokens=True)))
    return names, offsets


def _echoed(
    choice: dict[str, Any],
    prompt: Any,
    plan: ChoicePlan,
    tokenizer: Any,
    prompt_part: tuple[list[Any], list[Any]] | None,
) -> dict[str, Any]:
    """A completion choice with its prompt before its text (and its log probabilities,
    in OpenAI's layout: one entry per token, the prompt's first ``null``).
    ``prompt_part``: the prompt's log probabilities and alternatives (choice 0's),
    for a choice that did not compute them (``None``: it did, they lead its own)."""
    prompt_ids = [int(t) for t in choice.get("prompt_token_ids") or []]
    generated = [] if plan.max_tokens_zero else [int(t) for t in choice.get("token_ids") or []]
    prompt_text = prompt if isinstance(prompt, str) else _decoded(tokenizer, prompt_ids)
    text = "" if plan.max_tokens_zero else choice.get("text") or ""
    choice = {**choice, "text": prompt_text + text}
    if plan.max_tokens_zero:
        choice["finish_reason"] = "length"
        choice["token_ids"] = []
    logprobs = choice.get("logprobs")
    if plan.logprobs and logprobs:
        values = list(logprobs.get("token_logprobs") or [])
        tops = list(logprobs.get("top_logprobs") or [])
        if prompt_part is not None:
            values, tops = prompt_part[0] + values, prompt_part[1] + tops
        keep = max(0, len(prompt_ids) - 1) + len(generated)
        tokens, offsets = _token_texts(tokenizer, prompt_ids + generated)
        choice["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": [None, *values[:keep]] if prompt_ids else values[:keep],
            "top_logprobs": [None, *tops[:keep]] if prompt_ids else tops[:keep],
            "text_offset": offsets,
        }
        choice["_prompt_entries"] = len(prompt_ids)
    return choice


def _usage(answers: list[dict[str, Any]], chosen: int) -> dict[str, Any] | None:
    """Usage of a request whose choices are ``answers``: prompt and cached tokens
    once (choice 0's), completion tokens summed over the ``chosen`` answers'
    choices that were generated (every one)."""
    first = answers[0].get("usage")
    if first is None:
        return None
    completion = sum(int((a.get("usage") or {}).get("completion_tokens") or 0) for a in answers)
    if chosen == 0:
        completion = 0
    usage = dict(first)
    usage["completion_tokens"] = completion
    usage["total_tokens"] = int(first.get("prompt_tokens") or 0) + completion
    return usage


def merge_completions(
    answers: list[dict[str, Any]], body: dict[str, Any], plan: ChoicePlan, tokenizer: Any
) -> dict[str, Any]:
    """One completions answer of the choices' ``answers`` (choice ``j``'s at ``j``)."""
    prompts = prompts_of(body)
    merged = dict(answers[0])
    choices = []
    for i, prompt in enumerate(prompts):
        mine = []
        prompt_part = None
        for answer in answers:
            (choice,) = [c for c in answer["choices"] if c["index"] == i]
            if plan.echo:
                if prompt_part is None and plan.logprobs:
                    logprobs = choice.get("logprobs") or {}
                    entries = max(0, len(choice.get("prompt_token_ids") or []) - 1)
                    prompt_part = (
                        list(logprobs.get("token_logprobs") or [])[:entries],
                        list(logprobs.get("top_logprobs") or [])[:entries],
                    )
                    choice = _echoed(choice, prompt, plan, tokenizer, None)
                else:
                    choice = _echoed(choice, prompt, plan, tokenizer, prompt_part)
            mine.append(choice)
        for k, choice in enumerate(_rank(mine, plan.n, chat=False)):
            choice = {key: v for key, v in choice.items() if key != "_prompt_entries"}
            choice["index"] = i * plan.n + k
            if not plan.logprobs:
                choice["logprobs"] = None
            if not plan.token_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
            choices.append(choice)
    merged["choices"] = choices
    merged["usage"] = _usage(answers, 0 if plan.max_tokens_zero else 1)
    return merged


def merge_chats(answers: list[dict[str, Any]], plan: ChoicePlan) -> dict[str, Any]:
    """One chat answer of the choices' ``answers`` (choice ``j``'s at ``j``)."""
    merged = dict(answers[0])
    mine = [answer["choices"][0] for answer in answers]
    choices = []
    for k, choice in enumerate(_rank(mine, plan.n, chat=True)):
        choice = {**choice, "index": k}
        if not plan.logprobs:
            choice["logprobs"] = None
        choices.append(choice)
    merged["choices"] = choices
    merged["usage"] = _usage(answers, 1)
    return merged


async def _merged_stream(
    streams: list[Any], include_usage: bool, prompt_text: str | None, answer_id: str
) -> AsyncIterator[str]:
    """The choices' streams as one, each chunk with the id ``answer_id`` and its
    choice's index, as they come; then one usage chunk (summed as :func:`_usage`
    does) and ``[DONE]``.  ``prompt_text``: echoed before each choice's text."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(j: int, stream: Any) -> None:
        try:
            async for item in stream.body_iterator:
                await queue.put((j, item))
        except Exception as error:  # (cancellation ends the pump silently)
            await queue.put((j, error))
        finally:
            await queue.put((j, done))

    tasks = [asyncio.ensure_future(pump(j, s)) for j, s in enumerate(streams)]
    usages: dict[int, dict[str, Any]] = {}
    started: set[int] = set()
    running = len(streams)
    try:
        while running:
            j, item = await queue.get()
            if item is done:
                running -= 1
                continue
            if isinstance(item, Exception):  # a choice's stream failed after its 200
                yield json.dumps({"error": {"message": f"choice {j}: {item}", "code": 500}})
                return
            payload = item if isinstance(item, str) else getattr(item, "data", item)
            if not isinstance(payload, str) or payload == "[DONE]":
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                yield payload
                continue
            if not isinstance(chunk, dict) or "choices" not in chunk:
                yield payload  # an error in the stream
                continue
            if chunk.get("usage"):
                usages[j] = chunk
                if not chunk["choices"]:
                    continue
            for choice in chunk["choices"]:
                choice["index"] = j
                if prompt_text is not None and j not in started and "text" in choice:
                    choice["text"] = prompt_text + (choice.get("text") or "")
            started.add(j)
            chunk.pop("usage", None)
            chunk["id"] = answer_id
            yield json.dumps(chunk)
        if include_usage and usages:
            answers = [usages[j] for j in sorted(usages)]
            final = {**answers[0], "id": answer_id, "choices": []}
            final["usage"] = _usage(answers, 1)
            yield json.dumps(final)
        yield "[DONE]"
    finally:  # (the client left, or every stream ended): stop the pumps, then the streams
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await _close(stream)


# ---------------------------------------------------------------- routes


def choices_route(route: Route, chat: bool) -> Route:
    """MAX's ``route`` (completions, or chat with ``chat``) answering several choices
    and the echoed prompt (module docs); other requests go to ``route`` as they are.
    Every request's prompts and choices end with it
    (:func:`~maxkv.serving.pipelines.cancels.prompts_end_with_request`)."""

    async def endpoint(request: Request) -> Any:
        async with prompts_end_with_request():
            return await answer(request)

    async def answer(request: Request) -> Any:
        try:
            raw = await request.body()
        except ClientDisconnect:  # an upload cut short: nobody reads the answer
            raise _error("the client left before sending the whole body") from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # MAX's route answers it (a 400)
            body = None
        plan = plan_choices(body, chat)
        if plan is None:
            return await route(with_body(request, raw))
        assert isinstance(body, dict)
        answer_id = str(getattr(request.state, "request_id", "request"))
        bodies = [plan.body(body, j) for j in range(plan.best_of)]
        answers = await _run_choices(route, request, bodies)
        if isinstance(answers, Response):
            return answers
        if plan.stream:
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            prompt_text = None
            tokenizer = getattr(getattr(request.app.state, "pipeline", None), "tokenizer", None)
            if plan.echo:
                (prompt,) = prompts_of(body)  # (a stream takes one prompt: MAX's route checked)
                prompt_text = prompt if isinstance(prompt, str) else _decoded(tokenizer, prompt)
            stream = _merged_stream(answers, include_usage, prompt_text, answer_id)
            return EventSourceResponse(stream, ping=100000, sep="\n")
        dicts = [_as_dict(a) for a in answers]
        if chat:
            merged = merge_chats(dicts, plan)
        else:
            tokenizer = getattr(getattr(request.app.state, "pipeline", None), "tokenizer", None)
            merged = merge_completions(dicts, body, plan, tokenizer)
        merged["id"] = answer_id
        return JSONResponse(merged)

    endpoint.__name__ = getattr(route, "__name__", "endpoint")
    endpoint.__doc__ = route.__doc__
    return endpoint


def wrap_choice_routes() -> None:
    """Puts :func:`choices_route` in front of MAX's completions and chat routes
    (once per process; before the server's app takes the routes in)."""
    router = seams.OPENAI_ROUTER.resolve()
    for seam, chat in ((seams.COMPLETION_ROUTE, False), (seams.CHAT_ROUTE, True)):
        route: Route = seam.resolve()
        for i, entry in enumerate(list(router.routes)):
            if getattr(entry, "endpoint", None) is not route:
                continue
            del router.routes[i]
            router.add_api_route(  # as MAX registered it, but for the endpoint
                entry.path.removeprefix(router.prefix),
                choices_route(route, chat),
                methods=sorted(entry.methods or ["POST"]),
                response_model=None,
                response_class=entry.response_class,
            )
            break
