"""``max serve`` on maxkv against ``max serve`` on MAX's own Llama pipeline, under load.

    python benchmarks/serve.py --json benchmarks/results/serve_avx512.json \\
        --plot benchmarks/results/serve_avx512.png

For each concurrency C (default 16 and 32) and each side, one server is
started (same model directory, same flags: ``--max-batch-size C --max-length
1024``, CPU, float32, loopback), warmed up with two unrelated requests, then
driven through every workload with C streamed chat requests in flight (or at
a Poisson rate, ``--rate``), then stopped (in a ``finally``).  The two sides
run one after the other, never at once.  Workloads:

- ``plain``: distinct short chat questions (~40 prompt tokens), 64 new tokens.
- ``system``: the same questions behind one shared system prompt of ~600
  tokens, 32 new tokens (every chat product has one).
- ``multiturn``: C conversations of 4 turns behind a ~150-token system prompt;
  each turn resends the history (the side's own earlier answers) and asks
  the next question, 48 new tokens.
- ``longdoc``: the questions behind one shared ~4,000-token system prompt (the
  opening of the GPL-3 text in ``/usr/share/common-licenses``), 64 new tokens:
  decode steps that read long contexts (needs ``--max-length`` of 4608 or more).
- ``rag``: RAG questions (``examples/data/rag_corpus.json``, gold answers in
  ``benchmarks/data/rag_answers.json``): a short system prompt, then 4 to 6
  retrieved passages of 196 to 237 tokens drawn from a pool of 10 (the
  question's own, each request in its own seeded order, with a passage more
  or fewer drawn at random), then the question; 32 new tokens (needs
  ``--max-length`` of 2048).  The passages are separated by CacheBlend's
  separator for the ``maxkv-blend`` side (``max serve`` on maxkv with
  ``MAXKV_BLEND=1``) and the separator is left out for the other sides, so
  every side's model reads the same text.  Reported besides the usual:
  answer F1 against the gold answers, and how many first streamed pieces
  equal those of ``maxkv`` (the same server prefilling every token).

The ``maxkv-int8`` side is ``max serve`` on maxkv with
``MAXKV_ACTIVATIONS=int8`` (a GGUF's integer blocks multiplied by int8
activations); it is compared with every other side, ``maxkv`` (float32
activations) included: how many of its greedy texts equal float32's.

Greedy (temperature 0) everywhere.  Per side and workload: output tokens/s
(all output tokens / wall time of the workload), the server's peak resident
memory so far (``VmHWM`` summed over its processes), time to first token and
inter-token latency (gaps between streamed chunks) at p50/p90/p99, the
prefix-cache hit rate that the server logged for the workload's requests
(MAX's scheduler logs ``Cache hit rate`` per batch for both sides; the
servers log every batch here), the preemptions it logged, where the time
went (prefill and decode batches, and the rest, from the same log lines),
and how many texts agree between the sides.  Prints tables; ``--json`` and
``--plot`` save the numbers and a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SIDES = ("maxkv", "max", "vllm", "maxkv-blend", "llamacpp", "maxkv-int8")
WORKLOADS = ("plain", "system", "multiturn", "longdoc", "rag")
SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "MAX_SERVE_DISABLE_TELEMETRY": "1",
    # Log every batch (default: one line per 3 s), so the log's cache hits add up.
    "MAX_SERVE_SCHEDULER_STATS_LOG_INTERVAL_S": "0",
}

# ------------------------------------------------------------------ prompts

_FACTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is the chemical symbol for gold?",
    "What is the largest ocean on Earth?",
    "Give me three tips for staying healthy.",
    "What is photosynthesis? Answer in one sentence.",
    "Why is exercise good for you?",
    "How do airplanes stay in the air?",
    "What causes the seasons on Earth?",
    "Explain what a computer program is.",
    "Why do leaves change color in autumn?",
    "What is the difference between weather and climate?",
    "How does a rainbow form?",
    "What are the benefits of reading books?",
    "Describe the water cycle briefly.",
    "Why is the ocean salty?",
    "How do bees make honey?",
    "What is the speed of light?",
    "Name two famous painters.",
    "What does a thermometer measure?",
    "How many planets are in the solar system?",
    "What is a volcano?",
    "Why do we need to drink water?",
    "What is the tallest mountain in the world?",
    "How do plants grow from seeds?",
    "What is electricity?",
    "Give an example of a renewable energy source.",
    "What is the main language spoken in Brazil?",
    "Why is the sky dark at night?",
    "What is an atom?",
    "What is gravity?",
    "How does a compass work?",
]
_ANIMALS = [
    "elephants", "octopuses", "penguins", "owls", "dolphins", "bees", "camels", "foxes",
    "tigers", "frogs", "whales", "ants", "parrots", "wolves", "turtles", "bats",
]  # fmt: skip
_CITIES = [
    "Paris", "Tokyo", "Cairo", "Sydney", "Rome", "Lima", "Oslo", "Nairobi",
    "Toronto", "Mumbai", "Istanbul", "Vienna", "Seoul", "Lisbon", "Havana", "Prague",
]  # fmt: skip
_CONCEPTS = [
    "inflation", "evolution", "democracy", "recycling", "vaccines", "the internet",
    "black holes", "compound interest", "the immune system", "earthquakes", "tides",
    "magnetism", "friction", "nutrition", "sleep", "machine learning",
]  # fmt: skip
_THINGS = [
    "bakery", "pet goldfish", "robot", "sailing boat", "coffee shop", "garden",
    "mountain cabin", "bicycle shop", "book club", "music band", "travel blog",
    "board game", "hiking trail", "space probe", "lighthouse", "puppy",
]  # fmt: skip

#: 96 distinct user questions.
QUESTIONS = (
    _FACTS
    + [f"Give me one fun fact about {a}." for a in _ANIMALS]
    + [f"What is {c} known for?" for c in _CITIES]
    + [f"Explain {c} in simple words." for c in _CONCEPTS]
    + [f"Suggest a good name for a {t}." for t in _THINGS]
)

#: A shared system prompt of about 600 tokens (SmolLM2's tokenizer).
SYSTEM_PROMPT = """You are Aria, the virtual assistant of Northwind Outfitters, a company that \
sells outdoor clothing, camping equipment and travel gear through its online store and forty \
retail shops. Your job is to answer questions from customers and from the general public in a \
friendly, accurate and concise way.

