"""maxkv's ``max serve`` in a cluster: the render routes, the fields routers add,
KV events from a running server, and vllm-router's ``kv_aware`` policy in front
of two replicas (a tiny random Llama with a chat template; pages of 16 tokens).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from .pipeline_helpers import Server, _free_port, make_tiny_llama_dir, read_events, running_server
from .test_router_fields import ROUTER_CHAT_DEFAULTS

pytestmark = pytest.mark.serve

PAGE = 16
#: Each tenant's system prompt: 8 pages of the byte-level tokenizer's tokens.
SYSTEM = {
    "a": "You answer for tenant A. " * 6,
    "b": "Tenant B's assistant replies tersely. " * 4,
}


@dataclass
class Replica:
    server: Server
    #: Its KV event endpoint and replay endpoint (bound on loopback).
    events: str
    replay: str


def post(url: str, body: Any, timeout: float = 300) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read()
            try:
                return response.status, json.loads(text)
            except ValueError:  # /reset_prefix_cache answers "Success"
                return response.status, text.decode()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("chat_llama")
    make_tiny_llama_dir(directory, seed=11, chat_template=True)
    return directory


@pytest.fixture(scope="module")
def replicas(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Two replicas publishing KV events on loopback."""
    with contextlib.ExitStack() as stack:
        started = []
        for name in ("r0", "r1"):
            events = f"tcp://127.0.0.1:{_free_port()}"
            replay = f"tcp://127.0.0.1:{_free_port()}"
            env = {
                "MAXKV_KV_EVENTS_ENDPOINT": events,
                "MAXKV_KV_EVENTS_REPLAY_ENDPOINT": replay,
                "MAXKV_HOST_TIER_GB": "0",
            }
            server = stack.enter_context(
                running_server(
                    chat_model,
                    tmp_path_factory.mktemp(name),
                    env,
                    flags=("--enable-prefix-caching",),
                )
            )
            started.append(Replica(server, events, replay))
        yield started


def chat_body(server: Server, tenant: str, question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(server.model),
        "messages": [
            {"role": "system", "content": SYSTEM[tenant]},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }


def test_render_routes_answer_the_tokens_the_server_runs(replicas: list[Replica]) -> None:
    server = replicas[0].server
    model = str(server.model)
    prompts = ["The quick brown fox jumps over the lazy dog. " * 2, "abc"]
    body = {"model": model, "prompt": prompts}
    status, rendered = post(f"{server.url}/v1/completions/render", body)
    assert status == 200 and len(rendered) == 2
    for prompt, entry in zip(prompts, rendered, strict=True):
        status, ran = post(
            f"{server.url}/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": 2, "return_token_ids": True},
        )
        assert status == 200
        assert entry["token_ids"] == ran["choices"][0]["prompt_token_ids"]
    # A chat, with the template's options: its own tokens, what the same body runs.
    for extra in ({}, {"continue_final_message": True}):
        body = chat_body(server, "a", "What is 2+2?", **extra)
        if extra:
            body["messages"].append({"role": "assistant", "content": "It is"})
        status, rendered = post(f"{server.url}/v1/chat/completions/render", body)
        assert status == 200
        status, ran = post(f"{server.url}/v1/chat/completions", {**body, "return_token_ids": True})
        assert status == 200, ran
        assert rendered["token_ids"] == ran["choices"][0]["prompt_token_ids"]
        if extra:  # the last message is continued: no end of turn, no new turn after it
            assert rendered["token_ids"][-5:] == ran["choices"][0]["prompt_token_ids"][-5:]
    # A body the server refuses is refused by its render the same way.
    for body in (
        {"model": model, "prompt": [3, 10**9]},
        {"model": model, "prompt": []},
        {"model": model, "prompt": "x", "skip_special_tokens": False},
    ):
        status, ran = post(f"{server.url}/v1/completions", {**body, "max_tokens": 2})
        status_render, rendered = post(f"{server.url}/v1/completions/render", body)
        assert status == status_render == 400, (ran, rendered)
        assert rendered["error"]["message"] == ran["error"]["message"]


