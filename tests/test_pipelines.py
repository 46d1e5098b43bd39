"""maxkv inside MAX's pipelines: the KV-manager adapter, and real ``max generate``
and ``max serve`` processes on a tiny Llama directory (loopback only).

Outputs are compared with transformers' greedy ``generate`` on the same
directory; slot use inside the server is read from the adapter's event log
(``MAXKV_EVENT_LOG``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession

from maxkv import ContinuousBatchingKVCacheManager, KVCacheParams

from .conftest import requires_transformers

MAX_CLI = str(Path(sys.executable).parent / "max")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MAX_SERVE_DISABLE_TELEMETRY": "1"}
NEW_TOKENS = 12


# ------------------------------------------------------------------ the adapter


@dataclass
class FakeTokens:
    processed_length: int = 0
    active_length: int = 0


@dataclass
class FakeContext:
    """What the adapter reads of MAX's ``TextContext``."""

    request_id: str
    tokens: FakeTokens = field(default_factory=FakeTokens)


@pytest.fixture
def adapter(session: InferenceSession) -> Any:
    from maxkv.pipelines import MaxkvKVManager

    params = KVCacheParams(DType.float32, 1, 8)
    manager = ContinuousBatchingKVCacheManager(params, 2, 16, 1, [CPU()], session)
    return MaxkvKVManager(manager, params=None)


def test_adapter_maps_requests_to_slots(adapter: Any) -> None:
    from max.pipelines.kv_cache.paged_kv_cache import InsufficientBlocksError

    a, b, c = FakeContext("a"), FakeContext("b"), FakeContext("c")
    for ctx in (a, b, c):
        adapter.claim(ctx)  # claiming never fails for lack of room (MAX does not retry it)
        ctx.tokens.active_length = 5
    assert adapter.contains(a) and adapter.block_count().free == 2
    adapter.alloc(a)
    adapter.alloc(b)
    assert {adapter.slot_of(a), adapter.slot_of(b)} == {0, 1}
    with pytest.raises(InsufficientBlocksError, match="all 2 slots are in use"):
        adapter.alloc(c)  # MAX requeues c and retries later
    assert adapter.slot_of(c) is None and adapter.block_count().free == 0
    inputs = adapter.runtime_inputs([[a, b]])
    assert inputs[0][1].to_numpy().tolist() == [0, 0]  # cache lengths of the two slots

    a.tokens.processed_length, a.tokens.active_length = 5, 1
    adapter.step(a)
    assert adapter.manager.cache_lengths[adapter.slot_of(a)] == 5
    a.tokens.processed_length, a.tokens.active_length = 16, 1
    with pytest.raises(InsufficientBlocksError, match="needs 17 cache positions"):
        adapter.alloc(a)

    adapter.release(b)
    adapter.alloc(c)  # b's slot is free again
    assert adapter.slot_of(c) == 1 and not adapter.contains(b)
    adapter.release(a)
    adapter.release(c)
    assert adapter.block_count().free == 2 and adapter.manager.slots_remaining == 2

    with pytest.raises(ValueError, match="data parallelism"):
        adapter.claim(FakeContext("d"), replica_idx=1)
    adapter.claim(a)
    with pytest.raises(ValueError, match="already claimed"):
        adapter.claim(a)
    with pytest.raises(ValueError, match="not claimed"):
        adapter.release(b)
    assert adapter.get_prefix_cache_hit_counts(a)[0] is not None
    assert not adapter.pending_transfers_exist() and adapter.effective_max_seq_length == 16


def test_max_version_pin() -> None:
    from maxkv.pipelines import SUPPORTED_MAX, UnsupportedMaxVersionError, check_max_version

    assert check_max_version().startswith("26.7")
    assert check_max_version("26.7.3") == "26.7.3"
    for bad in ("26.8.0", "25.6.1", "27.0", "nightly"):
        with pytest.raises(UnsupportedMaxVersionError, match=SUPPORTED_MAX.replace(".", r"\.")):
            check_max_version(bad)


