"""A tiny Llama directory for MAX's pipelines, built offline.

``config.json`` + ``model.safetensors`` (transformers' own random
``LlamaForCausalLM``, saved by ``save_pretrained``) and a real ``tokenizers``
byte-level BPE tokenizer over printable ASCII, so every generated token
decodes to exact, comparable text.  Token 0 is ``</s>`` (EOS), 1 is ``<s>``.

Also the machinery of the tests that start real ``max serve`` processes on it
(:func:`running_server`, :func:`complete`, the adapter's event log).
"""

from __future__ import annotations

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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what ``tokenizers``' ByteLevel uses)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


#: A plain chat template (``chat_template=True``), so that ``/v1/chat/completions``
#: is served too.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def save_tiny_tokenizer(directory: Path, *, chat_template: bool = False) -> int:
    """Writes a byte-level tokenizer of printable ASCII (ids 0 ``</s>``, 1 ``<s>``,
    one token per character) to ``directory``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = _byte_to_unicode()
    vocab = {"</s>": 0, "<s>": 1}
    for byte in range(32, 127):  # printable ASCII, space included
        vocab[b2u[byte]] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", bos_token="<s>")
    if chat_template:  # max generate --prompt then applies it: off unless asked for
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return len(vocab)


def make_tiny_llama_dir(
    directory: Path, *, seed: int = 0, layers: int = 2, chat_template: bool = False
) -> dict[str, int]:
    """Writes the directory; returns its vocabulary size and EOS/BOS ids.

    Needs torch and transformers (the weights are transformers' own init).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab_size = save_tiny_tokenizer(directory, chat_template=chat_template)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).eval().save_pretrained(directory, safe_serialization=True)
    return {"vocab_size": vocab_size, "eos": 0, "bos": 1}


def make_tiny_family_dir(directory: Path, family: str, *, seed: int = 0) -> Path:
    """``family``'s small checkpoint (:mod:`tests.family_checkpoints`) with the tiny
    tokenizer: a directory ``max generate`` and transformers both load."""
    from .family_checkpoints import save_family_checkpoint

    vocab_size = save_tiny_tokenizer(directory)
    return save_family_checkpoint(
        directory,
        family,
        seed,
        vocab_size=vocab_size,
        eos_token_id=0,
        bos_token_id=1,
        pad_token_id=0,
    )


# ------------------------------------------------------------ real processes

MAX_CLI = str(Path(sys.executable).parent / "max")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MAX_SERVE_DISABLE_TELEMETRY": "1"}
NEW_TOKENS = 12


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
        *extra,
    ]


def read_events(path: Path, start: int = 0) -> list[dict[str, Any]]:
    """The adapter's event log (``MAXKV_EVENT_LOG``) from byte ``start`` on."""
    if not path.exists():
        return []
    with path.open() as log:
        log.seek(start)
        return [json.loads(line) for line in log.read().splitlines()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    events: Path
    log: Path
    model: Path


#: ``max serve`` flags of the tests' server: 4 sequences, pages of 16 tokens, chunks
#: of at most 32 prompt tokens per batch, decode steps mixed into prefill batches.
SERVER_FLAGS = (
    *("--max-batch-size", "4", "--max-length", "256", "--kv-cache-page-size", "16"),
    *("--max-batch-input-tokens", "32", "--enable-in-flight-batching"),
)


@contextmanager
def running_server(
    model: Path,
    directory: Path,
    extra_env: dict[str, str] | None = None,
    *,
    flags: tuple[str, ...] = SERVER_FLAGS,
) -> Iterator[Server]:
    """``max serve`` on maxkv (paged, prefix caching) on 127.0.0.1; stopped in a ``finally``.

    ``flags``: the server's flags (default :data:`SERVER_FLAGS`; later ones win)."""
    port = _free_port()
    events, log_path = directory / "events.jsonl", directory / "serve.log"
    log = log_path.open("w")
    env = {
        **os.environ,
        **OFFLINE,
        "MAXKV_EVENT_LOG": str(events),
        "MAX_SERVE_SCHEDULER_STATS_LOG_INTERVAL_S": "0",  # a log line per batch
        **(extra_env or {}),
    }
    server = subprocess.Popen(
        [
            MAX_CLI,
            "serve",
            *max_pipeline_args(model, *SERVER_FLAGS, *flags),
            *("--host", "127.0.0.1", "--port", str(port)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert server.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "max serve did not come up in 900 s"
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(2)
        yield Server(url, events, log_path, model)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
        log.close()


def complete(server: Server, prompt: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    """POST /v1/completions at temperature 0; (HTTP status, JSON body)."""
    body = {
        "model": str(server.model),
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        **extra,
    }
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def settled_events(server: Server, start: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The events since ``start`` once every sequence they started is released."""
    deadline = time.monotonic() + timeout
    while True:
        logged = read_events(server.events, start)
        kinds = [e["event"] for e in logged]
        if kinds.count("alloc") == kinds.count("release") or time.monotonic() > deadline:
            return logged
        time.sleep(0.5)
