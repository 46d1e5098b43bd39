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
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from max.dtype import DType

from maxkv import KVCacheParams
from maxkv.tiers.local_server import LocalRedisServer as RedisServer

from . import fakes
from .conftest import requires_transformers
from .family_checkpoints import ALL_SLIDING, FAMILIES, HYBRID
from .forgery import forge_every_block
from .pipeline_helpers import (
    MAX_CLI,
    NEW_TOKENS,
    OFFLINE,
    Server,
    complete,
    max_pipeline_args,
    read_events,
    running_server,
    settled_events,
    transformers_completion,
)

# ------------------------------------------------------------------ the adapter


def context(tokens: list[int], salt: str | None = None, max_length: int = 64) -> Any:
    """A real MAX ``TextContext`` holding the prompt ``tokens``."""
    import numpy as np
    from max.pipelines.context import TextContext
    from max.pipelines.context.tokens import TokenBuffer
    from max.pipelines.modeling.types import RequestID

    return TextContext(
        request_id=RequestID(),
        max_length=max_length,
        tokens=TokenBuffer(np.array(tokens, dtype=np.int64)),
        cache_salt=salt,
    )


def run_step(adapter: Any, batch: list[Any], next_token: int = 7) -> list[int]:
    """What MAX's pipeline does around a model step: inputs, then update and step each."""
    (inputs,) = adapter.runtime_inputs([batch])
    lengths = inputs[1].to_numpy().tolist()
    for ctx in batch:
        ctx.update(next_token)  # a chunked prefill advances its chunk instead
        adapter.step(ctx)
    return lengths


PAGE = 4


@pytest.fixture
def paged_adapter() -> Any:
    from maxkv.pipelines import MaxkvKVManager

    params = KVCacheParams(DType.float32, 1, 8)
    manager = fakes.paged(params, PAGE, 10, 4, 32, enable_prefix_caching=True)
    return MaxkvKVManager(manager, params=SimpleNamespace(page_size=PAGE))


@pytest.mark.unit
def test_adapter_shares_cached_pages_and_reports_hits(paged_adapter: Any) -> None:
    from max.pipelines.kv_cache.paged_kv_cache import InsufficientBlocksError

    adapter, manager = paged_adapter, paged_adapter.manager
    prompt = list(range(10, 20))
    a = context(prompt)
    adapter.claim(a)
    adapter.alloc(a)
    assert a.cached_prefix_length == 0 and manager.pages(adapter.seq_of(a)) == (0, 1, 2)
    b = context([*prompt[:9], 99])  # shares 9 tokens: two whole pages
    adapter.claim(b)
    with pytest.raises(InsufficientBlocksError, match=r"waits for request .* 9 prompt tokens"):
        adapter.alloc(b)  # a is computing them: b waits a batch instead of computing them too
    assert adapter.seq_of(b) is None and b.tokens.processed_length == 0
    assert run_step(adapter, [a]) == [0]
    # The two full pages of a's 10 committed tokens are in the prefix cache now.
    pages_a = manager.pages(adapter.seq_of(a))
    assert [manager.page_is_cached(p) for p in pages_a] == [True, True, False]

    assert adapter.get_prefix_cache_hit_counts(b)[0].device_blocks == 2
    adapter.alloc(b)
    assert b.cached_prefix_length == 8 and b.tokens.processed_length == 8
    assert b.tokens.active_length == 2
    pages_b = manager.pages(adapter.seq_of(b))
    assert pages_b[:2] == pages_a[:2] and manager.page_refcount(pages_a[0]) == 2
    assert run_step(adapter, [b]) == [8]  # b starts at its cached length

    other_tenant = context(prompt, salt="tenant-b")  # same tokens, other salt: no hit
    assert adapter.get_prefix_cache_hit_counts(other_tenant)[0].device_blocks == 0
    adapter.claim(other_tenant)
    adapter.alloc(other_tenant)
    assert other_tenant.cached_prefix_length == 0

    metrics = adapter.take_metrics_aggregated()
    assert (metrics.cache_tokens, metrics.input_tokens) == (8, 10 + 2 + 10)
    assert adapter.take_metrics_aggregated().cache_tokens == 0  # taken: reset

    for ctx in (a, b, other_tenant):
        adapter.release(ctx)
    assert adapter.block_count().free == 10  # every page free again (cached ones evictable)
    assert manager.prefix_cache_stats.cached_pages >= 2
    again = context(prompt)  # a's pages outlive it
    adapter.claim(again)
    adapter.alloc(again)
    assert again.cached_prefix_length == 8
    adapter.release(again)


