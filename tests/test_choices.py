"""Several choices per request (``n``, ``best_of``) by fork, and the prompt's log
probabilities with ``echo``, on ``max serve`` (:mod:`maxkv.serving.pipelines.choices`).

Unit tests of the request plan and the answer's assembly; then one server on
the tiny Llama (chunks of at most 32 prompt tokens, pages of 16, prefix
caching): prompt log probabilities against transformers' ``log_softmax``
(one chunk and several, with a cached prefix and without, text and token-id
prompts), greedy choices against transformers' greedy text, seeded sampled
choices against transformers' distribution (chi-square), ``best_of`` against
the same choices ranked by hand, streams, usage, 400s, and every page back.
"""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .pipeline_helpers import (
    Server,
    make_tiny_llama_dir,
    read_events,
    running_server,
    settled_events,
    transformers_completion,
)

# ------------------------------------------------------------------ unit


@pytest.mark.unit
def test_plan_leaves_plain_requests_to_max() -> None:
    from maxkv.serving.pipelines.choices import plan_choices

    assert plan_choices({"prompt": "a", "n": 1, "best_of": 1, "max_tokens": 3}, chat=False) is None
    assert plan_choices({"messages": [], "echo": True}, chat=True) is None  # chat has no echo
    assert plan_choices([1, 2], chat=False) is None
    plan = plan_choices({"prompt": "a", "n": 2, "best_of": 3, "seed": 9}, chat=False)
    assert plan is not None and (plan.n, plan.best_of) == (2, 3)
    bodies = [plan.body({"prompt": "a", "n": 2, "best_of": 3, "seed": 9}, j) for j in range(3)]
    assert [b["seed"] for b in bodies] == [9, 9 + 2**32, 9 + 2**33]  # (never a shared draw)
    assert all("n" not in b and "best_of" not in b for b in bodies)
    assert all(b["logprobs"] == 1 for b in bodies)  # ranked by their log probabilities
    zero = plan_choices({"prompt": "a", "n": 2, "seed": 0}, chat=False)
    assert zero is not None  # (MAX draws a random seed for 0)
    assert [zero.body({"prompt": "a", "seed": 0}, j)["seed"] for j in (0, 1)] == [2**63 - 1, 2**32]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"n": 0}, "`n`=0"),
        ({"n": 17}, "`n`=17"),
        ({"n": True}, "must be an integer"),
        ({"n": "2"}, "must be an integer"),
        ({"n": 3, "best_of": 2}, "`best_of`=2"),
        ({"best_of": 40}, "`best_of`=40"),
        ({"n": 1, "best_of": 2, "stream": True}, "cannot stream"),
        ({"echo": True, "logprobs": 1, "stream": True}, "does not stream"),
        ({"max_tokens": 0}, "without `echo`"),
    ],
)
def test_plan_refuses_what_it_cannot_serve(body: dict[str, Any], message: str) -> None:
    from fastapi import HTTPException

    from maxkv.serving.pipelines.choices import plan_choices

    with pytest.raises(HTTPException, match=message) as raised:
        plan_choices({"prompt": "a", **body}, chat=False)
    assert raised.value.status_code == 400


@pytest.mark.unit
def test_max_choices_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi import HTTPException

    from maxkv.serving.pipelines.choices import plan_choices

    monkeypatch.setenv("MAXKV_MAX_CHOICES", "2")
    with pytest.raises(HTTPException, match="1 to 2 choices"):
        plan_choices({"prompt": "a", "n": 3}, chat=False)
    monkeypatch.setenv("MAXKV_MAX_CHOICES", "0")
    with pytest.raises(ValueError, match="MAXKV_MAX_CHOICES"):
        plan_choices({"prompt": "a", "n": 3}, chat=False)


