"""No request takes ``max serve`` on maxkv down: generated OpenAI requests against a
real server on the tiny Llama directory.

Hypothesis draws ``/v1/completions`` and ``/v1/chat/completions`` bodies
(every field absent, plausible, at an edge or of any JSON type; unknown
fields; odd combinations) and bytes that are no request at all (malformed
JSON, other content types, uploads cut short): :mod:`tests.request_fuzz`.
Each must be answered with 200 or 4xx (streams: no error event of 5xx
either), the server must still answer afterwards, and a normal batch after
the run must give transformers' text.  ``MAXKV_FUZZ_EXAMPLES`` sets the
number of requests: 300 by default (about a minute on two cores; every request
that once took the server down has its own check below), 1000 or more for a
thorough run.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import requires_transformers
from .pipeline_helpers import (
    NEW_TOKENS,
    Server,
    complete,
    make_tiny_llama_dir,
    running_server,
    settled_events,
    transformers_completion,
)
from .request_fuzz import Raw, chat_bodies, completion_bodies, raw_requests, send

pytestmark = pytest.mark.serve

EXAMPLES = int(os.environ.get("MAXKV_FUZZ_EXAMPLES", "300"))
#: What the run saw, for the terminal summary (statuses, requests cut short).
SEEN: Counter[str] = Counter()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int]]:
    requires_transformers()
    directory = tmp_path_factory.mktemp("fuzz_model")
    vocab = make_tiny_llama_dir(directory, seed=7, chat_template=True)["vocab_size"]
    # With a signed disk tier and client salts on: the tiers' and tenants' paths run too.
    env = {
        "MAXKV_DISK_TIER_DIR": str(tmp_path_factory.mktemp("fuzz_disk_tier")),
        "MAXKV_TIER_SECRET": "fuzz-test-secret-0123456789",
        "MAX_SERVE_USE_CLIENT_CACHE_SALT": "1",
    }
    with running_server(directory, tmp_path_factory.mktemp("fuzz_serve"), env) as server:
        yield server, vocab


def post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    """The status, and the JSON events of a stream (``[]`` otherwise)."""
    import httpx

    try:
        data = json.dumps(body, allow_nan=False)
    except (TypeError, ValueError):
        return 200, []  # not expressible as JSON: nothing to send
    events: list[Any] = []
    with (
        httpx.Client(timeout=300) as client,
        client.stream(
            "POST", server.url + path, content=data, headers={"Content-Type": "application/json"}
        ) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                try:
                    events.append(json.loads(line[len("data: ") :]))
                except ValueError:
                    events.append(line)
        return response.status_code, events


def alive(server: Server) -> bool:
    try:
        with urllib.request.urlopen(f"{server.url}/v1/models", timeout=60) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def test_no_request_takes_the_server_down(fuzz_server: tuple[Server, int]) -> None:
    server, vocab = fuzz_server
    model = str(server.model)
    prompts = ["hello world", "The quick brown fox", "abc", "maxkv"]
    expected = [transformers_completion(server.model, p, NEW_TOKENS) for p in prompts]
    requests = st.one_of(
        completion_bodies(model, vocab).map(lambda b: ("/v1/completions", b)),
        chat_bodies(model, vocab).map(lambda b: ("/v1/chat/completions", b)),
        raw_requests(),
        # The render routes (what KV-aware routers ask first): the same guard.
        completion_bodies(model, vocab).map(lambda b: ("/v1/completions/render", b)),
        chat_bodies(model, vocab).map(lambda b: ("/v1/chat/completions/render", b)),
    )

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests)
    def one(item: Raw | tuple[str, dict[str, Any]]) -> None:
        if isinstance(item, Raw):
            status = send("127.0.0.1", int(server.url.rsplit(":", 1)[1]), item)
            events: list[Any] = []
        else:
            status, events = post(server, *item)
        SEEN[str(status)] += 1
        assert status is None or status < 500, (status, item)
        for event in events:  # a stream that failed after its 200
            error = event.get("error") if isinstance(event, dict) else None
            if isinstance(error, dict):
                SEEN["stream error"] += 1
                assert int(error.get("code", 500)) < 500, (error, item)
        assert alive(server), item

    one()
    print(f"fuzzed {EXAMPLES} requests: {dict(SEEN)}")
    assert SEEN["200"] > EXAMPLES // 20, SEEN  # many were served, not only refused

    # A normal batch afterwards: the same text as transformers, and every page back.
    import concurrent.futures

    start = server.events.stat().st_size if server.events.exists() else 0
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(server, p), prompts))
    for (status, body), text in zip(answers, expected, strict=True):
        assert status == 200, body
        assert body["choices"][0]["text"] == text
    logged = settled_events(server, start)
    assert logged[-1]["event"] == "release" and logged[-1]["free"] == logged[-1]["total"]


def test_a_refused_prompt_stops_the_requests_other_prompts(
    fuzz_server: tuple[Server, int],
) -> None:
    """A request whose last prompt is refused (too long: known once tokenized, after
    the others went to the worker) is answered 400, and the others stop there
    (found by the run above: they ran on to ``--max-length`` after the answer,
    holding their pages into the requests that followed)."""
    server, _ = fuzz_server
    start = server.events.stat().st_size if server.events.exists() else 0
    # The last prompt: 5,000 characters (as many tokens for the tiny model), past
    # --max-length (256); refused once tokenized, after the others were sent.
    prompts = ["The quick brown fox", "hello world", "word " * 1000]
    for _ in range(3):  # (until one of the others reached the worker before the 400)
        status, answer = complete(server, prompts, max_tokens=200, ignore_eos=True)  # type: ignore[arg-type]
        assert status == 400 and "exceeds" in json.dumps(answer), answer
        logged, quiet = [], 0  # the answer comes before the worker logs the others
        while quiet < 4:
            time.sleep(0.5)
            now = settled_events(server, start)
            quiet = quiet + 1 if len(now) == len(logged) else 0
            logged = now
        started = [e for e in logged if e["event"] == "alloc"]
        released = [e for e in logged if e["event"] == "release"]
        if started:
            break
    assert started, f"the other prompts never reached the worker: nothing was checked {logged}"
    assert len(released) == len(started), logged
    # Each stopped within a few batches of the answer, not after its 200 tokens.
    assert all(e["tokens"] < 100 for e in released), released
    assert released[-1]["free"] == released[-1]["total"], released


def test_a_top_k_past_the_vocabulary_draws_as_the_vocabulary(
    fuzz_server: tuple[Server, int],
) -> None:
    """Found by the run above: ``top_k`` 2**31 made MAX's sampler take 23 GB, and the
    model worker was killed (the server with it)."""
    server, vocab = fuzz_server
    sampled = {"temperature": 1.0, "seed": 11}
    answers = [complete(server, "hello world", top_k=k, **sampled) for k in (2**31, vocab)]
    assert [status for status, _ in answers] == [200, 200], answers
    texts = [body["choices"][0]["text"] for _, body in answers]
    assert texts[0] == texts[1] and alive(server), texts


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": [5, 6, 700]}, "outside the model's vocabulary"),
        ({"prompt": [5, -1]}, "outside the model's vocabulary"),
        ({"prompt": "hi", "echo": True, "logprobs": 2, "stream": True}, "does not stream"),
        ({"prompt": []}, "empty list"),
        ({"prompt": [[]]}, "empty list of token ids"),
        ({"prompt": [[5], [6, 99]]}, "outside the model's vocabulary"),
        ({"prompt": ["a", "b"], "stream": True}, "streamed completions take one prompt"),
        ({"prompt": "hi", "stop_token_ids": [2**64]}, "64-bit"),
        ({"prompt": "hi", "stop_token_ids": [500]}, "`stop_token_ids`"),
        ({"prompt": "hi", "seed": 2**70}, "64-bit"),
        ({"prompt": "hi", "seed": 2**64, "n": 2}, "64-bit"),  # (not wrapped per choice)
        ({"prompt": "hi", "n": 17}, "MAXKV_MAX_CHOICES"),
        ({"prompt": "hi", "n": 3, "best_of": 2}, "`best_of`=2"),
        ({"prompt": "hi", "max_tokens": 0}, "without `echo`"),
        ({"prompt": "hi", "skip_special_tokens": False}, "`skip_special_tokens`=false"),
        ({"prompt": "hi", "no_stop_trim": True}, "`no_stop_trim`=true"),
    ],
)
def test_requests_the_worker_cannot_serve_get_a_clear_400(
    fuzz_server: tuple[Server, int], body: dict[str, Any], message: str
) -> None:
    """Each of these killed the server or got a 500 before (MAX 26.7's own pipeline too)."""
    server, _ = fuzz_server
    prompt = body.pop("prompt")
    status, answer = complete(server, prompt, **body)  # type: ignore[arg-type]
    assert status == 400 and message in json.dumps(answer), answer
    assert alive(server)


def test_deeply_nested_body_is_a_400(fuzz_server: tuple[Server, int]) -> None:
    server, _ = fuzz_server
    port = int(server.url.rsplit(":", 1)[1])
    assert send("127.0.0.1", port, Raw("/v1/completions", b"[" * 100_000)) == 400
    assert alive(server)
