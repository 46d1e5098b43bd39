"""The OpenAI surface of ``max serve`` on maxkv: perplexity through ``echo``, and
several choices by fork.

    python benchmarks/openai_surface.py --json benchmarks/results/openai_surface_avx2.json

``perplexity``: SmolLM2-135M-Instruct (float32) scores the GPL-3 text
(``/usr/share/common-licenses/GPL-3``) in ``--windows`` windows of ``--window``
tokens, each a completions request of token ids with ``echo``, ``logprobs: 1``
and ``max_tokens: 0`` (what lm-evaluation-harness sends), once per KV
encoding (``--encodings``, MAX's ``--kv-cache-format``; a server each).  The
perplexity of every window's tokens after its first, against transformers'
(float32 weights, float64 ``log_softmax``) on the same windows: the
relative difference, and each encoding's against float32 KV's.

With ``--gguf FILE`` (``--model`` naming its Hugging Face directory) the
perplexity is llama.cpp's instead, on that file, once per
``--activations`` mode (``MAXKV_ACTIVATIONS``; a server each, float32 KV):
the text tokenized by ``llama-tokenize`` (``--llama-cpp-bin``), cut into
``--windows`` chunks of ``--window`` tokens, each chunk's first token
replaced by BOS where the vocabulary adds one, and only the second half of
each chunk scored, as ``llama-perplexity -c WINDOW --chunks WINDOWS`` scores
it; ``llama-perplexity`` itself runs on the same file and text, and each
mode is reported against float32's and against llama.cpp's.

``choices``: a chat question behind the ~600-token system prompt of
``benchmarks/serve.py``, sampled (temperature 1, seeded), ``--max-tokens``
new tokens (EOS ignored), three ways, alternating ``--repeats`` times with
the prefix cache reset before each:

- ``n=8``: one request asking for 8 choices (maxkv forks one computed prompt);
- ``8 requests, shared prefix``: the same 8 as separate requests at once (prefix
  caching shares the prompt's full pages between them);
- ``8 requests, no sharing``: the same, each with a ``cache_salt`` of its own
  (what a server without prefix caching does: 8 prompts computed).

Per way: wall time, output tokens/s (median of the repeats), prompt tokens
computed (the prompt tokens minus the cached ones, from ``usage``), and the KV
pages held once the 8th sequence has started (from ``MAXKV_EVENT_LOG``)
against one request's pages at the end of its prompt.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from maxkv_bench.report import machine_info
from serve import LONG_DOCUMENT_PATH, SYSTEM_PROMPT, model_directory, server

PAGE = 16


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=1800) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def server_args(args: argparse.Namespace, flags: list[str], env: list[str]) -> argparse.Namespace:
    return argparse.Namespace(
        gguf=getattr(args, "gguf", None),
        max_length=args.max_length,
        server_args=["--kv-cache-page-size", str(PAGE), *flags],
        maxkv_env=env,
        server_timeout=1800.0,
        api="chat",
    )


# ------------------------------------------------------------------ perplexity


def windows(model_dir: Path, count: int, size: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer(LONG_DOCUMENT_PATH.read_text()).input_ids
    if len(ids) < count * size:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {count} x {size}")
    return [ids[i * size : (i + 1) * size] for i in range(count)]


def transformers_nll(model_dir: Path, pieces: list[list[int]]) -> list[float]:
    """Per window, the negative log-likelihood of its tokens after the first."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for ids in pieces:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        out.append(float(-lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum()))
    return out


def served_nll(
    url: str, model: str, pieces: list[list[int]], scored_from: int = 1
) -> tuple[list[float], float]:
    """Per window, the negative log-likelihood through ``echo`` of its tokens from
    ``scored_from`` on; and the wall time."""
    started = time.perf_counter()
    nll = []
    for ids in pieces:
        answer = post(
            url,
            "/v1/completions",
            {"model": model, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0},
        )
        values = answer["choices"][0]["logprobs"]["token_logprobs"]
        assert values[0] is None and len(values) == len(ids), len(values)
        nll.append(-float(sum(values[scored_from:])))
    return nll, time.perf_counter() - started


def served_perplexities(
    args: argparse.Namespace,
    model_dir: Path,
    work: Path,
    servers: dict[str, tuple[list[str], list[str]]],
    pieces: list[list[int]],
    scored_from: int,
    scored: int,
) -> dict[str, Any]:
    """Per named maxkv server (its flags and environment), one after another: the
    perplexity of ``pieces``' tokens from ``scored_from`` on (``scored`` in all)."""
    runs: dict[str, Any] = {}
    for name, (flags, env) in servers.items():
        with server(
            "maxkv", model_dir, 4, server_args(args, flags, env), work / f"{name}.log"
        ) as url:
            nll, elapsed = served_nll(url, str(model_dir), pieces, scored_from)
        value = math.exp(sum(nll) / scored)
        runs[name] = {"perplexity": value, "seconds": elapsed}
        print(f"maxkv {name}: perplexity {value:.4f} ({elapsed:.1f} s)", flush=True)
    return runs


