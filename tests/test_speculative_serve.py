"""Prompt-lookup speculative decoding inside MAX's pipelines (``MAXKV_SPECULATIVE``).

Unit tests of the settings, the eligibility of a request and the stop-string
check; then one ``max serve`` with speculation on the tiny Llama, whose greedy
texts, ``max_tokens``, stop strings and log probabilities are checked against
transformers (a greedy loop of full forward passes), with drafts accepted
(MAX's scheduler logs them) and every page back at the end.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from .pipeline_helpers import (
    Server,
    complete,
    running_server,
    settled_events,
)

# ------------------------------------------------------------------ unit


def _ctx(**overrides: Any) -> SimpleNamespace:
    """What :func:`can_speculate` and :meth:`ServeSpeculation.propose` read of a context."""
    params = SimpleNamespace(
        top_k=1,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        repetition_penalty=1.0,
        min_new_tokens=0,
        logits_processors=None,
    )
    tokens = SimpleNamespace(
        active_length=1, generated_length=3, current_position=10, all=np.arange(10)
    )
    ctx = SimpleNamespace(
        request_id="r", sampling_params=params, tokens=tokens, matcher=None, max_length=100
    )
    for name, value in overrides.items():
        target = params if hasattr(params, name) else tokens if hasattr(tokens, name) else ctx
        setattr(target, name, value)
    return ctx


@pytest.mark.unit
def test_speculative_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from maxkv.serving.pipelines.speculation import speculative_config

    monkeypatch.delenv("MAXKV_SPECULATIVE", raising=False)
    assert speculative_config() is None
    monkeypatch.setenv("MAXKV_SPECULATIVE", "ngram")
    config = speculative_config()
    assert config is not None and config.num_speculative_tokens == 4 and config.adaptive
    assert (config.row_cost, config.max_batch_tokens) == (0.1, 64)  # max serve's step costs
    monkeypatch.setenv("MAXKV_NUM_SPECULATIVE_TOKENS", "7")
    monkeypatch.setenv("MAXKV_PROMPT_LOOKUP_MIN", "1")
    monkeypatch.setenv("MAXKV_SPECULATIVE_ADAPTIVE", "0")
    config = speculative_config()
    assert config is not None
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.adaptive) == (
        7,
        1,
        False,
    )
    # MAX's --num-speculative-tokens wins where MAX passes it to the pipeline.
    from_max = SimpleNamespace(speculative=SimpleNamespace(num_speculative_tokens=2))
    assert speculative_config(from_max).num_speculative_tokens == 2  # type: ignore[union-attr]
    for name, value, message in [
        ("MAXKV_SPECULATIVE", "eagle", "prompt lookup: ngram"),
        ("MAXKV_NUM_SPECULATIVE_TOKENS", "-1", "MAXKV_NUM_SPECULATIVE_TOKENS='-1'"),
        ("MAXKV_NUM_SPECULATIVE_TOKENS", "0", "num_speculative_tokens"),
        ("MAXKV_PROMPT_LOOKUP_MAX", "0", "prompt_lookup_max"),
        ("MAXKV_SPECULATIVE_ADAPTIVE", "yes", "expected 0 or 1"),
        ("MAXKV_SPECULATIVE_ROW_COST", "cheap", "expected a number"),
        ("MAXKV_SPECULATIVE_ROW_COST", "1.5", "row_cost must be in [0, 1]"),
        ("MAXKV_SPECULATIVE_MAX_BATCH_TOKENS", "0", "max_batch_tokens"),
    ]:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            with pytest.raises(ValueError, match=re.escape(message)):
                speculative_config()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "speculates"),
    [
        ({}, True),
        ({"top_k": -1}, False),  # samples
        ({"frequency_penalty": 0.5}, False),
        ({"presence_penalty": -0.5}, False),
        ({"repetition_penalty": 1.1}, False),
        ({"min_new_tokens": 4}, False),  # EOS is still masked
        ({"min_new_tokens": 3}, True),
        ({"logits_processors": [print]}, False),
        ({"matcher": object()}, False),  # structured output
        ({"active_length": 5}, False),  # prefill
        ({"generated_length": 0}, False),
    ],
)
def test_which_requests_speculate(overrides: dict[str, Any], speculates: bool) -> None:
    from maxkv.serving.pipelines.speculation import can_speculate

    assert can_speculate(_ctx(**overrides)) is speculates


@pytest.mark.unit
def test_drafts_stay_within_max_tokens_and_the_cache() -> None:
    from maxkv.serving.pipelines.speculation import ServeSpeculation
    from maxkv.serving.speculative import SpeculativeConfig

    spec = ServeSpeculation(SpeculativeConfig(adaptive=False), vocab_size=10)
    repeating = np.array([5, 6, 7, 8, 9] * 4)  # "8 9" recurs: drafts 5 6 7 8
    ctx = _ctx(all=repeating, current_position=20, max_length=100)
    assert spec.propose([ctx], lambda c: 100) == [[5, 6, 7, 8]]
    ctx.max_length = 23  # 3 tokens left: 2 drafts and the model's token
    assert spec.propose([ctx], lambda c: 100) == [[5, 6]]
    ctx.max_length = 21
    assert spec.propose([ctx], lambda c: 100) == [[]]
    ctx.max_length = 100
    assert spec.propose([ctx], lambda c: 1) == [[5]]  # one cache position left
    assert spec.propose([_ctx(top_k=5, all=repeating)], lambda c: 100) == [[]]

    rows = np.zeros((5, 12), np.float32)
    rows[1, 6] = rows[2, 11] = rows[2, 9] = 1.0  # row 2: id 11 is past the vocabulary
    rows[2, 11] = 2.0
    # MAX sampled 5 (= draft 1); row 1 confirms 6; row 2's best id in the vocabulary is 9.
    assert spec.accept(ctx, [5, 6, 7, 8], 5, rows) == [6, 9]
    metrics = spec.take_metrics(emitted=3)
    assert (metrics.drafted, metrics.draft_tokens_accepted, metrics.output_tokens) == (4, 2, 3)
    assert metrics.num_verifications == 1 and metrics.accepted_per_position == [1, 1, 0, 0]
    assert spec.accept(ctx, [4, 6], 5, rows[:3]) == []  # the first draft fails


@pytest.mark.unit
def test_a_stop_string_is_completed_by_one_token() -> None:
    from maxkv.serving.pipelines.speculation import completes_stop_string

    text = {1: "ab", 2: "c", 3: "de", 4: "f"}

    def decode(ids: list[int]) -> str:
        return "".join(text[i] for i in ids)

    assert not completes_stop_string(decode, np.array([1]), ["cd"])
    assert not completes_stop_string(decode, np.array([1, 2]), ["cd"])
    assert completes_stop_string(decode, np.array([1, 2, 3]), ["cd"])
    assert not completes_stop_string(decode, np.array([1, 2, 3, 4]), ["cd"])  # done before
    assert completes_stop_string(decode, np.array([1, 2, 3, 4]), ["zz", "ef"])
    assert not completes_stop_string(decode, np.array([1, 2, 3]), [])


# ------------------------------------------------------------------ max serve

#: Prompts whose greedy continuations (tiny Llama, seed 7) repeat: drafts stand.
PROMPTS = ["aaaa bbbb aaaa bbbb", "0101010101", "hello world", "abcabcabcabc"]
NEW = 40


@pytest.fixture(scope="module")
def spec_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"MAXKV_SPECULATIVE": "ngram", "MAXKV_SPECULATIVE_ADAPTIVE": "0"}
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("spec_serve"), env) as server:
        yield server


def greedy_reference(directory: Path, prompt: str, steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens after ``prompt`` (EOS ignored: full forward passes,
    float64 log-softmax per step) and each step's log probabilities."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = tokenizer(prompt).input_ids
    out, log_probs = [], []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        lp = torch.log_softmax(logits, -1)
        token = int(lp.argmax())
        out.append(token)
        log_probs.append(lp.numpy())
        ids.append(token)
    return out, np.array(log_probs)


def decode(directory: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def drafts_logged(server: Server, start: int) -> tuple[int, int]:
    with server.log.open() as log:
        log.seek(start)
        found = re.findall(r"Draft Tokens: (\d+)/(\d+)", log.read())
    return sum(int(a) for a, _ in found), sum(int(g) for _, g in found)


@pytest.mark.serve
def test_max_serve_speculative_greedy_text_equals_transformers(spec_server: Server) -> None:
    """Four requests at once, EOS ignored, each stopping at its own ``max_tokens``
    (some inside a draft): the texts and token counts are transformers' greedy
    ones, drafts were accepted, and every page comes back."""
    log_start = spec_server.log.stat().st_size
    start = spec_server.events.stat().st_size if spec_server.events.exists() else 0
    limits = [NEW, NEW - 3, 17, NEW - 1]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(
            pool.map(
                lambda pl: complete(spec_server, pl[0], max_tokens=pl[1], ignore_eos=True),
                zip(PROMPTS, limits, strict=True),
            )
        )
    for prompt, limit, (status, body) in zip(PROMPTS, limits, answers, strict=True):
        assert status == 200, body
        ids, _ = greedy_reference(spec_server.model, prompt, limit)
        assert body["usage"]["completion_tokens"] == limit, prompt
        assert body["choices"][0]["text"] == decode(spec_server.model, ids), prompt
    accepted, drafted = drafts_logged(spec_server, log_start)
    assert drafted > 0 and accepted > 0, (accepted, drafted)
    logged = settled_events(spec_server, start)
    assert logged[-1]["event"] == "release" and logged[-1]["free"] == logged[-1]["total"]


@pytest.mark.serve
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_max_serve_speculative_ends_at_the_token_that_completes_a_stop_string(
    spec_server: Server, stream: bool
) -> None:
    """Stop strings completed inside a draft, by its last token and by the model's
    token: the request ends with the token that completes the stop string, never
    a token later (MAX's completions route returns the text with the stop string)."""
    ids, _ = greedy_reference(spec_server.model, PROMPTS[0], NEW)
    text = decode(spec_server.model, ids)
    for stop in ["$B$", "KB$B$(", "$K", text[-6:-3]]:
        n = next(n for n in range(1, NEW + 1) if stop in decode(spec_server.model, ids[:n]))
        body = {
            "model": str(spec_server.model),
            "prompt": PROMPTS[0],
            "max_tokens": NEW,
            "temperature": 0,
            "ignore_eos": True,
            "stop": [stop],
            "stream": stream,
        }
        request = urllib.request.Request(
            f"{spec_server.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            raw = response.read().decode()
        if stream:
            chunks = [
                json.loads(line[6:])
                for line in raw.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
            got = "".join(c["text"] or "" for ch in chunks for c in ch.get("choices", []))
            reasons = [c["finish_reason"] for ch in chunks for c in ch.get("choices", [])]
            reason = next(r for r in reversed(reasons) if r)
        else:
            choice = json.loads(raw)["choices"][0]
            got, reason = choice["text"], choice["finish_reason"]
            assert json.loads(raw)["usage"]["completion_tokens"] == n, stop
        assert got == decode(spec_server.model, ids[:n]), stop
        assert reason == "stop", stop


@pytest.mark.serve
def test_max_serve_speculative_logprobs_equal_transformers(spec_server: Server) -> None:
    """Log probabilities of every token, accepted drafts included."""
    steps = 16
    log_start = spec_server.log.stat().st_size
    status, body = complete(spec_server, PROMPTS[0], max_tokens=steps, logprobs=2, ignore_eos=True)
    assert status == 200, body
    _, expected = greedy_reference(spec_server.model, PROMPTS[0], steps)
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == steps
    for step in range(steps):
        top = np.sort(expected[step])[::-1][:2]
        assert logprobs["token_logprobs"][step] == pytest.approx(top[0], abs=1e-3)
        got = sorted(logprobs["top_logprobs"][step].values(), reverse=True)
        assert got == pytest.approx(list(top), abs=1e-3)
    assert drafts_logged(spec_server, log_start)[0] > 0  # accepted drafts among them


@pytest.mark.serve
def test_max_serve_speculative_leaves_sampled_requests_one_token_a_step(
    spec_server: Server,
) -> None:
    """A sampled request beside greedy ones: served, ``max_tokens`` tokens, and the
    same tokens for the same seed (it draws one token a step, as without drafts)."""
    answers = [
        complete(spec_server, PROMPTS[1], max_tokens=20, temperature=0.9, seed=11, ignore_eos=True)
        for _ in range(2)
    ]
    for status, body in answers:
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 20
    assert answers[0][1]["choices"][0]["text"] == answers[1][1]["choices"][0]["text"]