@pytest.mark.unit
def test_best_of_keeps_the_highest_cumulative_log_probabilities() -> None:
    from maxkv.serving.pipelines.choices import merge_completions, plan_choices

    body = {"prompt": ["p", "q"], "n": 2, "best_of": 3}
    plan = plan_choices(body, chat=False)
    assert plan is not None

    def answer(j: int, totals: list[list[float]]) -> dict[str, Any]:
        return {
            "id": f"x-{j}",
            "choices": [
                {"index": i, "text": f"{i}{j}", "logprobs": {"token_logprobs": t[j]}}
                for i, t in enumerate(totals)
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14},
        }

    totals = [[[-1.0, -1.0], [-0.5], [-3.0]], [[-9.0], [-0.1, -0.1], [-0.3]]]
    merged = merge_completions([answer(j, totals) for j in range(3)], body, plan, None)
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "00"),  # -2.0, then -0.5: choice order kept
        (1, "01"),
        (2, "11"),
        (3, "12"),
    ]
    assert all(c["logprobs"] is None for c in merged["choices"])  # not asked for
    # Prompt tokens once (choice 0's answer), completion tokens of every choice drawn.
    assert merged["usage"] == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}


@pytest.mark.unit
def test_best_of_with_echo_ranks_by_the_generated_tokens_only() -> None:
    """With ``echo`` and no ``logprobs`` asked, the ranking still reads the choices'
    log probabilities (asked for it: the prompt's are not computed); the answer has
    none, and its text starts with the prompt."""
    from maxkv.serving.pipelines.choices import merge_completions, plan_choices

    body = {"prompt": "ab", "n": 1, "best_of": 2, "echo": True, "max_tokens": 1}
    plan = plan_choices(body, chat=False)
    assert plan is not None
    assert [plan.body(body, j)["logprobs"] for j in (0, 1)] == [1, 1]

    def answer(j: int, values: list[float]) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": f"c{j}",
            "prompt_token_ids": [10, 11],
            "token_ids": [20 + j],
            "logprobs": {"token_logprobs": values, "top_logprobs": [{}] * len(values)},
        }
        return {"id": "x", "choices": [choice], "usage": {"prompt_tokens": 2}}

    class Tokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(ord("a") + i - 10) for i in ids)

    assert [plan.body(body, j)["echo"] for j in (0, 1)] == [False, False]
    merged = merge_completions([answer(0, [-1.0]), answer(1, [-0.5])], body, plan, Tokenizer())
    (choice,) = merged["choices"]
    assert choice["text"] == "abc1" and choice["logprobs"] is None


@pytest.mark.unit
def test_a_preempted_echo_request_is_not_scored_again() -> None:
    from types import SimpleNamespace

    from maxkv.serving.pipelines.context import wants_prompt_logprobs

    def ctx(prompt: int, processed: int, echo: int | None) -> SimpleNamespace:
        tokens = SimpleNamespace(prompt_length=prompt, processed_length=processed)
        return SimpleNamespace(tokens=tokens, echo_prompt_length=echo)

    assert wants_prompt_logprobs(ctx(10, 0, 10))
    assert wants_prompt_logprobs(ctx(10, 4, 10))  # between chunks
    assert not wants_prompt_logprobs(ctx(10, 10, 10))  # decoding
    assert not wants_prompt_logprobs(ctx(13, 0, 10))  # preempted after 3 tokens
    assert not wants_prompt_logprobs(ctx(10, 0, None))  # no echo


# ------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from .conftest import requires_transformers

    requires_transformers()
    directory = tmp_path_factory.mktemp("choices_model")
    make_tiny_llama_dir(directory, seed=7, chat_template=True)
    return directory


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(model_dir, tmp_path_factory.mktemp("choices_serve")) as running:
        yield running


def post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body`` (with the model) to ``path``; (status, JSON or SSE payloads)."""
    request = urllib.request.Request(
        f"{server.url}{path}",
        data=json.dumps({"model": str(server.model), **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            raw = response.read().decode()
            if body.get("stream"):
                return response.status, [
                    line[len("data: ") :] for line in raw.splitlines() if line.startswith("data:")
                ]
            return response.status, json.loads(raw)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def reference_log_probs(directory: Path, ids: list[int]) -> np.ndarray:
    """transformers' float64 ``log_softmax`` of every row of ``ids``: ``[len, vocab]``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return np.asarray(torch.log_softmax(logits, -1).numpy())


def encode(directory: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(directory))(text).input_ids)


def pages_back(server: Server, start: int) -> None:
    """Every sequence started since ``start`` was released and every page is free."""
    events = settled_events(server, start)
    kinds = Counter(e["event"] for e in events)
    assert kinds["alloc"] == kinds["release"] > 0, kinds
    assert events[-1]["free"] == events[-1]["total"], events[-1]


SHORT = "Hello, world. "
LONG = "The quick brown fox jumps over the lazy dog. " * 3  # 135 tokens: 5 chunks of 32