General rules. Always be polite and patient, even when the customer is upset. Use plain language \
and avoid jargon; when a technical term is needed, explain it in a few words. Keep answers short: \
two to five sentences are usually enough, unless the customer asks for details or a step by step \
guide. Never invent facts. If you do not know something, say so and suggest where the customer \
could find the answer. Do not give medical, legal or financial advice beyond general, well known \
facts; recommend a qualified professional instead. Never ask for passwords, full card numbers or \
other sensitive data.

Orders and delivery. Standard delivery takes three to five working days within the country and \
costs 4.95, free for orders above 50. Express delivery takes one working day and costs 9.95. \
International delivery is available to thirty countries and takes seven to fourteen days. \
Customers can track an order from the link in their confirmation email. If a parcel is late by \
more than five working days, offer to open an investigation with the carrier.

Returns and refunds. Unused items can be returned within 60 days with the receipt. Refunds are \
made to the original payment method within ten days of receiving the return. Items that were \
used can be returned only if they are faulty. Sale items can be exchanged but not refunded, \
unless they are faulty. Gift cards cannot be refunded.

Warranty. Tents, backpacks and sleeping bags have a two year warranty against manufacturing \
faults. Footwear has a one year warranty. The warranty does not cover normal wear, misuse or \
damage from accidents. For a warranty claim the customer needs the receipt and photos of the \
fault.

Membership. The Trail Club membership is free. Members collect one point per unit spent, get \
early access to sales, and a birthday discount of ten percent. Points expire after two years \
without a purchase.

Product advice. When customers ask which product to choose, ask about the season, the \
temperatures they expect, how long the trip is and how much weight they want to carry. \
Recommend layering for cold weather: a base layer, an insulating layer and a waterproof shell. \
Remind customers to test new boots on short walks before a long hike.

Safety. If someone describes an emergency in the outdoors, tell them to contact the local \
emergency services first. Encourage people to check the weather forecast, to tell someone their \
route, and to carry water, a map, a light and a first aid kit.

