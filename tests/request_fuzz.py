"""Hypothesis strategies for OpenAI requests, valid and not, and a raw HTTP client.

What a fuzzer sends ``max serve``: ``/v1/completions`` and
``/v1/chat/completions`` bodies whose every field is omitted, plausible
(the ranges a client would send, edges included) or wild (any JSON value:
wrong types, huge and empty values, deep nesting), unknown fields, odd
combinations (``echo`` with ``logprobs`` and ``max_tokens: 0``, several
choices streamed or ranked, ``min_tokens`` over ``max_tokens``,
token ids past the vocabulary, streams with usage), and bytes that are not a
request at all (malformed JSON, other content types, uploads cut short).

:func:`send` speaks HTTP/1.1 over a socket itself so that it can send
anything (a body shorter than its ``Content-Length``, then hang up).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

#: Largest ``max_tokens`` most generated requests ask for (keeps a run short);
#: some ask for far more (the server's ``--max-length`` bounds them).
SMALL_MAX_TOKENS = 8

_INT_EDGES = [
    0,
    1,
    -1,
    2,
    7,
    2**31 - 1,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    10**30,
]
_FLOAT_EDGES = [0.0, -0.0, 1e-30, 0.5, 1.0, 2.0, -1.0, 1e30, -1e30, 1e308]

wild_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(_INT_EDGES),
    st.integers(),
    st.sampled_from(_FLOAT_EDGES),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["", " ", "\x00", "\ud7ff", "null", "NaN", "[]", "{}", "a" * 20_000]),
)
#: Any JSON value (NaN and infinities excluded: JSON has none).
wild = st.recursive(
    wild_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def token_ids(vocab: int) -> st.SearchStrategy[int]:
    """Token ids of the vocabulary."""
    return st.integers(0, vocab - 1)


def bad_token_ids(vocab: int) -> st.SearchStrategy[int]:
    """Token ids at and past the end of the vocabulary, negative, past int64."""
    return st.sampled_from([vocab, vocab + 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1])


def some_bad(good: st.SearchStrategy[int], bad: st.SearchStrategy[int]) -> st.SearchStrategy[Any]:
    """Lists of ids, one of them bad."""
    return st.tuples(st.lists(good, max_size=6), bad, st.integers(0, 6)).map(
        lambda t: [*t[0][: t[2]], t[1], *t[0][t[2] :]]
    )


text = st.one_of(
    st.text(max_size=40), st.sampled_from(["", "hello world", "abc " * 40, "\n\t", "\u2028"])
)

#: A field: (plausible values, edge values a careful client would not send).
Field = tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]


def common_fields(vocab: int) -> dict[str, Field]:
    """Sampling fields both routes take."""
    floats = st.floats(allow_nan=False, allow_infinity=False)
    return {
        "max_tokens": (
            st.integers(1, SMALL_MAX_TOKENS),
            st.sampled_from([0, -1, -(2**63), 2**31, 2**63, 10**9]),
        ),
        "temperature": (st.floats(0, 2), st.one_of(floats, st.sampled_from([1e-300, 1e300]))),
        "top_p": (st.floats(0.01, 1), floats),
        "top_k": (st.integers(1, vocab), st.sampled_from([0, -1, 2**31, 2**63, 2**64])),
        "min_p": (st.floats(0, 0.5), floats),
        "frequency_penalty": (st.floats(-2, 2), floats),
        "presence_penalty": (st.floats(-2, 2), floats),
        "repetition_penalty": (st.floats(0.5, 2), floats),
        "seed": (st.integers(0, 2**32), st.sampled_from(_INT_EDGES)),
        "stop": (st.one_of(text, st.lists(text, max_size=4)), st.lists(text, min_size=50)),
        "stop_token_ids": (
            st.lists(token_ids(vocab), max_size=4),
            some_bad(token_ids(vocab), bad_token_ids(vocab)),
        ),
        "min_tokens": (st.integers(0, 4), st.sampled_from([-1, 100, 2**63])),
        "ignore_eos": (st.booleans(), st.just(None)),
        "n": (st.integers(1, 3), st.sampled_from([-1, 0, 17, 2**31, 2**63, True, "2"])),
        "logit_bias": (
            st.dictionaries(token_ids(vocab).map(str), st.integers(-100, 100), max_size=3),
            st.dictionaries(
                st.one_of(bad_token_ids(vocab).map(str), text), st.integers(), max_size=3
            ),
        ),
        "stream": (st.booleans(), st.just(None)),
        "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), wild),
        "user": (text, st.just("u" * 100_000)),
        "cache_salt": (st.sampled_from(["tenant-a", "tenant-b", ""]), st.just("s" * 5000)),
        "return_token_ids": (st.booleans(), st.just(None)),
        "dkv_cache_hint": (
            st.just({}),
            st.dictionaries(st.text(max_size=5), wild_scalar, max_size=3),
        ),
        "thinking_temperature": (st.floats(0, 2), floats),
        "reasoning_split": (st.booleans(), st.just(None)),
        # vLLM's and SGLang's fields, as routers forward them (their defaults), or not.
        "skip_special_tokens": (st.just(True), st.one_of(st.just(False), wild_scalar)),
        "no_stop_trim": (st.just(False), st.one_of(st.just(True), wild_scalar)),
        "return_hidden_states": (st.just(False), wild_scalar),
        "separate_reasoning": (st.booleans(), wild_scalar),
        "include_reasoning": (st.booleans(), wild_scalar),
        "priority": (st.integers(0, 10), wild_scalar),
        "prompt_logprobs": (st.none(), st.integers(0, 5)),
    }


def _body(
    required: dict[str, Field], optional: dict[str, Field]
) -> st.SearchStrategy[dict[str, Any]]:
    """A body of the ``required`` fields and some ``optional`` ones, mostly with
    plausible values; per body, a rate of edge values and one of wild ones (any
    JSON), from none on (a body with one wrong type is refused whole, so most
    bodies get none and are served)."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        edge_percent = draw(st.sampled_from([0, 0, 0, 3, 10]))
        wild_percent = draw(st.sampled_from([0, 0, 0, 0, 2, 10]))

        def value(field: Field) -> Any:
            roll = draw(st.integers(0, 99))
            if roll < wild_percent:
                return draw(wild)
            if roll < wild_percent + edge_percent:
                return draw(field[1])
            return draw(field[0])

        body = {name: value(field) for name, field in required.items()}
        for name, field in optional.items():
            if draw(st.integers(0, 99)) < 20:
                body[name] = value(field)
        if wild_percent:  # unknown fields
            for _ in range(draw(st.integers(0, 2))):
                body[draw(st.text(min_size=1, max_size=12))] = draw(wild)
        if draw(st.integers(0, 29)) == 0:  # a required field missing
            del body[draw(st.sampled_from(sorted(required)))]
        return body

    return build()