def relative(runs: dict[str, Any], reference: float, against: str, to_float32: str) -> None:
    """Adds each run's perplexity relative to ``reference`` (as ``against``) and to
    the ``float32`` run's (as ``to_float32``) where that ran."""
    base = runs.get("float32", {}).get("perplexity")
    for run in runs.values():
        run[against] = run["perplexity"] / reference - 1
        if base is not None:
            run[to_float32] = run["perplexity"] / base - 1


def perplexity(args: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    pieces = windows(model_dir, args.windows, args.window)
    tokens = sum(len(p) - 1 for p in pieces)
    reference = math.exp(sum(transformers_nll(model_dir, pieces)) / tokens)
    print(f"transformers: perplexity {reference:.4f} over {tokens} tokens", flush=True)
    servers = {
        encoding: (["--max-batch-size", "4", "--kv-cache-format", encoding], [])
        for encoding in args.encodings.split(",")
    }
    runs = served_perplexities(args, model_dir, work, servers, pieces, 1, tokens)
    relative(runs, reference, "relative_to_transformers", "relative_to_float32_kv")
    return {
        "text": str(LONG_DOCUMENT_PATH),
        "windows": args.windows,
        "window_tokens": args.window,
        "scored_tokens": tokens,
        "transformers_perplexity": reference,
        "maxkv": runs,
    }


def llama_cpp_tokens(binaries: Path, gguf: Path, text: Path) -> tuple[list[int], int | None]:
    """The text's token ids as llama.cpp reads it, and its BOS id where it adds one."""

    def ids(*flags: str) -> list[int]:
        command = [str(binaries / "llama-tokenize"), "-m", str(gguf), "-f", str(text)]
        out = subprocess.run(
            [*command, "--ids", "--log-disable", *flags],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [int(t) for t in json.loads(out.strip().splitlines()[-1])]

    tokens, bare = ids(), ids("--no-bos")
    return tokens, (tokens[0] if len(tokens) == len(bare) + 1 else None)


def llama_cpp_perplexity(binaries: Path, gguf: Path, text: Path, ctx: int, chunks: int) -> float:
    """``llama-perplexity``'s final estimate on ``chunks`` chunks of ``ctx`` tokens."""
    command = [str(binaries / "llama-perplexity"), "-m", str(gguf), "-f", str(text)]
    out = subprocess.run(
        [*command, "-c", str(ctx), "--chunks", str(chunks), "-t", str(os.cpu_count() or 1)],
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if found is None:
        raise RuntimeError(f"no final estimate from llama-perplexity:\n{out.stderr[-2000:]}")
    return float(found.group(1))


def gguf_perplexity(args: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    """llama.cpp's perplexity (see the module docstring) per activation mode."""
    binaries, ctx = args.llama_cpp_bin, args.window
    tokens, bos = llama_cpp_tokens(binaries, args.gguf, LONG_DOCUMENT_PATH)
    count = min(args.windows, len(tokens) // ctx)
    chunks = [tokens[i * ctx : (i + 1) * ctx] for i in range(count)]
    if bos is not None:
        chunks = [[bos, *chunk[1:]] for chunk in chunks]
    first = ctx // 2  # llama-perplexity scores tokens first + 1 .. ctx - 1 of a chunk
    scored = count * (ctx - 1 - first)
    started = time.perf_counter()
    reference = llama_cpp_perplexity(binaries, args.gguf, LONG_DOCUMENT_PATH, ctx, count)
    print(f"llama-perplexity: {reference:.4f} ({time.perf_counter() - started:.1f} s)", flush=True)
    servers = {
        mode: (
            ["--max-batch-size", "4", "--kv-cache-format", "float32"],
            [f"MAXKV_ACTIVATIONS={mode}"],
        )
        for mode in args.activations.split(",")
    }
    runs = served_perplexities(args, model_dir, work, servers, chunks, first + 1, scored)
    relative(runs, reference, "relative_to_llama_cpp", "relative_to_float32")
    return {
        "text": str(LONG_DOCUMENT_PATH),
        "gguf": str(args.gguf),
        "chunks": count,
        "chunk_tokens": ctx,
        "scored_tokens": scored,
        "bos": bos,
        "llama_cpp_perplexity": reference,
        "maxkv": runs,
    }


# ------------------------------------------------------------------ choices


QUESTION = "Which tent would you suggest for a family of four, and why?"


def messages() -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}]


def one_way(url: str, model: str, way: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": messages(),
        "max_tokens": args.max_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    if way == "n=8":
        answers = [post(url, "/v1/chat/completions", {**body, "n": 8, "seed": seed})]
    else:

        def send(j: int) -> dict[str, Any]:
            extra: dict[str, Any] = {"seed": seed + j}
            if way == "8 requests, no sharing":
                extra["cache_salt"] = f"user-{seed}-{j}"
            return post(url, "/v1/chat/completions", {**body, **extra})

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(send, range(8)))
    elapsed = time.perf_counter() - started
    output = sum(a["usage"]["completion_tokens"] for a in answers)
    prompt = [a["usage"]["prompt_tokens"] for a in answers]
    cached = [
        (a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for a in answers
    ]
    choices = [c for a in answers for c in a["choices"]]
    return {
        "seconds": elapsed,
        "output_tokens": output,
        "tokens_per_s": output / elapsed,
        "prompt_tokens": prompt[0],
        "prompt_tokens_computed": sum(p - c for p, c in zip(prompt, cached, strict=True))
        if way != "n=8"
        else prompt[0] - cached[0],
        "distinct_texts": len({c["message"]["content"] for c in choices}),
        "choices": len(choices),
    }


def pages_at_start(events: Path, start: int) -> int | None:
    """Pages held once the 8th sequence started, from the adapter's event log."""
    if not events.exists():
        return None
    with events.open() as log:
        log.seek(start)
        allocs = [json.loads(line) for line in log if '"alloc"' in line]
    if len(allocs) < 8:
        return None
    eighth = allocs[7]
    return int(eighth["total"]) - int(eighth["free"])


def choices(args: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    ways = ("n=8", "8 requests, shared prefix", "8 requests, no sharing")
    events = work / "events.jsonl"
    flags = ["--max-batch-size", "8", "--enable-prefix-caching"]
    env = [f"MAXKV_EVENT_LOG={events}"]
    results: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    cargs = server_args(args, flags, env)
    os.environ["MAX_SERVE_USE_CLIENT_CACHE_SALT"] = "1"  # (the server's environment)
    with server("maxkv", model_dir, 8, cargs, work / "choices.log") as url:
        model = str(model_dir)
        one_way(url, model, "n=8", args, 0)  # warm-up
        for repeat in range(args.repeats):
            for way in ways:
                reset = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
                with urllib.request.urlopen(reset, timeout=60):
                    pass
                start = events.stat().st_size if events.exists() else 0
                run = one_way(url, model, way, args, 100 * (repeat + 1))
                run["pages_held_at_8th_start"] = pages_at_start(events, start)
                results[way].append(run)
                print(f"{way}: {run['tokens_per_s']:.1f} tok/s, {run['seconds']:.2f} s, "
                      f"computed {run['prompt_tokens_computed']} prompt tokens, pages "
                      f"{run['pages_held_at_8th_start']}", flush=True)  # fmt: skip
    prompt = results["n=8"][0]["prompt_tokens"]
    one = math.ceil(prompt / PAGE)
    summary = {}
    for way, runs in results.items():
        held = [r["pages_held_at_8th_start"] for r in runs if r["pages_held_at_8th_start"]]
        summary[way] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
            "seconds_median": statistics.median(r["seconds"] for r in runs),
            "prompt_tokens_computed": runs[0]["prompt_tokens_computed"],
            "pages_held_at_8th_start": held[0] if held else None,
            "kv_vs_one_request": held[0] / one if held else None,
            "distinct_texts": [r["distinct_texts"] for r in runs],
        }
    base = summary["n=8"]["tokens_per_s_median"]
    for way in ways[1:]:
        summary[way]["n8_speedup"] = base / summary[way]["tokens_per_s_median"]
    return {
        "prompt_tokens": prompt,
        "one_request_pages_at_prompt_end": one,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "summary": summary,
        "runs": results,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--parts", default="perplexity,choices")
    parser.add_argument("--encodings", default="float32,int8,float8_e4m3fn")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gguf", type=Path, help="llama.cpp's perplexity on this file")
    parser.add_argument("--activations", default="float32,int8", help="MAXKV_ACTIVATIONS modes")
    parser.add_argument(
        "--llama-cpp-bin",
        type=Path,
        default=Path("/tmp/llama-build/bin"),
        help="llama.cpp's built tools (llama-tokenize, llama-perplexity)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    model_dir = model_directory(args.model)
    out: dict[str, Any] = {
        "command": "python benchmarks/openai_surface.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info("cpu"),
        "model": args.model,
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        parts = args.parts.split(",")
        if "perplexity" in parts:
            measure = gguf_perplexity if args.gguf else perplexity
            out["perplexity"] = measure(args, model_dir, work)
        if "choices" in parts:
            out["choices"] = choices(args, model_dir, work)
    print(json.dumps(out, indent=1, default=str)[:6000])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