Other questions. Customers may also ask general knowledge questions that have nothing to do \
with the store. Answer those helpfully and briefly, in the same friendly tone, without \
mentioning the store unless it is relevant."""

#: A system prompt of about 150 tokens for the multi-turn conversations.
SHORT_SYSTEM_PROMPT = """You are a patient tutor who helps curious people learn about the \
world. Explain things clearly and simply, as you would to a bright high school student. Prefer \
short paragraphs and concrete examples over long lists. When the question is ambiguous, answer \
the most likely meaning and say which one you chose. If you are not sure about a fact, say so \
instead of guessing. Keep a warm and encouraging tone, and never make the learner feel bad for \
asking. When asked to summarize, give the key idea in one sentence. When asked for an example, \
choose one from everyday life. Use metric units unless the learner asks for others, and \
define any new word the first time you use it."""

FOLLOW_UPS = [
    "Can you explain that in more detail?",
    "Give me an example from everyday life.",
    "Summarize your answer in one sentence.",
]


@dataclass
class Request:
    """One chat request of a workload and what came back."""

    key: str
    messages: list[dict[str, str]]
    max_tokens: int
    text: str = ""
    first_piece: str = ""
    output_tokens: int = 0
    #: The server's usage: prompt tokens, and those it found in its prefix cache.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None


# ------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def max_cli() -> str:
    found = shutil.which("max") or str(Path(sys.executable).with_name("max"))
    if not Path(found).exists():
        raise SystemExit("error: the `max` command is not installed (pip install '.[serve]')")
    return found


@contextmanager
def server(
    side: str, model_dir: Path, concurrency: int, args: argparse.Namespace, log_path: Path
) -> Iterator[str]:
    """``max serve`` for ``side`` (or ``vllm serve`` for ``vllm``, llama.cpp's
    ``llama-server`` for ``llamacpp``) on a free loopback port; stopped in a
    ``finally``.  With ``--gguf``, the maxkv sides read that file's weights
    (``--weight-path``) and llama.cpp serves it."""
    port = free_port()
    gguf = getattr(args, "gguf", None)
    weight_path = ["--weight-path", str(gguf)] if gguf else []
    command = [
        max_cli(),
        "serve",
        "--model-path",
        str(model_dir),
        *weight_path,
        "--devices",
        "cpu",
        "--quantization-encoding",
        getattr(args, "max_encoding", "float32") if side == "max" else "float32",
        "--max-batch-size",
        str(concurrency),
        "--max-length",
        str(args.max_length),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args.server_args,
    ]
    env = {**os.environ, **SERVER_ENV}
    if side == "vllm":  # ../shared/notes/peer-servers-on-cpu.md: its CPU backend, float32
        command = [
            args.vllm,
            "serve",
            str(model_dir),
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            str(args.max_length),
            "--max-num-seqs",
            str(concurrency),
            "--served-model-name",
            str(model_dir),
            *getattr(args, "vllm_args", []),
        ]
        env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_TARGET_DEVICE="cpu", VLLM_NO_USAGE_STATS="1")
        env.update(getattr(args, "vllm_env", {}))
    if side == "llamacpp":  # ../shared/notes/peer-servers-on-cpu.md
        if not gguf:
            raise SystemExit("error: the llamacpp side serves a GGUF file: give --gguf")
        command = [
            args.llama_server,
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            str(concurrency * args.max_length),  # -np slots of --max-length each
            "-np",
            str(concurrency),
            "--cont-batching",
            "-t",
            str(os.cpu_count() or 1),
            "--alias",
            str(model_dir),
            *(["--jinja"] if getattr(args, "api", "chat") == "chat" else []),
        ]
    if side.startswith("maxkv"):
        from maxkv.pipelines import CUSTOM_ARCHITECTURES

        command[2:2] = ["--custom-architectures", CUSTOM_ARCHITECTURES]
        env.update(dict(kv.split("=", 1) for kv in args.maxkv_env))
        if side == "maxkv-blend":
            env["MAXKV_BLEND"] = "1"
        if side == "maxkv-int8":
            env["MAXKV_ACTIVATIONS"] = "int8"
    log = log_path.open("w")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.server_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{side} server exited:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{side} server not ready in {args.server_timeout} s")
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(2)
        SERVER_SESSIONS[url] = process.pid
        yield url
    finally:
        SERVER_SESSIONS.pop(url, None)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        log.close()


#: Server URL -> the session id of its processes (:func:`server` starts each in its own).
SERVER_SESSIONS: dict[str, int] = {}


def peak_rss_mib(url: str) -> float | None:
    """The peak resident memory of a running :func:`server`: the sum of ``VmHWM``
    over its session's processes (server and workers; each one's own peak, so an
    upper bound where they peak at different times), or None off Linux."""
    session = SERVER_SESSIONS.get(url)
    if session is None or not Path("/proc/self/status").exists():
        return None
    total_kib = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != session:  # the session id, after state, ppid, pgrp
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total_kib += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
    return total_kib / 1024


# ------------------------------------------------------------------ client


def plain_prompt(messages: list[dict[str, str]]) -> str:
    """The text a base model (no chat template) reads for ``messages`` (``--api
    completions``): the turns one after the other, then the answer's cue."""
    parts = [m["content"] if m["role"] == "system" else f"{m['role'].title()}: {m['content']}"
             for m in messages]  # fmt: skip
    return "\n\n".join([*parts, "Assistant:"])


async def stream_chat(
    client: Any, url: str, model: str, request: Request, api: str = "chat"
) -> None:
    """One streamed chat completion (or, with ``api="completions"``, a completion of
    :func:`plain_prompt`); fills in ``request``'s text, tokens and timings."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api == "chat":
        body["messages"] = request.messages
    else:
        body["prompt"] = plain_prompt(request.messages)
    route = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    request.sent = time.perf_counter()
    pieces: list[str] = []
    try:
        async with client.stream("POST", f"{url}{route}", json=body) as response:
            if response.status_code != 200:
                request.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    request.output_tokens = int(usage["completion_tokens"])
                    request.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    request.cached_tokens = int(details.get("cached_tokens") or 0)
                for choice in chunk.get("choices", []):
                    content = (choice.get("delta") or {}).get("content") or choice.get("text")
                    if content:
                        request.chunk_times.append(time.perf_counter())
                        pieces.append(content)
    except Exception as error:  # a failed request is reported, not fatal
        request.error = f"{type(error).__name__}: {error}"
    request.text = "".join(pieces)
    request.first_piece = pieces[0] if pieces else ""
    if not request.output_tokens:
        request.output_tokens = len(request.chunk_times)


#: ``longdoc``'s shared document: about 4,000 tokens of SmolLM2's tokenizer.
LONG_DOCUMENT_PATH = Path("/usr/share/common-licenses/GPL-3")
LONG_DOCUMENT_CHARS = 18_700
#: Its prompt, the chat template, a question and 64 new tokens fit in this.
LONGDOC_MAX_LENGTH = 4608


def long_system_prompt() -> str:
    """``longdoc``'s system prompt: a document the questions come after."""
    if not LONG_DOCUMENT_PATH.is_file():
        raise SystemExit(f"the longdoc workload reads {LONG_DOCUMENT_PATH} (Debian's base-files)")
    text = LONG_DOCUMENT_PATH.read_text()[:LONG_DOCUMENT_CHARS]
    return "You answer questions. Here is a document for reference.\n\n" + text