@pytest.mark.unit
def test_adapter_out_of_pages_leaves_request_and_cache_as_they_were(paged_adapter: Any) -> None:
    from max.pipelines.kv_cache.paged_kv_cache import InsufficientBlocksError

    adapter, manager = paged_adapter, paged_adapter.manager
    held = context(list(range(1, 25)))  # 24 tokens: 6 of the 10 pages
    adapter.claim(held)
    adapter.alloc(held)
    run_step(adapter, [held])
    assert adapter.block_count().free == 4
    big = context([*range(1, 9), *range(50, 70)])  # 8 cached tokens + 20 new: 5 more pages
    adapter.claim(big)
    with pytest.raises(InsufficientBlocksError, match="out of pages"):
        adapter.alloc(big)
    assert adapter.seq_of(big) is None and big.tokens.processed_length == 0
    assert big.tokens.active_length == 28 and adapter.block_count().free == 4
    assert manager.page_refcount(manager.pages(adapter.seq_of(held))[0]) == 1
    adapter.release(held)  # MAX retries later: now it fits
    adapter.alloc(big)
    assert big.cached_prefix_length == 8
    adapter.release(big)
    assert adapter.block_count().free == 10


@pytest.mark.unit
def test_adapter_chunked_prefill_commits_chunk_by_chunk(paged_adapter: Any) -> None:
    adapter, manager = paged_adapter, paged_adapter.manager
    ctx = context(list(range(30, 43)))  # 13 tokens, prefilled in chunks of 5, 5 and 3
    adapter.claim(ctx)
    seen = []
    while ctx.tokens.generated_length == 0:
        adapter.alloc(ctx)
        if ctx.tokens.active_length > 5:
            ctx.tokens.chunk(5)  # what MAX's token budget does
        seen.append((ctx.tokens.processed_length, ctx.tokens.active_length))
        run_step(adapter, [ctx])
    assert seen == [(0, 5), (5, 5), (10, 3)]
    seq = adapter.seq_of(ctx)
    assert manager.cache_lengths[seq] == 13 and len(manager.pages(seq)) == 4
    adapter.release(ctx)


@pytest.mark.unit
def test_adapter_maps_requests_to_contiguous_slots() -> None:
    from max.pipelines.kv_cache.paged_kv_cache import InsufficientBlocksError

    from maxkv.pipelines import MaxkvKVManager

    params = KVCacheParams(DType.float32, 1, 8)
    manager = fakes.contiguous(params, 2, 16)
    adapter = MaxkvKVManager(manager, params=SimpleNamespace(page_size=PAGE))
    a, b, c = (context([1, 2, 3, 4, 5]) for _ in range(3))
    for ctx in (a, b, c):
        adapter.claim(ctx)  # claiming never fails for lack of room (MAX does not retry it)
    assert adapter.contains(a) and adapter.block_count().free == 2
    adapter.alloc(a)
    adapter.alloc(b)
    assert {adapter.seq_of(a), adapter.seq_of(b)} == {0, 1}
    with pytest.raises(InsufficientBlocksError, match="cannot claim 1 sequences"):
        adapter.alloc(c)  # MAX requeues c and retries later
    assert adapter.seq_of(c) is None and adapter.block_count().free == 0
    assert run_step(adapter, [a, b]) == [0, 0]
    assert manager.cache_lengths[adapter.seq_of(a)] == 5
    for _ in range(11):
        adapter.alloc(a)
        run_step(adapter, [a])
    assert len(a.tokens) == 17  # 16 in the cache, the last one next
    with pytest.raises(InsufficientBlocksError, match="needs 17 cache positions"):
        adapter.alloc(a)

    adapter.release(b)
    adapter.alloc(c)  # b's slot is free again
    assert adapter.seq_of(c) == 1 and not adapter.contains(b)
    adapter.release(a)
    adapter.release(c)
    assert adapter.block_count().free == 2 and manager.slots_remaining == 2

    with pytest.raises(ValueError, match="data parallelism"):
        adapter.claim(context([1]), replica_idx=1)
    adapter.claim(a)
    with pytest.raises(ValueError, match="already claimed"):
        adapter.claim(a)
    with pytest.raises(ValueError, match="not claimed"):
        adapter.release(b)
    assert adapter.get_prefix_cache_hit_counts(a)[0].device_blocks == 0  # no prefix caching
    assert not adapter.pending_transfers_exist() and adapter.effective_max_seq_length == 16