def test_the_fields_routers_add_are_served_or_refused_by_name(replicas: list[Replica]) -> None:
    server = replicas[0].server
    status, plain = post(f"{server.url}/v1/chat/completions", chat_body(server, "b", "Hi"))
    assert status == 200
    body = chat_body(server, "b", "Hi", **ROUTER_CHAT_DEFAULTS)
    status, forwarded = post(f"{server.url}/v1/chat/completions", body)
    assert status == 200, forwarded
    assert forwarded["choices"][0]["message"] == plain["choices"][0]["message"]
    for name, value in (("no_stop_trim", True), ("return_hidden_states", True)):
        status, refused = post(f"{server.url}/v1/chat/completions", {**body, name: value})
        assert status == 400 and f"`{name}`" in refused["error"]["message"]
    status, refused = post(f"{server.url}/v1/chat/completions", {**body, "no_such_field": 1})
    assert status == 400 and "no_such_field" in refused["error"]["message"]


def collect(socket: zmq.Socket[bytes], until: float) -> list[tuple[int, Any]]:
    """``(seq, batch)`` of the messages ``socket`` gets until ``until`` (monotonic)."""
    got = []
    while time.monotonic() < until:
        if socket.poll(200):
            topic, seq, payload = socket.recv_multipart()
            assert topic == b""
            got.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    return got


def test_a_replica_announces_the_blocks_it_computed_and_replays_them(
    replicas: list[Replica],
) -> None:
    replica = replicas[1]
    server = replica.server
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(replica.events)
    try:
        time.sleep(1.0)  # the subscription reaches the server (ZMQ's slow joiner)
        body = chat_body(server, "a", "Name a colour.")
        status, rendered = post(f"{server.url}/v1/chat/completions/render", body)
        assert status == 200
        assert post(f"{server.url}/v1/chat/completions", body)[0] == 200
        batches = collect(sub, time.monotonic() + 3.0)
    finally:
        sub.close(linger=0)
    assert batches, "no KV event reached the subscriber"
    seqs = [seq for seq, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # numbered in order
    stored = [
        e for _, b in batches for e in b[1] if e["type"] == "BlockStored" and e["medium"] == "GPU"
    ]
    chain: list[int] = []
    for event in stored:  # the request's own chain, from its first block on
        if (
            event["parent_block_hash"] is None
            and event["token_ids"][:PAGE] == rendered["token_ids"][:PAGE]
        ):
            chain = list(event["token_ids"])
        elif chain:
            chain += event["token_ids"]
    full = len(rendered["token_ids"]) // PAGE * PAGE
    assert len(chain) >= full and chain[:full] == rendered["token_ids"][:full]
    assert all(e["block_size"] == PAGE for e in stored)

    # A subscriber that missed them asks the replay socket, from the first on.
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replica.replay)
    try:
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and dealer.poll(500):
            frames = dealer.recv_multipart()
            _, _, seq, payload = frames
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    finally:
        dealer.close(linger=0)
    assert replayed[: len(batches)] == batches


@contextlib.contextmanager
def vllm_router(replicas: list[Replica], log: Path) -> Iterator[str]:
    port = _free_port()
    command = [
        shutil.which("vllm-router") or "vllm-router",
        *("--host", "127.0.0.1", "--port", str(port)),
        "--worker-urls",
        *(r.server.url for r in replicas),
        *("--policy", "kv_aware"),
        *(a for r in replicas for a in ("--kv-event-source", f"{r.server.url}={r.events}")),
        *(a for r in replicas for a in ("--kv-event-replay-source", f"{r.server.url}={r.replay}")),
        *("--kv-event-block-size", str(PAGE), "--kv-event-model", "tiny"),
        *("--prometheus-port", str(_free_port()), "--log-level", "debug"),
    ]
    with log.open("w") as out:
        router = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                assert router.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "vllm-router did not come up"
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5):
                        break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    time.sleep(1)
            yield url
        finally:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(timeout=30)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()