#: What the ``rag`` workload reads.
RAG_CORPUS = Path(__file__).resolve().parent.parent / "examples" / "data" / "rag_corpus.json"
RAG_ANSWERS = Path(__file__).resolve().parent / "data" / "rag_answers.json"
RAG_SYSTEM_PROMPT = "You answer questions about Brinsey Island from the passages the user gives."
#: CacheBlend's separator (maxkv's default, LMCache's ``blend_special_str``).
BLEND_SEPARATOR = " # # "
RAG_MAX_LENGTH = 2048


def rag_requests(count: int, blend: bool) -> list[list[Request]]:
    """``count`` RAG requests; with ``blend``, passages separated by :data:`BLEND_SEPARATOR`."""
    corpus = json.loads(RAG_CORPUS.read_text())
    pool = sorted(corpus["chunks"])
    questions = corpus["questions"]
    separator = BLEND_SEPARATOR if blend else ""
    requests = []
    for i in range(count):
        q = questions[i % len(questions)]
        rng = random.Random(i)
        names = list(q["chunks"])
        extra = rng.random()
        if extra < 0.3 and len(names) < 6:
            names.append(rng.choice([n for n in pool if n not in names]))
        elif extra > 0.7 and len(names) > 4:
            names.remove(rng.choice([n for n in names if n != q["chunks"][-1]] or names))
        rng.shuffle(names)
        pieces = ["Passages:\n\n", *(corpus["chunks"][n] + "\n\n" for n in names)]
        content = separator.join(pieces) + separator + f"Question: {q['question']}"
        messages = [
            {"role": "system", "content": RAG_SYSTEM_PROMPT},
            {"role": "user", "content": content},
        ]
        requests.append([Request(f"rag/{i}", messages, 32)])
    return requests


def rag_quality(requests: list[Request]) -> dict[str, Any]:
    """Mean answer F1 (lower-cased words) against the gold answers, and mean recall
    (the share of the gold answer's words the answer holds: F1 is low for any
    sentence-long answer to a one-word gold answer)."""
    gold = json.loads(RAG_ANSWERS.read_text())["answers"]
    f1, recall = [], []
    for request in requests:
        question = request.messages[-1]["content"].rsplit("Question: ", 1)[1]
        f1.append(word_f1(request.text, gold[question]))
        recall.append(word_recall(request.text, gold[question]))
    return {
        "answer_f1": float(np.mean(f1)) if f1 else None,
        "answer_recall": float(np.mean(recall)) if recall else None,
    }


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def word_recall(text: str, gold: str) -> float:
    """The share of ``gold``'s words (with repeats) that ``text`` holds."""
    from collections import Counter

    a, b = words(text), words(gold)
    return sum((Counter(a) & Counter(b)).values()) / len(b) if b else 1.0


def word_f1(text: str, gold: str) -> float:
    """SQuAD's token F1 of lower-cased words (punctuation dropped)."""
    from collections import Counter

    a, b = words(text), words(gold)
    common = sum((Counter(a) & Counter(b)).values())
    if not common:
        return 0.0
    precision, recall = common / len(a), common / len(b)
    return 2 * precision * recall / (precision + recall)


def workload_requests(
    workload: str, concurrency: int, count: int, side: str = ""
) -> list[list[Request]]:
    """The requests of a workload, as one list per client stream of dependent turns.

    ``plain`` and ``system``: ``count`` independent requests (one-element
    lists).  ``multiturn``: ``concurrency`` conversations; turn *k* is built
    from turn *k - 1*'s answer when it is sent.
    """
    if workload == "rag":
        return rag_requests(count, blend=side == "maxkv-blend")
    if workload == "multiturn":
        return [
            [
                Request(
                    f"multiturn/c{c}/t{t}",
                    [{"role": "system", "content": SHORT_SYSTEM_PROMPT}],
                    48,
                )
                for t in range(1 + len(FOLLOW_UPS))
            ]
            for c in range(concurrency)
        ]
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    if workload == "plain":
        return [[Request(f"plain/{i}", [{"role": "user", "content": q}], 64)] for i, q in
                enumerate(questions)]  # fmt: skip
    system, new_tokens = SYSTEM_PROMPT, 32
    if workload == "longdoc":
        system, new_tokens = long_system_prompt(), 64
    return [
        [
            Request(
                f"{workload}/{i}",
                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                new_tokens,
            )
        ]
        for i, q in enumerate(questions)
    ]