def test_cache_fit_check() -> None:
    from maxkv.pipelines.model import CacheDoesNotFitError, check_cache_fits

    check_cache_fits(100, 100, 4, 64)
    check_cache_fits(100, None, 4, 64)
    with pytest.raises(CacheDoesNotFitError, match=r"4 slots x 64 tokens .* lower --max-batch"):
        check_cache_fits(2**31, 2**30, 4, 64)


# ------------------------------------------------------------------ real processes


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    requires_transformers()
    from .pipeline_helpers import make_tiny_llama_dir

    directory = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_llama_dir(directory, seed=7)
    return directory


def transformers_completion(directory: Path, prompt: str, new_tokens: int) -> str:
    """Greedy completion text of ``prompt`` by transformers (stops at EOS)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(prompt).input_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=0,
        )
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def max_pipeline_args(directory: Path, *extra: str) -> list[str]:
    from maxkv.pipelines import CUSTOM_ARCHITECTURES

    return [
        "--custom-architectures",
        CUSTOM_ARCHITECTURES,
        "--model-path",
        str(directory),
        "--devices",
        "cpu",
        "--quantization-encoding",
        "float32",
        "--max-length",
        "64",
        *extra,
    ]


@pytest.mark.compile
def test_max_generate_matches_transformers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompt = "hello world"
    events = tmp_path / "events.jsonl"
    result = subprocess.run(
        [
            MAX_CLI,
            "generate",
            *max_pipeline_args(
                tiny_llama_dir, "--max-batch-size", "2", "--top-k", "1", "--prompt", prompt
            ),
            "--max-new-tokens",
            str(NEW_TOKENS),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **OFFLINE, "MAXKV_EVENT_LOG": str(events)},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    generated = result.stdout.split("Prompt size:")[0].strip("\n")
    assert generated == transformers_completion(tiny_llama_dir, prompt, NEW_TOKENS)
    assert "Output size: " in result.stdout
    logged = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["event"] for e in logged] == ["alloc", "release"]  # it ran on a maxkv slot
    assert logged[-1]["free"] == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def max_server(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``max serve`` on 127.0.0.1 with 4 maxkv slots; stopped in a ``finally``."""
    port = _free_port()
    events = tmp_path / "events.jsonl"
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [
            MAX_CLI,
            "serve",
            *max_pipeline_args(tiny_llama_dir, "--max-batch-size", "4"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **OFFLINE, "MAXKV_EVENT_LOG": str(events)},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "max serve did not come up in 900 s"
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(2)
        yield url, events
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
        log.close()


def complete(url: str, model: Path, prompt: str) -> tuple[int, dict[str, Any]]:
    """POST /v1/completions at temperature 0; (HTTP status, JSON body)."""
    body = {"model": str(model), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@pytest.mark.compile
def test_max_serve_concurrent_completions(
    max_server: tuple[str, Path], tiny_llama_dir: Path
) -> None:
    url, events = max_server
    prompts = ["hello world", "abc", "The quick brown fox", "maxkv"]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(url, tiny_llama_dir, p), prompts))
    for prompt, (status, body) in zip(prompts, answers, strict=True):
        assert status == 200, body
        expected = transformers_completion(tiny_llama_dir, prompt, NEW_TOKENS)
        assert body["choices"][0]["text"] == expected, prompt

    logged = [json.loads(line) for line in events.read_text().splitlines()]
    allocs = [e for e in logged if e["event"] == "alloc"]
    assert len(allocs) == 4 and sorted(e["slot"] for e in allocs) == [0, 1, 2, 3]
    # All four held a slot at once: every alloc precedes the first release.
    first_release = next(i for i, e in enumerate(logged) if e["event"] == "release")
    assert first_release == 4 and logged[3]["free"] == 0
    assert logged[-1]["event"] == "release" and logged[-1]["free"] == 4

    status, body = complete(url, tiny_llama_dir, "x" * 100)  # past --max-length 64
    assert status == 400 and "too long" in json.dumps(body)
    status, body = complete(url, tiny_llama_dir, "hello world")  # still serving
    assert status == 200
    assert body["choices"][0]["text"] == transformers_completion(
        tiny_llama_dir, "hello world", NEW_TOKENS
    )
    final = [json.loads(line) for line in events.read_text().splitlines()]
    assert final[-1]["free"] == 4