def decisions(log: Path) -> list[tuple[str, int]]:
    """vllm-router's kv_aware decisions so far (its debug log): ``(worker URL,
    credited prefix tokens)`` per request."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())  # its colours
    decision = r'KV prefix decision .*?worker="([^"]+)".*?credited_prefix_tokens=(\d+)'
    found = re.findall(decision, text)
    return [(url, int(tokens)) for url, tokens in found]


def served_by(replicas: list[Replica], counts: list[int]) -> int:
    """The replica that started one more request than ``counts`` says."""
    now = [sum(e["event"] == "alloc" for e in read_events(r.server.events)) for r in replicas]
    (index,) = [i for i, (a, b) in enumerate(zip(counts, now, strict=True)) if b == a + 1]
    counts[:] = now
    return index


@pytest.mark.skipif(shutil.which("vllm-router") is None, reason="pip install vllm-router")
def test_vllm_router_sends_a_tenant_to_the_replica_holding_its_prefix(
    replicas: list[Replica], tmp_path: Path
) -> None:
    """kv_aware over maxkv's events: a tenant's second request goes where its first
    was served; once that replica's blocks are gone (a reset: ``AllBlocksCleared``)
    and the other replica holds the prefix, there."""
    counts = [sum(e["event"] == "alloc" for e in read_events(r.server.events)) for r in replicas]
    log = tmp_path / "router.log"
    with vllm_router(replicas, log) as url:

        def ask(question: str) -> tuple[int, dict[str, Any]]:
            status, answer = post(
                f"{url}/v1/chat/completions", chat_body(replicas[0].server, "a", question)
            )
            assert status == 200, answer
            time.sleep(1.0)  # its blocks' events reach the router
            return served_by(replicas, counts), answer

        first, _ = ask("What is the capital of France?")
        second, answer = ask("And of Italy?")
        assert second == first
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * PAGE
        # The router chose it for the prefix its events announced.
        assert decisions(log)[-1][0] == replicas[first].server.url
        assert decisions(log)[-1][1] >= 4 * PAGE, decisions(log)
        other = 1 - first
        # The other replica computes the tenant's prefix; the first forgets its own.
        body = chat_body(replicas[other].server, "a", "Hello?")
        assert post(f"{replicas[other].server.url}/v1/chat/completions", body)[0] == 200
        counts[other] += 1
        status, _ = post(f"{replicas[first].server.url}/reset_prefix_cache", {})
        assert status == 200
        time.sleep(2.0)
        third, _ = ask("And of Spain?")
        assert third == other, log.read_text()[-3000:]
        assert decisions(log)[-1][0] == replicas[other].server.url
        assert decisions(log)[-1][1] >= 4 * PAGE, decisions(log)


#: A Python with NVIDIA Dynamo's standalone indexer (docs/cluster.md says how to
#: install it; ``pip install ai-dynamo`` cannot resolve on every machine).
DYNAMO_PYTHON = os.environ.get("DYNAMO_PYTHON", "")


def dynamo_installed() -> bool:
    if not DYNAMO_PYTHON or not Path(DYNAMO_PYTHON).exists():
        return False
    found = subprocess.run(
        [DYNAMO_PYTHON, "-c", "import dynamo.indexer"], capture_output=True, timeout=120
    )
    return found.returncode == 0


@pytest.mark.skipif(not dynamo_installed(), reason="Dynamo's indexer: set DYNAMO_PYTHON")
def test_dynamos_indexer_finds_the_replica_holding_a_prefix(replicas: list[Replica]) -> None:
    """Dynamo's standalone indexer, an independent consumer of the events: after a
    tenant's request on one replica, it credits that replica (only) with the
    prompt's full blocks; after a reset, no one."""
    port = _free_port()
    workers = ",".join(f"{i + 1}={r.events}" for i, r in enumerate(replicas))
    indexer = subprocess.Popen(
        [
            *(DYNAMO_PYTHON, "-m", "dynamo.indexer", "--port", str(port)),
            *("--block-size", str(PAGE), "--model-name", "tiny", "--workers", workers),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        time.sleep(1.0)  # its subscriptions reach the replicas (ZMQ's slow joiner)
        holder = replicas[0].server
        body = chat_body(holder, "b", "What do you do?")
        status, rendered = post(f"{holder.url}/v1/chat/completions/render", body)
        assert status == 200
        assert post(f"{holder.url}/v1/chat/completions", body)[0] == 200
        query = {"token_ids": rendered["token_ids"], "model_name": "tiny"}
        full = len(rendered["token_ids"]) // PAGE * PAGE
        deadline = time.monotonic() + 10
        while True:
            status, answer = post(f"{url}/query", query)
            assert status == 200, answer
            found = answer["instances"]
            if found.get("1", {}).get("longest_matched") == full or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert found["1"]["longest_matched"] == found["1"]["gpu"] == full, answer
        assert "2" not in found, answer  # the other replica never computed it
        assert post(f"{holder.url}/reset_prefix_cache", {})[0] == 200
        deadline = time.monotonic() + 10
        while post(f"{url}/query", query)[1]["instances"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert post(f"{url}/query", query)[1]["instances"] == {}
    finally:
        os.killpg(indexer.pid, signal.SIGTERM)
        indexer.wait(timeout=30)