@pytest.mark.unit
def test_max_version_pin() -> None:
    from maxkv.pipelines import SUPPORTED_MAX, UnsupportedMaxVersionError, check_max_version

    assert check_max_version().startswith("26.7")
    assert check_max_version("26.7.3") == "26.7.3"
    for bad in ("26.8.0", "25.6.1", "27.0", "nightly"):
        with pytest.raises(UnsupportedMaxVersionError, match=SUPPORTED_MAX.replace(".", r"\.")):
            check_max_version(bad)


@pytest.mark.unit
def test_model_identity_follows_every_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from maxkv.serving.pipelines.model import model_identity

    monkeypatch.setenv("MAXKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MAXKV_MODEL_ID", raising=False)
    first, second = tmp_path / "a" / "model", tmp_path / "b" / "model"
    weights = bytes(3 << 20)
    for directory, last in ((first, 0), (second, 1)):  # differ in the very last byte
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(weights[:-1] + bytes([last]))
        (directory / "config.json").write_text("{}")
    assert model_identity(first) != model_identity(second)
    before = model_identity(first)
    assert model_identity(first) == before  # remembered: the same answer
    (first / "config.json").write_text('{"changed": 1}')
    assert model_identity(first) != before  # a changed file is hashed again
    monkeypatch.setenv("MAXKV_MODEL_ID", "my-finetune@v3")
    assert model_identity(first) == "my-finetune@v3"


@pytest.mark.unit
def test_cache_fit_check() -> None:
    from maxkv.serving.pipelines.model import CacheDoesNotFitError, check_cache_fits

    check_cache_fits(100, 100, 4, 64)
    check_cache_fits(100, None, 4, 64)
    with pytest.raises(CacheDoesNotFitError, match=r"4 slots x 64 tokens .* lower --max-batch"):
        check_cache_fits(2**31, 2**30, 4, 64)


# ------------------------------------------------------------------ real processes