async def run_workload(
    url: str,
    model: str,
    workload: str,
    concurrency: int,
    args: argparse.Namespace,
    side: str = "",
) -> tuple[list[Request], float]:
    """Sends the workload; returns its requests and its wall time (first send to last byte)."""
    import httpx

    count = args.requests or 3 * concurrency
    streams = workload_requests(workload, concurrency, count, side)
    done: list[Request] = []
    timeout = httpx.Timeout(args.request_timeout)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def run_stream(stream: list[Request], first: int) -> None:
            for turn, request in enumerate(stream):
                if workload == "multiturn":
                    previous = stream[turn - 1] if turn else None
                    question = QUESTIONS[first] if turn == 0 else FOLLOW_UPS[turn - 1]
                    history = previous.messages[1:] if previous else []
                    if previous is not None:
                        history = [*history, {"role": "assistant", "content": previous.text}]
                    request.messages = [
                        request.messages[0],
                        *history,
                        {"role": "user", "content": question},
                    ]
                await stream_chat(client, url, model, request, args.api)
                done.append(request)

        start = time.perf_counter()
        if args.rate:  # open loop: Poisson arrivals of whole streams
            rng = random.Random(0)
            tasks = []
            for i, stream in enumerate(streams):
                tasks.append(asyncio.create_task(run_stream(stream, i)))
                await asyncio.sleep(rng.expovariate(args.rate))
            await asyncio.gather(*tasks)
        else:  # closed loop: `concurrency` streams in flight
            queue: asyncio.Queue[tuple[int, list[Request]]] = asyncio.Queue()
            for item in enumerate(streams):
                queue.put_nowait(item)

            async def worker() -> None:
                while not queue.empty():
                    i, stream = queue.get_nowait()
                    await run_stream(stream, i)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return done, elapsed


# ------------------------------------------------------------------ numbers

_HIT = re.compile(r"Cache hit rate: [\d.]+% \((\d+) hit, (\d+) miss\)")
_PREEMPT = re.compile(r"All Preemptions: (\d+) reqs")
_BATCH = re.compile(
    r"Executed (CE|TG) batch with (\d+) reqs .*?Input Tokens: (\d+)/.*?"
    r"Execution: ([\d.]+)(us|ms|s)\b"
)
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def log_counters(text: str) -> dict[str, Any]:
    """From a stretch of server log (a line per batch): prefix-cache hit and miss
    tokens, preemptions, and per batch kind (CE: prefill, TG: decode) the batches,
    their input tokens and their execution time."""
    hits = misses = 0
    for match in _HIT.finditer(text):
        hits += int(match.group(1))
        misses += int(match.group(2))
    preemptions = [int(m.group(1)) for m in _PREEMPT.finditer(text)]
    batches = {kind: {"batches": 0, "tokens": 0, "seconds": 0.0} for kind in ("CE", "TG")}
    for match in _BATCH.finditer(text):
        entry = batches[match.group(1)]
        entry["batches"] += 1
        entry["tokens"] += int(match.group(3))
        entry["seconds"] += float(match.group(4)) * _UNIT[match.group(5)]
    return {
        "hit_tokens": hits,
        "miss_tokens": misses,
        "preemptions_logged": max(preemptions or [0]),
        "batches": batches,
    }


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
    }


def request_stats(requests: list[Request], elapsed: float) -> dict[str, Any]:
    """What the clients saw: failures, output tokens and tokens/s, time to first
    chunk and gaps between chunks (p50/p90/p99)."""
    ok = [r for r in requests if r.error is None]
    ttft = [r.chunk_times[0] - r.sent for r in ok if r.chunk_times]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(requests),
        "failed": len(requests) - len(ok),
        "errors": sorted({r.error for r in requests if r.error})[:5],
        "output_tokens": tokens,
        "duration_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
    }


def summarize(requests: list[Request], elapsed: float, counters: dict[str, Any]) -> dict[str, Any]:
    seen = counters["hit_tokens"] + counters["miss_tokens"]
    return {
        **request_stats(requests, elapsed),
        "prefix_cache": {
            "hit_tokens": counters["hit_tokens"],
            "miss_tokens": counters["miss_tokens"],
            "hit_rate": counters["hit_tokens"] / seen if seen else 0.0,
        },
        "preemptions_logged": counters["preemptions_logged"],
        "profile": profile(counters["batches"], elapsed),
        "texts": {r.key: r.text for r in requests},
        "first_pieces": {r.key: r.first_piece for r in requests},
    }