def completion_bodies(model: str, vocab: int) -> st.SearchStrategy[dict[str, Any]]:
    """``/v1/completions`` bodies."""
    ids = st.lists(token_ids(vocab), min_size=1, max_size=40)
    prompt: Field = (
        st.one_of(
            text.filter(bool),
            text,
            ids,
            st.lists(text, min_size=1, max_size=3),
            st.lists(ids, min_size=1, max_size=3),
        ),
        st.one_of(
            st.just([]),
            st.just([[]]),
            st.just([""]),
            some_bad(token_ids(vocab), bad_token_ids(vocab)),
            st.just(list(range(1, 300))),  # longer than --max-length
            st.just("x" * 5000),
        ),
    )
    optional: dict[str, Field] = {
        **common_fields(vocab),
        "echo": (st.booleans(), st.just(None)),
        "logprobs": (st.integers(0, 5), st.sampled_from([-1, 6, 20, 2**31])),
        "best_of": (st.integers(1, 4), st.sampled_from([-1, 0, 17, 2**63, "3"])),
        "suffix": (text, wild_scalar),
    }
    model_name: Field = (st.just(model), st.sampled_from(["", "another-model", "/etc/passwd"]))
    return _body({"model": model_name, "prompt": prompt}, optional)


def chat_bodies(model: str, vocab: int) -> st.SearchStrategy[dict[str, Any]]:
    """``/v1/chat/completions`` bodies."""
    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": text}),
        st.fixed_dictionaries(
            {
                "type": st.just("image_url"),
                "image_url": st.fixed_dictionaries(
                    {
                        "url": st.sampled_from(
                            ["data:image/png;base64,AAAA", "http://127.0.0.1:1/x", ""]
                        )
                    }
                ),
            }
        ),
        st.dictionaries(st.text(max_size=6), wild_scalar, max_size=3),
    )
    good_message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "user", "system", "assistant"]), "content": text}
    )
    odd_message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "tool", "developer", "x", ""]),
            "content": st.one_of(st.lists(part, max_size=3), st.none(), wild),
        },
        optional={"name": text, "tool_call_id": text, "tool_calls": wild},
    )
    tool = st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["f", "get_weather"]),
                    "parameters": st.just({"type": "object"}),
                }
            ),
        }
    )
    odd_tool = st.one_of(st.none(), wild, tool.map(lambda t: {**t, "function": {"name": ""}}))
    optional: dict[str, Field] = {
        **common_fields(vocab),
        "max_completion_tokens": (st.integers(1, SMALL_MAX_TOKENS), st.integers(-1, 0)),
        "logprobs": (st.booleans(), st.just(None)),
        "top_logprobs": (st.integers(0, 5), st.sampled_from([-1, 6, 25, 2**40])),
        "response_format": (
            st.one_of(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                st.just(
                    {
                        "type": "json_schema",
                        "json_schema": {"name": "s", "schema": {"type": "object"}},
                    }
                ),
            ),
            st.one_of(
                st.just({"type": "bogus"}),
                st.fixed_dictionaries(
                    {
                        "type": st.just("json_schema"),
                        "json_schema": st.fixed_dictionaries(
                            {"name": st.just("s"), "schema": wild}
                        ),
                    }
                ),
            ),
        ),
        "tools": (st.lists(tool, max_size=2), st.lists(odd_tool, min_size=1, max_size=2)),
        "tool_choice": (st.sampled_from(["none", "auto"]), st.one_of(st.just("required"), wild)),
        "chat_template_kwargs": (
            st.just({}),
            st.dictionaries(st.text(max_size=6), wild_scalar, max_size=3),
        ),
        "prompt_tokens": (
            st.lists(token_ids(vocab), min_size=1, max_size=20),
            some_bad(token_ids(vocab), bad_token_ids(vocab)),
        ),
        "continue_final_message": (st.booleans(), wild_scalar),
        "add_generation_prompt": (st.booleans(), wild_scalar),
        "stream_reasoning": (st.booleans(), wild_scalar),
    }
    messages: Field = (
        st.lists(good_message, min_size=1, max_size=4),
        st.one_of(
            st.just([]), st.lists(st.one_of(good_message, odd_message), min_size=1, max_size=4)
        ),
    )
    model_name: Field = (st.just(model), st.sampled_from(["", "another-model"]))
    return _body({"model": model_name, "messages": messages}, optional)