def max_generate(
    directory: Path,
    prompt: str,
    max_length: int,
    max_batch: int,
    *extra: str,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """``max generate`` on maxkv, greedy, pages of 16 tokens, ``extra`` flags and
    ``env`` added."""
    return subprocess.run(
        [
            MAX_CLI,
            "generate",
            *max_pipeline_args(
                directory,
                *("--max-length", str(max_length), "--max-batch-size", str(max_batch)),
                *("--kv-cache-page-size", "16", "--top-k", "1", "--prompt", prompt),
                *extra,
            ),
            "--max-new-tokens",
            str(NEW_TOKENS),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **OFFLINE, **env},
    )


@pytest.mark.serve
@pytest.mark.parametrize("cache", ["paged", pytest.param("contiguous", marks=pytest.mark.sweep)])
def test_max_generate_matches_transformers(
    cache: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    prompt = "hello world"
    events = tmp_path / "events.jsonl"
    result = max_generate(
        tiny_llama_dir, prompt, 64, 2, MAXKV_EVENT_LOG=str(events), MAXKV_CACHE=cache
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    generated = result.stdout.split("Prompt size:")[0].strip("\n")
    assert generated == transformers_completion(tiny_llama_dir, prompt, NEW_TOKENS)
    assert "Output size: " in result.stdout
    logged = read_events(events)
    assert [e["event"] for e in logged] == ["alloc", "release"]  # it ran on a maxkv sequence
    assert logged[-1]["free"] == logged[-1]["total"]  # slots, or pages of 16 tokens


def _gguf_of_directory(directory: Path, gguf: Path, reference: Path) -> None:
    """Writes ``directory``'s weights as a llama.cpp GGUF of Q4_0 matrices, and
    ``reference``: ``directory`` with the weights that file holds (each matrix
    through ``gguf.quants`` and back), for transformers."""
    import shutil

    from gguf import GGMLQuantizationType, quants
    from safetensors.numpy import load_file, save_file

    from .gguf_helpers import write_llama_gguf

    hf = json.loads((directory / "config.json").read_text())
    config = {
        **{k: hf[k] for k in ("vocab_size", "hidden_size", "intermediate_size")},
        **{k: hf[k] for k in ("num_hidden_layers", "num_attention_heads")},
        **{k: hf[k] for k in ("num_key_value_heads", "rms_norm_eps")},
        "rope_theta": hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta")),
        "head_dim": hf["hidden_size"] // hf["num_attention_heads"],
        "max_position_embeddings": hf["max_position_embeddings"],
    }
    weights = load_file(directory / "model.safetensors")
    write_llama_gguf(gguf, weights, config, matrix_type="Q4_0")
    q4 = GGMLQuantizationType.Q4_0
    shutil.copytree(directory, reference)
    save_file(
        {
            name: quants.dequantize(quants.quantize(w, q4), q4) if w.ndim == 2 else w
            for name, w in weights.items()
        },
        reference / "model.safetensors",
        metadata={"format": "pt"},
    )


@pytest.mark.serve
def test_max_generate_reads_a_gguf_weight_path_as_transformers_does(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """``--weight-path FILE.gguf`` (MAX's way to name a GGUF file): the F32 norms
    are read-only views of the file's mapping, and the Q4_0 matrices are read
    packed by decode steps.  It died with a segmentation fault in its first step
    (the norms were unmapped under the model); now transformers' text on the
    same weights."""
    gguf, reference = tmp_path / "tiny.gguf", tmp_path / "reference"
    _gguf_of_directory(tiny_llama_dir, gguf, reference)
    prompt = "hello world"  # a prefill of more than 8 rows, then 1-row steps
    result = max_generate(tiny_llama_dir, prompt, 64, 1, "--weight-path", str(gguf))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "tiny.gguf" in result.stderr  # maxkv loaded the GGUF file, not the directory
    generated = result.stdout.split("Prompt size:")[0].strip("\n")
    assert generated == transformers_completion(reference, prompt, NEW_TOKENS)
    assert generated != transformers_completion(tiny_llama_dir, prompt, NEW_TOKENS)


@pytest.mark.serve
def test_max_generate_kv_cache_format_quantized_plans_real_bytes(tiny_llama_dir: Path) -> None:
    """``--kv-cache-format int8`` (maxkv's own encoding) and ``float8_e4m3fn``
    (MAX's): the startup line names the encoding.  MAX plans int8 as float32, so
    the same memory plan holds ``4 x head_dim / (head_dim + 2)`` times the pages
    of float32 KV (a float16 scale per row: 3.56x at this model's head_dim of 16,
    3.88x at 64).  MAX plans float8 for its own cache, one byte a value (here a
    quarter of float32's plan: MAX sizes it to the batch's needs); maxkv fills it
    with rows of ``head_dim + 2`` bytes."""
    pages = {}
    for encoding in ("float32", "int8", "float8_e4m3fn"):
        result = _generate_with_format(tiny_llama_dir, encoding)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        log = result.stdout + result.stderr
        found = re.search(r"paged cache: (\d+) pages of 16 tokens \([\d.]+ MiB, (\w+) KV\)", log)
        assert found is not None, log[-3000:]
        assert found.group(2) == encoding
        pages[encoding] = int(found.group(1))
        assert "Output size: " in result.stdout
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert pages["int8"] >= pages["float32"] * 4 * head_dim // (head_dim + 2), pages
    assert pages["float8_e4m3fn"] >= pages["float32"] * head_dim // (head_dim + 2), pages


@pytest.mark.serve
@pytest.mark.parametrize(
    ("encoding", "message"),
    [
        # MAX's own check (the architecture does not list NVFP4) stops it first.
        ("float4_e2m1fn", "kv_cache_format 'float4_e2m1fn' is not supported"),
        ("int3", "int3"),
        # A scale per 32 values: this model's heads are 16 wide.
        ("int4", "--kv-cache-format int4: an int4 cache keeps a scale per 32 values"),
    ],
)
def test_max_generate_refuses_a_kv_cache_format_maxkv_lacks(
    tiny_llama_dir: Path, encoding: str, message: str
) -> None:
    """An encoding maxkv does not implement stops the pipeline at start, by name;
    nothing is served from another encoding."""
    result = _generate_with_format(tiny_llama_dir, encoding)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert "Output size: " not in result.stdout


def _generate_with_format(directory: Path, encoding: str) -> subprocess.CompletedProcess[str]:
    return max_generate(directory, "hello world", 64, 2, "--kv-cache-format", encoding)


#: A prompt of 160 tokens (one per character): past the families' 128-token windows.
LONG_PROMPT = ("the cache keeps what the window no longer sees; " * 4)[:160]


#: The families ``max generate`` runs (a process and a compile each): the two cache
#: layouts a family can add to the plain Llama of the tests above, a window over one
#: group (Mistral) and a layer group per window (Gemma 3).  Every family's numerics
#: are checked in-process (``test_families.py``) and its architecture's registration
#: below; the pipeline code past those is the same for every family.
GENERATE_FAMILIES = ("gemma3", "mistral")


@pytest.mark.unit
def test_every_family_is_registered_for_max_pipelines() -> None:
    """The architecture transformers writes in each family's ``config.json`` is one
    ``--custom-architectures maxkv.pipelines`` registers, so ``max generate`` and
    ``max serve`` run it on maxkv."""
    transformers = pytest.importorskip("transformers")
    from maxkv.pipelines import ARCHITECTURES

    names = {arch.name for arch in ARCHITECTURES}
    causal_lm = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    for family, (model_type, _) in FAMILIES.items():
        assert causal_lm[model_type] in names, family
    assert set(GENERATE_FAMILIES) <= set(FAMILIES)


@pytest.mark.serve
@pytest.mark.parametrize(
    "family",
    # Mistral's window is one of Gemma 3's layer groups: a further family with --sweeps.
    [f if f == "gemma3" else pytest.param(f, marks=pytest.mark.sweep) for f in GENERATE_FAMILIES],
)
def test_max_generate_runs_every_family_as_transformers_does(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``max generate`` through ``--custom-architectures maxkv.pipelines`` on the
    families with a cache layout of their own (:data:`GENERATE_FAMILIES`; random
    checkpoints, paged cache): transformers' greedy text, on a prompt longer than
    their window."""
    requires_transformers()
    from .pipeline_helpers import make_tiny_family_dir

    directory = make_tiny_family_dir(tmp_path_factory.mktemp(family), family, seed=3)
    events = directory / "events.jsonl"
    result = max_generate(directory, LONG_PROMPT, 256, 1, MAXKV_EVENT_LOG=str(events))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    generated = result.stdout.split("Prompt size:")[0].strip("\n")
    assert generated == transformers_completion(directory, LONG_PROMPT, NEW_TOKENS)
    logged = read_events(events)  # it ran on maxkv's cache, not MAX's own pipeline
    assert [e["event"] for e in logged] == ["alloc", "release"]
    assert logged[-1]["free"] == logged[-1]["total"]  # every page back
    assert "trivial register type" not in result.stderr
    log = result.stdout + result.stderr
    if family in HYBRID:  # a layer group per window: the sliding layers give pages back
        assert "hybrid paged cache" in log
        assert "KV tiers: host" in log and "(per group, 2 groups)" in log  # tiers on, per group
    elif family in ALL_SLIDING:
        assert "window freed" in log


@pytest.mark.serve
@pytest.mark.sweep  # sinks' numerics: tests/test_sinks.py; their settings: below
def test_max_generate_with_attention_sinks_runs_as_streaming_transformers(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """``MAXKV_SLIDING_WINDOW`` / ``MAXKV_ATTENTION_SINKS``: a prompt five times the
    window, then decoding; the text of transformers over a cache that StreamingLLM
    edits (the sink page and the window, at their places in the cache)."""
    from .streaming_reference import streaming_completion

    events = tmp_path / "events.jsonl"
    result = max_generate(
        tiny_llama_dir,
        LONG_PROMPT,
        256,
        1,
        MAXKV_EVENT_LOG=str(events),
        MAXKV_SLIDING_WINDOW="32",
        MAXKV_ATTENTION_SINKS="4",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    generated = result.stdout.split("Prompt size:")[0].strip("\n")
    expected = streaming_completion(tiny_llama_dir, LONG_PROMPT, NEW_TOKENS, 32, 4, 16)
    assert generated == expected
    assert generated != transformers_completion(tiny_llama_dir, LONG_PROMPT, NEW_TOKENS)
    assert (
        "attention sinks: every request keeps its first 4 tokens" in result.stdout + result.stderr
    )
    logged = read_events(events)
    assert [e["event"] for e in logged] == ["alloc", "release"]
    assert logged[-1]["free"] == logged[-1]["total"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("window", "sinks", "error"),
    [("0", "", "positive"), ("x", "", "positive"), ("64", "-1", "number"), ("", "4", "needs")],
)
def test_attention_sink_settings_are_checked(
    window: str, sinks: str, error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from maxkv.serving.pipelines.model import streaming_window

    monkeypatch.setenv("MAXKV_SLIDING_WINDOW", window)
    monkeypatch.setenv("MAXKV_ATTENTION_SINKS", sinks)
    with pytest.raises(ValueError, match=error):
        streaming_window()
    monkeypatch.setenv("MAXKV_SLIDING_WINDOW", "64")
    monkeypatch.setenv("MAXKV_ATTENTION_SINKS", "")
    assert streaming_window() == (64, 4)


@pytest.fixture(scope="module")
def max_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module's tests."""
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("serve")) as server:
        yield server


@pytest.mark.serve
def test_max_serve_concurrent_completions(max_server: Server) -> None:
    start = max_server.events.stat().st_size if max_server.events.exists() else 0
    prompts = ["hello world", "abc", "The quick brown fox", "maxkv"]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(max_server, p), prompts))
    for prompt, (status, body) in zip(prompts, answers, strict=True):
        assert status == 200, body
        expected = transformers_completion(max_server.model, prompt, NEW_TOKENS)
        assert body["choices"][0]["text"] == expected, prompt
    expected_abc = answers[1][1]["choices"][0]["text"]

    logged = settled_events(max_server, start)
    allocs = [e for e in logged if e["event"] == "alloc"]
    assert len(allocs) == 4 and len({e["seq_id"] for e in allocs}) == 4
    # All four held pages at once: every alloc precedes the first release.
    first_release = next(i for i, e in enumerate(logged) if e["event"] == "release")
    assert first_release == 4
    assert logged[-1]["event"] == "release" and logged[-1]["free"] == logged[-1]["total"]

    status, body = complete(max_server, "x" * 300)  # past --max-length 256
    assert status == 400 and "too long" in json.dumps(body)
    status, body = complete(max_server, "abc", n=2)  # two choices (tests/test_choices.py)
    assert status == 200 and [c["text"] for c in body["choices"]] == [expected_abc] * 2
    status, body = complete(max_server, "hello world")  # still serving
    assert status == 200
    assert body["choices"][0]["text"] == transformers_completion(
        max_server.model, "hello world", NEW_TOKENS
    )


@pytest.mark.serve
def test_a_blend_separator_is_text_on_a_server_without_blending(max_server: Server) -> None:
    """Without MAXKV_BLEND the separator is part of the prompt (tokenized with it),
    and a separator at the end is no error."""
    for prompt in ["Notes: # # Ann has a kite. # # Who has a kite?", "abc # # "]:
        status, body = complete(max_server, prompt)
        assert status == 200, body
        assert body["choices"][0]["text"] == transformers_completion(
            max_server.model, prompt, NEW_TOKENS
        )


SHARED = "You are a helpful assistant. Answer briefly and kindly. " * 2  # 112 tokens


@pytest.mark.serve
def test_max_serve_shared_prefix_hits_the_cache_in_chunks(max_server: Server) -> None:
    """A prompt prefix shared by later requests is reused from cached pages; prompts
    longer than --max-batch-input-tokens are prefilled in chunks; texts equal
    transformers'."""
    start = max_server.events.stat().st_size if max_server.events.exists() else 0
    log_start = max_server.log.stat().st_size
    prompts = [SHARED + q for q in ("Hi?", "What is 2+2?", "Name a color.", "Why?")]
    first = complete(max_server, prompts[0])  # computes and caches the shared pages
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        rest = list(pool.map(lambda p: complete(max_server, p), prompts[1:]))
    for prompt, (status, body) in zip(prompts, [first, *rest], strict=True):
        assert status == 200, body
        expected = transformers_completion(max_server.model, prompt, NEW_TOKENS)
        assert body["choices"][0]["text"] == expected, prompt

    allocs = [e for e in settled_events(max_server, start) if e["event"] == "alloc"]
    assert len(allocs) == 4 and allocs[0]["cached_prefix"] == 0
    assert all(e["cached_prefix"] == 112 for e in allocs[1:])  # 7 whole pages of 16
    with max_server.log.open() as log:
        log.seek(log_start)
        text = log.read()
    hits = [int(h) for h in re.findall(r"Cache hit rate: [\d.]+% \((\d+) hit", text)]
    assert sum(hits) == 3 * 112  # what MAX's scheduler logged for these requests
    assert "Input Tokens: 32/32 toks" in text  # the first prompt ran in chunks of 32


@pytest.mark.serve
def test_max_serve_logprobs_equal_transformers(max_server: Server) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The quick brown fox"
    status, body = complete(max_server, prompt, max_tokens=4, logprobs=2)
    assert status == 200, body
    logprobs = body["choices"][0]["logprobs"]
    tokenizer = AutoTokenizer.from_pretrained(str(max_server.model))
    model = AutoModelForCausalLM.from_pretrained(str(max_server.model), dtype=torch.float32)
    ids = tokenizer(prompt).input_ids
    for step in range(4):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        expected = torch.log_softmax(logits, -1)
        top = torch.topk(expected, 2)
        token = int(top.indices[0])
        assert logprobs["token_logprobs"][step] == pytest.approx(float(top.values[0]), abs=1e-3)
        got = sorted(logprobs["top_logprobs"][step].values(), reverse=True)
        assert got == pytest.approx([float(v) for v in top.values], abs=1e-3)
        assert tokenizer.decode([token]) in logprobs["top_logprobs"][step]
        ids.append(token)


@pytest.mark.serve
def test_max_serve_aborted_streams_free_their_pages(max_server: Server) -> None:
    """100 streamed requests dropped by their clients after the first chunk: every
    page comes back and the server keeps serving."""
    import httpx

    start = max_server.events.stat().st_size if max_server.events.exists() else 0

    def abort(i: int) -> bool:
        body = {
            "model": str(max_server.model),
            "prompt": f"request {i}: " + SHARED[: 20 + i % 40],
            "max_tokens": 100,
            "temperature": 0,
            "stream": True,
        }
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{max_server.url}/v1/completions", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: "):
                    return True  # leaving the block closes the connection mid-stream
        return False

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(abort, range(100)))
    logged = settled_events(max_server, start, timeout=120)
    kinds = [e["event"] for e in logged]
    assert kinds.count("alloc") == kinds.count("release") >= 100
    assert logged[-1]["free"] == logged[-1]["total"]  # no page leaked
    status, body = complete(max_server, "hello world")
    assert status == 200
    assert body["choices"][0]["text"] == transformers_completion(
        max_server.model, "hello world", NEW_TOKENS
    )