def profile(batches: dict[str, dict[str, Any]], elapsed: float) -> dict[str, float]:
    """Where the workload's wall time went, from the server's per-batch log: prefill
    (CE) and decode (TG) batch execution (model, sampling, context updates), and the
    rest (scheduling, tokenizing, streaming, idle)."""
    ce, tg = batches["CE"], batches["TG"]
    return {
        "prefill_batches": ce["batches"],
        "prefill_tokens": ce["tokens"],
        "prefill_s": ce["seconds"],
        "prefill_ms_per_token": 1000 * ce["seconds"] / ce["tokens"] if ce["tokens"] else 0.0,
        "decode_batches": tg["batches"],
        "decode_s": tg["seconds"],
        "decode_ms_per_batch": 1000 * tg["seconds"] / tg["batches"] if tg["batches"] else 0.0,
        "decode_rows_per_batch": tg["tokens"] / tg["batches"] if tg["batches"] else 0.0,
        "other_s": max(0.0, elapsed - ce["seconds"] - tg["seconds"]),
    }


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """maxkv / each other side (MAX, vLLM, llama.cpp) per workload and concurrency;
    for ``rag``, ``maxkv-blend`` / each other side (``maxkv`` included) where it
    ran; ``maxkv-int8`` / each other side (``maxkv`` included)."""
    rows = []
    by_key = {(r["side"], r["workload"], r["concurrency"]): r for r in runs}
    for (side, workload, concurrency, peer), ours in sorted(
        ((*key, peer), run) for key, run in by_key.items() for peer in SIDES
    ):
        theirs = by_key.get((peer, workload, concurrency))
        blend_ran = ("maxkv-blend", workload, concurrency) in by_key
        base = "maxkv-blend" if workload == "rag" and blend_ran else "maxkv"
        if side == "maxkv-int8":
            base = side
        elif peer == "maxkv-int8":
            continue  # compared the other way round
        if side != base or peer == base or theirs is None:
            continue
        same = sum(
            1 for k, text in ours["texts"].items() if theirs["texts"].get(k) == text and text
        )
        first = sum(
            1
            for k, piece in ours.get("first_pieces", {}).items()
            if piece and theirs.get("first_pieces", {}).get(k) == piece
        )

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        rows.append(
            {
                "workload": workload,
                "concurrency": concurrency,
                "side": side,
                "against": peer,
                "throughput_ratio": ratio(ours["tokens_per_s"], theirs["tokens_per_s"]),
                "ttft_p50_ratio": ratio(ours["ttft_s"]["p50"], theirs["ttft_s"]["p50"]),
                "itl_p90_ratio": ratio(ours["itl_s"]["p90"], theirs["itl_s"]["p90"]),
                "same_texts": same,
                "same_first_pieces": first,
                "answer_f1_ratio": ratio(ours.get("answer_f1"), theirs.get("answer_f1")),
                "answer_recall_ratio": ratio(
                    ours.get("answer_recall"), theirs.get("answer_recall")
                ),
                "requests": len(ours["texts"]),
            }
        )
    return rows