@pytest.mark.serve
def test_echo_prompt_log_probabilities_equal_transformers(server: Server, model_dir: Path) -> None:
    """``echo`` + ``logprobs`` + ``max_tokens: 0``: the prompt alone, every prompt token
    after the first with transformers' log probability (1e-3) and the top 3 among
    transformers' most likely; one chunk and five, and again once the prompt is
    in the prefix cache (computed anyway, so every token still has one)."""
    start = server.events.stat().st_size if server.events.exists() else 0
    for prompt in (SHORT, LONG, LONG):  # the second LONG: its pages are cached
        ids = encode(model_dir, prompt)
        expected = reference_log_probs(model_dir, ids)
        status, answer = post(
            server,
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3},
        )
        assert status == 200, answer
        (choice,) = answer["choices"]
        assert choice["text"] == prompt
        assert choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        got = np.array(logprobs["token_logprobs"][1:])
        want = expected[np.arange(len(ids) - 1), ids[1:]]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-3)
        tokens = logprobs["tokens"]
        assert "".join(tokens) == prompt  # (one character a token)
        assert logprobs["text_offset"] == list(range(len(prompt)))
        for row, top in enumerate(logprobs["top_logprobs"][1:]):
            best = set(np.argsort(-expected[row])[:3].tolist()) | {ids[row + 1]}
            assert len(top) == len(best)
            assert sorted(top.values()) == pytest.approx(
                sorted(expected[row, list(best)].tolist()), abs=1e-3
            )
        assert answer["usage"]["completion_tokens"] == 0
        assert answer["usage"]["prompt_tokens"] == len(ids)
    pages_back(server, start)


@pytest.mark.serve
def test_echo_with_generated_tokens_and_token_prompts(server: Server, model_dir: Path) -> None:
    """A token-id prompt with ``echo`` and 3 greedy tokens: the prompt's entries, then
    the generated tokens' (transformers' greedy tokens and log probabilities)."""
    ids = encode(model_dir, LONG)
    status, answer = post(
        server,
        "/v1/completions",
        {"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0},
    )
    assert status == 200, answer
    (choice,) = answer["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) + 3
    full = encode(model_dir, choice["text"])
    expected = reference_log_probs(model_dir, full)
    assert full[: len(ids)] == ids
    want = expected[np.arange(len(full) - 1), full[1:]]
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], want, atol=1e-3)
    assert choice["text"].startswith(LONG)