@pytest.mark.serve
@pytest.mark.redis
def test_max_serve_replicas_share_signed_prefixes_through_redis_and_refuse_forgeries(
    tiny_llama_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    """A second server pointed at the first's Redis (MAXKV_REDIS_URL, the same
    MAXKV_TIER_SECRET) starts with the shared prefix: its first request loads 7 pages
    instead of computing them.  Then every stored block is rewritten with another
    block's payload (CRC-32s recomputed): a third server uses none of them, says so,
    and answers the same text."""
    import redis

    env = {"MAXKV_REDIS_URL": redis_server.url, "MAXKV_TIER_SECRET": "serve-test-secret-0123"}
    client = redis.Redis.from_url(redis_server.url)
    first_prompt, second_prompt = SHARED + "Hi?", SHARED + "What is 2+2?"
    for name in "abc":
        (tmp_path / name).mkdir()
    with running_server(tiny_llama_dir, tmp_path / "a", env) as first:
        status, body = complete(first, first_prompt)
        assert status == 200, body
        deadline = time.monotonic() + 60  # the store's thread writes the pages
        while sum(b"#" not in k for k in client.keys("maxkv@*")) < 7:
            assert time.monotonic() < deadline, "the first server wrote nothing to Redis"
            time.sleep(0.2)
    expected = transformers_completion(tiny_llama_dir, second_prompt, NEW_TOKENS)
    with running_server(tiny_llama_dir, tmp_path / "b", env) as second:
        status, body = complete(second, second_prompt)
        assert status == 200, body
        assert body["choices"][0]["text"] == expected
        allocs = [e for e in settled_events(second, 0) if e["event"] == "alloc"]
        assert allocs[0]["cached_prefix"] == 112  # nothing on this server's device before
        log = second.log.read_text()
        assert "KV tiers: host 1.0 GiB, Redis redis://127.0.0.1" in log
        assert "blocks signed (key " in log and "serve-test-secret" not in log

    assert forge_every_block(client, "maxkv@") >= 7
    with running_server(tiny_llama_dir, tmp_path / "c", env) as third:
        status, body = complete(third, second_prompt)
        assert status == 200, body
        assert body["choices"][0]["text"] == expected
        allocs = [e for e in settled_events(third, 0) if e["event"] == "alloc"]
        assert allocs[0]["cached_prefix"] == 0  # the forged first page ends the prefix
        log = third.log.read_text()
        assert "dropped block" in log and "signature: the MAC does not verify" in log


@pytest.mark.serve
@pytest.mark.redis
@pytest.mark.sweep  # layer groups through Redis: tests/test_families.py (two processes)
def test_max_serve_gemma3_replicas_share_every_layer_groups_prefix_through_redis(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Gemma 3 (a random checkpoint) on the hybrid cache: a first server writes both
    layer groups' pages to a signed Redis; a second server starts with them, loads
    the prompt's prefix (the sliding group its window's pages) and answers
    transformers' text."""
    import redis
    from transformers import AutoTokenizer

    requires_transformers()
    from .pipeline_helpers import make_tiny_family_dir

    directory = make_tiny_family_dir(tmp_path_factory.mktemp("gemma3-redis"), "gemma3", seed=3)
    ids = AutoTokenizer.from_pretrained(str(directory))(LONG_PROMPT)["input_ids"]
    pages = (len(ids) - 1) // 16
    assert pages * 16 > 128  # past the sliding layers' window
    env = {"MAXKV_REDIS_URL": redis_server.url, "MAXKV_TIER_SECRET": "gemma3-serve-secret-01"}
    client = redis.Redis.from_url(redis_server.url)
    expected = transformers_completion(directory, LONG_PROMPT, NEW_TOKENS)
    for name in "ab":
        (tmp_path / name).mkdir()
    with running_server(directory, tmp_path / "a", env) as first:
        status, body = complete(first, LONG_PROMPT)
        assert status == 200, body
        assert body["choices"][0]["text"] == expected
        deadline = time.monotonic() + 60  # the stores' threads write both groups' pages
        while sum(b"#" not in k for k in client.keys("maxkv@*")) < 2 * pages:
            assert time.monotonic() < deadline, "the first server did not write both groups"
            time.sleep(0.2)
    with running_server(directory, tmp_path / "b", env) as second:
        status, body = complete(second, LONG_PROMPT)
        assert status == 200, body
        assert body["choices"][0]["text"] == expected
        allocs = [e for e in settled_events(second, 0) if e["event"] == "alloc"]
        assert allocs[0]["cached_prefix"] == pages * 16  # nothing on this server's device
        log = second.log.read_text()
        assert "hybrid paged cache" in log and "(per group, 2 groups)" in log
        assert "Redis redis://127.0.0.1" in log and "gemma3-serve-secret" not in log


@pytest.mark.unit
def test_redis_tier_without_a_secret_refuses_to_start() -> None:
    from maxkv.tiers import TierConfig

    with pytest.raises(ValueError, match="MAXKV_TIER_SECRET"):
        TierConfig.from_env("m", {"MAXKV_REDIS_URL": "redis://127.0.0.1:1/0"})