def arith_rows(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The maxkv sides' runs as rows of ``arith_<isa>.json``, llama.cpp's beside them."""
    by_key = {(r["side"], r["workload"], r["concurrency"]): r for r in runs}
    env = dict(kv.split("=", 1) for kv in args.maxkv_env)
    model = Path(args.gguf).name if args.gguf else Path(runs[0]["model"]).name if runs else ""
    rows = []
    for run in runs:
        if run["side"] not in ("maxkv", "maxkv-int8"):
            continue
        mode = "int8" if run["side"] == "maxkv-int8" else env.get("MAXKV_ACTIVATIONS", "float32")
        peer = by_key.get(("llamacpp", run["workload"], run["concurrency"]))
        row: dict[str, Any] = {
            "model": model,
            "mode": mode,
            "concurrency": run["concurrency"],
            "workload": f"{run['workload']} ({getattr(args, 'api', 'chat')})",
            "maxkv_tok_s": round(run["tokens_per_s"], 2),
            "llamacpp_tok_s": round(peer["tokens_per_s"], 2) if peer else None,
            "maxkv_ttft_p50_s": run["ttft_s"]["p50"],
            "maxkv_itl_p90_s": run["itl_s"]["p90"],
            "maxkv_peak_rss_mib": run["peak_rss_mib"],
        }
        if peer:
            row |= {
                "llamacpp_ttft_p50_s": peer["ttft_s"]["p50"],
                "llamacpp_itl_p90_s": peer["itl_s"]["p90"],
                "llamacpp_peak_rss_mib": peer["peak_rss_mib"],
            }
        rows.append(row)
    return rows


def print_table(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    print(
        f"{'workload':<10} {'C':>3} {'side':<11} {'tok/s':>7} {'TTFT p50/p90/p99 ms':>22} "
        f"{'ITL p50/p90/p99 ms':>20} {'hit rate':>8} {'preempt':>7} {'failed':>6}"
    )
    for r in runs:
        t, i = r["ttft_s"], r["itl_s"]
        print(
            f"{r['workload']:<10} {r['concurrency']:>3} {r['side']:<11} {r['tokens_per_s']:>7.1f} "
            f"{ms(t['p50']):>8}/{ms(t['p90']):>6}/{ms(t['p99']):>6} "
            f"{ms(i['p50']):>7}/{ms(i['p90']):>5}/{ms(i['p99']):>6} "
            f"{r['prefix_cache']['hit_rate']:>8.1%} {r['preemptions_logged']:>7} {r['failed']:>6}"
        )
    print()
    print(
        f"{'workload':<10} {'C':>3} {'side':<11} {'prefill s':>9} {'tokens':>7} {'ms/tok':>6} "
        f"{'decode s':>8} {'steps':>6} {'ms/step':>7} {'rows':>5} {'other s':>7}"
    )
    for r in runs:
        p = r["profile"]
        print(
            f"{r['workload']:<10} {r['concurrency']:>3} {r['side']:<11} {p['prefill_s']:>9.2f} "
            f"{p['prefill_tokens']:>7} {p['prefill_ms_per_token']:>6.2f} {p['decode_s']:>8.2f} "
            f"{p['decode_batches']:>6} {p['decode_ms_per_batch']:>7.1f} "
            f"{p['decode_rows_per_batch']:>5.1f} {p['other_s']:>7.2f}"
        )
    print()
    for row in rows:

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}x"

        ours = row["side"]
        quality = ""
        if row.get("answer_f1_ratio") is not None:
            quality = (
                f"; same first pieces {row['same_first_pieces']}/{row['requests']}, answer F1 "
                f"{f(row['answer_f1_ratio'])}, recall {f(row['answer_recall_ratio'])}"
            )
        print(
            f"{row['workload']:<10} C={row['concurrency']:<3} {ours}/{row['against']}: throughput "
            f"{f(row['throughput_ratio'])}, TTFT p50 {f(row['ttft_p50_ratio'])}, ITL p90 "
            f"{f(row['itl_p90_ratio'])}; same texts {row['same_texts']}/{row['requests']}" + quality
        )


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted(
        {(r["workload"], r["concurrency"]) for r in runs},
        key=lambda g: (g[1], WORKLOADS.index(g[0])),
    )
    labels = [f"{w}\nC={c}" for w, c in groups]
    metrics = [
        ("tokens_per_s", None, "output tokens/s (higher is better)"),
        ("ttft_s", "p50", "TTFT p50, s (lower is better)"),
        ("itl_s", "p90", "inter-token latency p90, s (lower is better)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    x = np.arange(len(groups))
    ran = [side for side in SIDES if any(r["side"] == side for r in runs)]
    width = 0.84 / max(1, len(ran))
    for ax, (name, pct, title) in zip(axes, metrics, strict=True):
        for k, side in enumerate(ran):
            values = []
            for g in groups:
                run = next(
                    (
                        r
                        for r in runs
                        if (r["workload"], r["concurrency"]) == g and r["side"] == side
                    ),
                    None,
                )
                value = None if run is None else (run[name] if pct is None else run[name][pct])
                values.append(np.nan if value is None else value)
            label = {"max": "MAX pipeline", "vllm": "vLLM CPU", "llamacpp": "llama.cpp"}.get(
                side, side
            )
            ax.bar(x + (k - (len(ran) - 1) / 2) * width, values, width, label=label)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend()
    fig.suptitle(f"Serving on a CPU: {Path(runs[0]['model']).name if runs else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------ main


def model_directory(name: str) -> Path:
    """A Hugging Face directory for ``name`` (a path, or a maxkv model name exported once)."""
    path = Path(name)
    if path.is_dir():
        return path
    from maxkv.cachedir import cache_dir
    from maxkv.models.export import export_hf_directory
    from maxkv.models.resolve import open_model

    out = cache_dir() / "models" / f"{name}-hf"
    if not (out / "config.json").exists():
        print(f"exporting {name} to {out} ...", file=sys.stderr, flush=True)
        if out.exists():
            shutil.rmtree(out)
        export_hf_directory(open_model(name), out)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="maxkv model name or HF dir")
    parser.add_argument("--sides", default="maxkv,max", help=f"of {','.join(SIDES)}")
    parser.add_argument(
        "--gguf",
        type=Path,
        help="a GGUF file: llamacpp serves it, maxkv reads its weights (--weight-path); "
        "--model names the matching Hugging Face directory (or maxkv model)",
    )
    parser.add_argument(
        "--max-encoding",
        default="float32",
        help="the max side's --quantization-encoding (q4_k: MAX's own pipeline reads a "
        "Q4_K_M GGUF's q4_k and q6_k blocks on the CPU)",
    )
    parser.add_argument(
        "--llama-server",
        default=shutil.which("llama-server") or "/tmp/llama-build/bin/llama-server",
        help="llama.cpp's server binary (built as ../shared/notes/peer-servers-on-cpu.md says)",
    )
    parser.add_argument(
        "--api",
        choices=("chat", "completions"),
        default="chat",
        help="completions: a base model without a chat template reads the turns as plain text",
    )
    parser.add_argument(
        "--vllm", default="/tmp/vllm-venv/bin/vllm", help="vLLM's CLI (its CPU backend)"
    )
    parser.add_argument(
        "--workloads",
        "--workload",
        default="plain,system,multiturn",
        help=f"of {','.join(WORKLOADS)} (longdoc needs --max-length {LONGDOC_MAX_LENGTH}, "
        f"rag {RAG_MAX_LENGTH})",
    )
    parser.add_argument("--concurrency", default="16,32", help="requests in flight, e.g. 16,32")
    parser.add_argument("--requests", type=int, default=0, help="per workload (default 3 x C)")
    parser.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--server-timeout", type=float, default=900.0)
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        help="extra flag for both servers (repeat; e.g. --server-arg=--max-batch-input-tokens=512)",
    )
    parser.add_argument(
        "--maxkv-env",
        action="append",
        default=[],
        help="NAME=VALUE for maxkv's server only (e.g. MAXKV_CACHE=contiguous)",
    )
    parser.add_argument(
        "--arith-json",
        type=Path,
        help="also add the maxkv sides' rows to the arithmetic results (model, mode, "
        "concurrency, workload, maxkv_tok_s, llamacpp_tok_s, ...)",
    )
    parser.add_argument("--logs", type=Path, help="keep the server logs in this folder")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if set(args.sides) - set(SIDES) or set(args.workloads) - set(WORKLOADS):
        parser.error(f"sides are {SIDES}, workloads {WORKLOADS}")
    if "rag" in args.workloads and args.max_length < RAG_MAX_LENGTH:
        parser.error(f"the rag workload needs --max-length {RAG_MAX_LENGTH} or more")
    if "longdoc" in args.workloads and args.max_length < LONGDOC_MAX_LENGTH:
        parser.error(f"the longdoc workload needs --max-length {LONGDOC_MAX_LENGTH} or more")
    if min(args.concurrency, default=0) < 1:
        parser.error("--concurrency needs positive numbers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = model_directory(args.model)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="maxkv_serve_"))
    logs.mkdir(parents=True, exist_ok=True)
    from maxkv_bench.report import machine_info

    runs: list[dict[str, Any]] = []
    started = time.time()
    for concurrency in args.concurrency:
        for side in args.sides:
            log_path = logs / f"{side}_c{concurrency}.log"
            print(f"[{side}] starting max serve, C={concurrency} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            with server(side, model_dir, concurrency, args, log_path) as url:
                startup_s = time.perf_counter() - t0
                warm = [Request(f"warm/{i}", [{"role": "user", "content": q}], 8)
                        for i, q in enumerate(["Hello!", "Say one word."])]  # fmt: skip
                for request in warm:
                    asyncio.run(_single(url, str(model_dir), request, args.api))
                for workload in args.workloads:
                    offset = log_path.stat().st_size
                    requests, elapsed = asyncio.run(
                        run_workload(url, str(model_dir), workload, concurrency, args, side)
                    )
                    time.sleep(1.5)  # let the last batch's log line land
                    with log_path.open() as log:
                        log.seek(offset)
                        counters = log_counters(log.read())
                    run = {
                        "model": str(model_dir),
                        "side": side,
                        "workload": workload,
                        "concurrency": concurrency,
                        "startup_s": startup_s,
                        "peak_rss_mib": peak_rss_mib(url),
                        **summarize(requests, elapsed, counters),
                        **(rag_quality(requests) if workload == "rag" else {}),
                    }
                    runs.append(run)
                    print(
                        f"[{side}] {workload} C={concurrency}: {run['tokens_per_s']:.1f} tok/s, "
                        f"TTFT p50 {run['ttft_s']['p50']}, failed {run['failed']}, "
                        f"peak RSS {run['peak_rss_mib']} MiB",
                        file=sys.stderr,
                        flush=True,
                    )
    rows = compare(runs)
    print_table(runs, rows)
    results = {
        "machine": machine_info("cpu"),
        "model": str(model_dir),
        "settings": {
            "sides": args.sides,
            "workloads": args.workloads,
            "concurrency": args.concurrency,
            "requests_per_workload": args.requests or "3 x concurrency",
            "rate": args.rate or None,
            "max_length": args.max_length,
            "gguf": str(args.gguf) if args.gguf else None,
            "api": args.api,
            "server_args": args.server_args,
            "maxkv_env": args.maxkv_env,
            "max_encoding": args.max_encoding,
        },
        "elapsed_s": time.time() - started,
        "comparison": rows,
        "runs": runs,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(runs, args.plot)
    if args.arith_json:
        from maxkv_bench.report import merge_arith

        merge_arith(args.arith_json, results["machine"], arith_rows(runs, args))
    print(f"server logs: {logs}", file=sys.stderr)
    return 0


async def _single(url: str, model: str, request: Request, api: str = "chat") -> None:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
        await stream_chat(client, url, model, request, api)
    if request.error:
        raise RuntimeError(f"warm-up request failed: {request.error}")


if __name__ == "__main__":
    sys.exit(main())