@dataclass(frozen=True)
class Raw:
    """Bytes to send as they are: a path, headers and a body that may be cut short."""

    path: str
    body: bytes
    content_type: str = "application/json"
    #: Send only this many bytes of the body (the Content-Length says all), then hang up.
    cut: int | None = None


def raw_requests() -> st.SearchStrategy[Raw]:
    """Bytes that are not a well-formed request."""
    path = st.sampled_from(
        [
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/completions/render",
            "/v1/chat/completions/render",
        ]
    )
    junk = st.one_of(
        st.binary(max_size=200),
        st.sampled_from(
            [
                b"",
                b"{",
                b"[]",
                b"null",
                b'{"prompt": "hi"',
                b'{"model": NaN}',
                b"\xff\xfe",
                b'{"model": "m", "prompt": "x", "prompt": 5}',
                b"[" * 5000 + b"]" * 5000,
            ]
        ),
    )
    return st.one_of(
        st.builds(Raw, path, junk),
        st.builds(
            Raw,
            path,
            junk,
            st.sampled_from(["text/plain", "", "application/x-www-form-urlencoded"]),
        ),
        st.builds(
            Raw,
            path,
            st.just(json.dumps({"model": "m", "prompt": "hello " * 50}).encode()),
            st.just("application/json"),
            st.integers(0, 100),
        ),
    )


def send(host: str, port: int, raw: Raw, timeout: float = 120.0) -> int | None:
    """Sends ``raw``; the response's status code, or ``None`` if there was none (a
    request cut short: the server may wait, then drop it)."""
    body = raw.body if raw.cut is None else raw.body[: raw.cut]
    head = (
        f"POST {raw.path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
        f"Content-Type: {raw.content_type}\r\nContent-Length: {len(raw.body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(head + body)
        if raw.cut is not None:
            sock.shutdown(socket.SHUT_WR)  # the upload ends early; nothing more comes
            sock.settimeout(5.0)
        try:
            first = sock.recv(64)
        except (TimeoutError, ConnectionError):
            return None
    if not first:
        return None
    try:
        return int(first.split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise AssertionError(f"not an HTTP response: {first!r}") from None