@pytest.mark.serve
def test_greedy_choices_are_identical_and_transformers_text(
    server: Server, model_dir: Path
) -> None:
    """``n=4`` at temperature 0: four choices, each transformers' greedy text; the
    prompt is computed once (choices 1-3 fork choice 0's sequence: all but its
    last token cached, a page or less of their own each), every page back."""
    start = server.events.stat().st_size if server.events.exists() else 0
    status, answer = post(
        server, "/v1/completions", {"prompt": LONG, "max_tokens": 8, "n": 4, "temperature": 0}
    )
    assert status == 200, answer
    texts = [c["text"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    expected = transformers_completion(model_dir, LONG, 8)
    assert texts == [expected] * 4
    # A request of one choice goes through MAX's route untouched.
    status, one = post(
        server, "/v1/completions", {"prompt": LONG, "max_tokens": 8, "temperature": 0}
    )
    assert status == 200, one
    assert [c["text"] for c in one["choices"]] == [expected]
    prompt = len(encode(model_dir, LONG))
    forks = [
        e
        for e in read_events(server.events, start)
        if e["event"] == "alloc" and e["request"] in {f"{answer['id']}-{j}_0" for j in (1, 2, 3)}
    ]
    assert [e["cached_prefix"] for e in forks] == [prompt - 1] * 3, forks
    frees = [e["free"] for e in forks]  # each fork takes one page (a copy of the last)
    assert all(a - b == 1 for a, b in itertools.pairwise(frees)), frees
    usage = answer["usage"]
    assert usage["prompt_tokens"] == prompt
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    assert usage["completion_tokens"] == 4 * 8
    pages_back(server, start)


@pytest.mark.serve
def test_chat_choices_and_streams(server: Server) -> None:
    """Chat ``n=3`` sampled with a seed: three choices, not all alike, the same again
    for the same seed; a stream of ``n=2`` carries both indices, their texts the
    same as unstreamed, one usage chunk summing both, one ``[DONE]``."""
    body = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 8,
        "n": 3,
        "temperature": 1.0,
        "seed": 11,
    }
    status, first = post(server, "/v1/chat/completions", body)
    assert status == 200, first
    texts = [c["message"]["content"] for c in first["choices"]]
    assert len(set(texts)) > 1
    _, again = post(server, "/v1/chat/completions", body)
    assert [c["message"]["content"] for c in again["choices"]] == texts

    plain = {"prompt": SHORT, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 3}
    _, whole = post(server, "/v1/completions", plain)
    status, chunks = post(
        server,
        "/v1/completions",
        {**plain, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert status == 200
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    parsed = [json.loads(c) for c in chunks[:-1]]
    streamed = {0: "", 1: ""}
    for chunk in parsed:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert [streamed[0], streamed[1]] == [c["text"] for c in whole["choices"]]
    usages = [c["usage"] for c in parsed if c.get("usage")]
    assert len(usages) == 1
    assert usages[0]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert len({c["id"] for c in parsed}) == 1


@pytest.mark.serve
def test_best_of_returns_the_best_by_cumulative_log_probability(server: Server) -> None:
    """``best_of=4, n=2`` with a seed returns the two of the four seeded choices
    (``n=4``, same seed, with their log probabilities) whose tokens' log
    probabilities sum highest."""
    body = {"prompt": SHORT, "max_tokens": 6, "temperature": 1.0, "seed": 21}
    status, four = post(server, "/v1/completions", {**body, "n": 4, "logprobs": 1})
    assert status == 200, four
    totals = [sum(c["logprobs"]["token_logprobs"]) for c in four["choices"]]
    best = sorted(sorted(range(4), key=lambda k: -totals[k])[:2])
    status, answer = post(server, "/v1/completions", {**body, "n": 2, "best_of": 4})
    assert status == 200, answer
    assert [c["text"] for c in answer["choices"]] == [four["choices"][k]["text"] for k in best]
    assert all(c["logprobs"] is None for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == four["usage"]["completion_tokens"]


@pytest.mark.serve
def test_sampled_choices_follow_the_models_distribution(server: Server, model_dir: Path) -> None:
    """The first tokens of 16 x 16 seeded choices at temperature 1 follow
    transformers' softmax after the prompt (chi-square, p = 1e-6, tokens of
    expected count under 5 pooled)."""
    start = server.events.stat().st_size if server.events.exists() else 0
    counts: Counter[int] = Counter()
    for seed in range(16):
        status, answer = post(
            server,
            "/v1/completions",
            {
                "prompt": SHORT,
                "max_tokens": 1,
                "n": 16,
                "temperature": 1.0,
                "seed": 1000 * seed,
                "return_token_ids": True,
            },
        )
        assert status == 200, answer
        for choice in answer["choices"]:
            (token,) = choice["token_ids"]
            counts[token] += 1
    ids = encode(model_dir, SHORT)
    probs = np.exp(reference_log_probs(model_dir, ids)[-1])
    total = sum(counts.values())
    expected = probs * total
    big = expected >= 5
    observed = np.array([counts[t] for t in np.flatnonzero(big)] + [0.0])
    observed[-1] = total - observed[:-1].sum()
    wanted = np.concatenate([expected[big], [expected[~big].sum()]])
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    dof = len(wanted) - 1
    critical = dof * (1 - 2 / (9 * dof) + 4.753 * (2 / (9 * dof)) ** 0.5) ** 3
    assert statistic < critical, (statistic, critical)
    pages_back(server, start)


@pytest.mark.serve
def test_choices_that_cannot_be_served_are_400s(server: Server) -> None:
    for body, message in [
        ({"prompt": SHORT, "n": 17}, "MAXKV_MAX_CHOICES"),
        ({"prompt": SHORT, "n": 3, "best_of": 2}, "best_of"),
        ({"prompt": SHORT, "n": 2, "best_of": 3, "stream": True}, "cannot stream"),
        ({"prompt": SHORT, "max_tokens": 0}, "echo"),
    ]:
        status, answer = post(server, "/v1/completions", body)
        assert status == 400, (body, answer)
        assert message in json.dumps(answer)
    status, answer = post(server, "/v1/completions", {"prompt": [], "n": 2})
    assert status == 400
