"""CacheBlend in ``max serve`` (``MAXKV_BLEND=1``): settings, prompt splitting, the
paged cache's approximate KV, and real servers sharing chunks through Redis."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import RedisServer
from .pipeline_helpers import Server, complete, running_server, settled_events

pytest.importorskip("max.pipelines.lib")

from max.pipelines.context.exceptions import InputError

from maxkv.serving.pipelines.blending import (
    BlendConfig,
    checked_starts,
    piece_starts,
    split_prompt,
)

SEP = " # # "


@pytest.mark.unit
def test_blend_settings_come_from_the_environment() -> None:
    assert BlendConfig.from_env({}) is None
    assert BlendConfig.from_env({"MAXKV_BLEND": "0"}) is None
    config = BlendConfig.from_env({"MAXKV_BLEND": "1"})
    assert config == BlendConfig(" # # ", 0.15, (1,), 64, 1, "request")
    config = BlendConfig.from_env(
        {
            "MAXKV_BLEND": "1",
            "MAXKV_BLEND_SEPARATOR": "<sep>",
            "MAXKV_BLEND_RECOMPUTE_RATIO": "0.3",
            "MAXKV_BLEND_CHECK_LAYERS": "1,3",
            "MAXKV_BLEND_MIN_TOKENS": "0",
            "MAXKV_BLEND_MAX_PER_BATCH": "2",
            "MAXKV_BLEND_CHUNK_CONTEXT": "none",
        }
    )
    assert config == BlendConfig("<sep>", 0.3, (1, 3), 0, 2, "none")
    for env, match in [
        ({"MAXKV_BLEND": "maybe"}, "MAXKV_BLEND="),
        ({"MAXKV_BLEND": "1", "MAXKV_BLEND_SEPARATOR": ""}, "MAXKV_BLEND_SEPARATOR=''"),
        ({"MAXKV_BLEND": "1", "MAXKV_BLEND_RECOMPUTE_RATIO": "1.5"}, "RATIO"),
        ({"MAXKV_BLEND": "1", "MAXKV_BLEND_RECOMPUTE_RATIO": "x"}, "expected a number"),
        ({"MAXKV_BLEND": "1", "MAXKV_BLEND_CHECK_LAYERS": "a"}, "layer ids"),
        ({"MAXKV_BLEND": "1", "MAXKV_BLEND_CHECK_LAYERS": "-1"}, "layer ids"),
        ({"MAXKV_BLEND": "1", "MAXKV_BLEND_MIN_TOKENS": "-3"}, "MIN_TOKENS"),
        ({"MAXKV_BLEND": "1", "MAXKV_BLEND_MAX_PER_BATCH": "0"}, "MAX_PER_BATCH"),
        ({"MAXKV_BLEND": "1", "MAXKV_BLEND_CHUNK_CONTEXT": "header"}, "CHUNK_CONTEXT"),
    ]:
        with pytest.raises(ValueError, match=match):
            BlendConfig.from_env(env)


@pytest.mark.unit
def test_prompts_split_at_the_separator() -> None:
    assert split_prompt("no chunks here", SEP) == ["no chunks here"]
    assert split_prompt(f"sys{SEP}a{SEP}b{SEP}q?", SEP) == ["sys", "a", "b", "q?"]
    assert split_prompt(f"{SEP}a{SEP}q", SEP) == ["", "a", "q"]  # no prefix: allowed
    with pytest.raises(InputError, match="chunk 2 of the prompt is empty"):
        split_prompt(f"sys{SEP}a{SEP}  {SEP}q", SEP)
    with pytest.raises(InputError, match="ends with the blend separator"):
        split_prompt(f"sys{SEP}a{SEP}", SEP)
    assert piece_starts([3, 5, 7, 2]) == [3, 8, 15]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("starts", "length", "expected"),
    [
        ([3, 8, 15], 17, [3, 8, 15]),
        ([0, 8, 15], 17, [0, 8, 15]),  # a prompt that starts with a chunk
        ([3, 8, 17], 17, None),  # the suffix would be empty
        ([3, 3, 15], 17, None),  # an empty chunk
        ([8, 3, 15], 17, None),
        ([3], 17, None),  # no chunk
        ([-1, 8], 17, None),
        ([3, True], 17, None),
        ("3,8", 17, None),
        (None, 17, None),
    ],
)
def test_chunk_starts_from_the_context_are_checked(
    starts: object, length: int, expected: list[int] | None
) -> None:
    assert checked_starts(starts, length) == expected


@pytest.mark.unit
def test_blended_pages_never_enter_the_prefix_cache(session: object) -> None:
    """Pages holding approximate KV (approximate_from) are not registered, those before
    it are; forks and swaps keep the mark; read_tokens returns the pages' rows."""
    from max.driver import CPU
    from max.dtype import DType

    from maxkv import PagedKVCacheManager
    from maxkv.cache.params import KVCacheParams

    params = KVCacheParams(dtype=DType.float32, n_kv_heads=2, head_dim=4)
    m = PagedKVCacheManager(
        params,
        4,
        16,
        4,
        64,
        2,
        [CPU()],
        session,
        enable_prefix_caching=True,  # type: ignore[arg-type]
    )
    tokens = list(range(100, 114))
    (seq,) = m.claim(1)
    m.approximate_from(seq, 6)
    m.fetch([seq], active_lengths=[14])
    m.step({seq: 14}, tokens={seq: tokens})
    assert m.cached_prefix_length([*tokens, 1]) == 4  # the page [0, 4) only
    child = m.claim(1)[0]
    m.release(child)
    forked = m.fork(seq, 12)
    m.fetch([forked], active_lengths=[4])
    m.step({forked: 4}, tokens={forked: [7, 7, 7, 7]})
    assert m.cached_prefix_length([*tokens[:12], 7, 7, 7, 7, 1]) == 4
    # Rows come back as written: write a pattern through the page buffer, read it.
    view = m._pages[0].to_numpy()
    pages = m.pages(seq)
    for i in range(14):
        view[pages[i // 4], :, :, i % 4] = i
    rows = m.read_tokens(seq, 3, 11)
    assert rows.shape == (2, 2, 8, 2, 4)
    np.testing.assert_array_equal(rows[0, 1, :, 0, 0], np.arange(3, 11))
    with pytest.raises(ValueError, match="outside"):
        m.read_tokens(seq, 10, 15)
    swapped = m.swap_out(seq)
    again = m.swap_in(swapped)
    m.fetch([again], active_lengths=[2])
    m.step({again: 2}, tokens={again: [5, 5]})
    assert m.cached_prefix_length([*tokens, 5, 5, 1]) == 4


# --------------------------------------------------------------- max serve

PREFIX = "Notes:"
CHUNKS = [
    "Ann has a red kite and a blue ball.",
    "Bo likes green tea in the morning.",
    "The boat leaves at nine from pier six.",
    "Cy reads a long book at noon.",  # only the second server sees it
]
QUESTION = "Q: who has a kite? A:"
NEW = 12


def blend_prompt(order: list[int]) -> str:
    return SEP.join([PREFIX, *(CHUNKS[i] for i in order), QUESTION])


def pieces_ids(directory: Path, order: list[int]) -> list[int]:
    """The token ids a blending server feeds the model: each piece on its own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    ids = tokenizer(PREFIX).input_ids
    for piece in [*(CHUNKS[i] for i in order), QUESTION]:
        ids += tokenizer(piece, add_special_tokens=False).input_ids
    return list(ids)


def greedy_text(directory: Path, ids: list[int], steps: int) -> str:
    """transformers' greedy continuation of ``ids`` (float32), decoded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=0,
        )
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def blend_lines(log: str) -> list[dict[str, int]]:
    """The counters of every ``maxkv blend:`` line of a server log."""
    pattern = re.compile(
        r"maxkv blend: (\d+) requests with chunks, (\d+) blended \| chunk lookups (\d+), "
        r"hits (\d+) \| tokens reused (\d+), recomputed (\d+) \| chunks stored (\d+) .*?"
        r"hits host (\d+) / disk (\d+) / redis (\d+)"
    )
    names = (
        "requests blended lookups hits reused recomputed stored host_hits disk_hits redis_hits"
    ).split()
    return [dict(zip(names, map(int, m.groups()), strict=True)) for m in pattern.finditer(log)]


def totals(log: str) -> dict[str, int]:
    lines = blend_lines(log)
    return {k: sum(line[k] for line in lines) for k in (lines[0] if lines else {})}


def wait_for(predicate: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def chunk_keys(directory: Path, server: RedisServer) -> object:
    """A function listing the Redis keys of the tiny Llama's chunk store."""
    import redis

    from maxkv.serving.pipelines.model import model_identity
    from maxkv.tiers.blocks import BlockLayout

    layout = BlockLayout(
        model_id=model_identity(directory),
        kind="chunk",
        num_layers=2,
        n_kv_heads=2,
        head_dim=16,
        dtype="float32",
    )
    client = redis.Redis.from_url(server.url)
    return lambda: [k for k in client.keys(f"maxkv@{layout.fingerprint}@*") if b"#" not in k]


@pytest.mark.serve
@pytest.mark.redis
def test_max_serve_blends_chunks_in_any_order_and_replicas_share_them_through_redis(
    tiny_llama_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    """A server with MAXKV_BLEND=1 (recompute ratio 1.0: the blended prefill then
    equals a full one, so the text can be checked against transformers) stores
    the chunks of a first request and blends them into a second that has them in
    another order; a request of another tenant (cache_salt) finds none of them;
    malformed requests get a 400 and leave no page behind.  A second server on
    the same Redis, storing new chunks alone (MAXKV_BLEND_CHUNK_CONTEXT=none),
    blends the chunks the first computed and a chunk it never saw before."""
    env = {
        "MAXKV_BLEND": "1",
        "MAXKV_BLEND_RECOMPUTE_RATIO": "1.0",
        "MAXKV_BLEND_MIN_TOKENS": "16",
        "MAXKV_REDIS_URL": redis_server.url,
        "MAXKV_TIER_SECRET": "blend-test-secret-0123",
        "MAX_SERVE_USE_CLIENT_CACHE_SALT": "1",
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with running_server(tiny_llama_dir, tmp_path / "a", env) as first:
        status, body = complete(first, blend_prompt([0, 1, 2]), max_tokens=NEW)
        assert status == 200, body
        expected = greedy_text(tiny_llama_dir, pieces_ids(tiny_llama_dir, [0, 1, 2]), NEW)
        assert body["choices"][0]["text"] == expected
        wait_for(lambda: totals(first.log.read_text()).get("stored", 0) >= 3, "no chunk stored")
        counts = totals(first.log.read_text())
        assert counts["blended"] == 0 and counts["hits"] == 0

        status, body = complete(first, blend_prompt([2, 0, 1]), max_tokens=NEW)
        assert status == 200, body
        expected = greedy_text(tiny_llama_dir, pieces_ids(tiny_llama_dir, [2, 0, 1]), NEW)
        assert body["choices"][0]["text"] == expected
        wait_for(lambda: totals(first.log.read_text()).get("blended", 0) >= 1, "nothing blended")
        counts = totals(first.log.read_text())
        assert counts["hits"] >= 3 and counts["reused"] >= sum(len(c) for c in CHUNKS[:3]) - 16

        # Another tenant finds none of those chunks (and stores its own).
        status, body = complete(first, blend_prompt([1, 0]), max_tokens=NEW, cache_salt="b")
        assert status == 200, body
        wait_for(lambda: totals(first.log.read_text()).get("lookups", 0) >= 8, "no lookup logged")
        assert totals(first.log.read_text())["hits"] == counts["hits"]

        # Malformed use: a clear 400, and the server serves on.
        for prompt, message in [
            (f"{PREFIX}{SEP}{CHUNKS[0]}{SEP}", "ends with the blend separator"),
            (f"{PREFIX}{SEP}{CHUNKS[0]}{SEP} {SEP}{QUESTION}", "is empty"),
            (f"{PREFIX}{SEP}{'x' * 300}{SEP}{QUESTION}", "max"),  # past --max-length 256
        ]:
            status, body = complete(first, prompt, max_tokens=NEW)
            assert status == 400, body
            assert message in str(body).lower(), body
        status, body = complete(first, blend_prompt([1, 2]), max_tokens=NEW)
        assert status == 200, body
        events = settled_events(first, 0)
        allocs = [e for e in events if e["event"] == "alloc"]
        releases = [e for e in events if e["event"] == "release"]
        assert len(allocs) == len(releases) == 4
        assert releases[-1]["free"] == releases[-1]["total"]  # every page came back
        assert "chunk store blocks signed" in first.log.read_text()
        chunks_in_redis = chunk_keys(tiny_llama_dir, redis_server)
        wait_for(lambda: len(chunks_in_redis()) >= 3, "the chunks did not reach Redis")  # type: ignore[operator]

    alone = {**env, "MAXKV_BLEND_CHUNK_CONTEXT": "none"}
    with running_server(tiny_llama_dir, tmp_path / "b", alone) as second:
        status, body = complete(second, blend_prompt([1, 0]), max_tokens=NEW)
        assert status == 200, body
        expected = greedy_text(tiny_llama_dir, pieces_ids(tiny_llama_dir, [1, 0]), NEW)
        assert body["choices"][0]["text"] == expected
        wait_for(lambda: totals(second.log.read_text()).get("blended", 0) >= 1, "not blended")
        counts = totals(second.log.read_text())
        assert counts["redis_hits"] >= 2 and counts["stored"] == 0
        # A chunk nobody stored: computed alone at admission, and blended at once.
        status, body = complete(second, blend_prompt([3, 2]), max_tokens=NEW)
        assert status == 200, body
        expected = greedy_text(tiny_llama_dir, pieces_ids(tiny_llama_dir, [3, 2]), NEW)
        assert body["choices"][0]["text"] == expected
        wait_for(lambda: totals(second.log.read_text()).get("blended", 0) >= 2, "not blended")
        assert totals(second.log.read_text())["stored"] == 1
        assert "chunks stored as computed alone" in second.log.read_text()


CORPUS = Path(__file__).resolve().parent.parent / "examples" / "data" / "rag_corpus.json"
RAG_SYSTEM = "You answer questions about Brinsey Island from the passages the user gives."


def rag_messages(corpus: dict[str, Any], names: list[str], question: str) -> list[dict[str, str]]:
    pieces = ["Passages:\n\n", *(corpus["chunks"][n] + "\n\n" for n in names)]
    content = SEP.join(pieces) + SEP + f"Question: {question}"
    return [{"role": "system", "content": RAG_SYSTEM}, {"role": "user", "content": content}]


def chat_first_token(server: Server, messages: list[dict[str, str]]) -> tuple[int, str]:
    body = {"model": str(server.model), "messages": messages, "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(
        f"{server.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return response.status, str(answer["choices"][0]["message"]["content"])


#: The questions the test asks (of the corpus' 36): enough to catch a blend that
#: reads the wrong pages or positions, few enough for the suite.  The sweep over
#: all 36, in both chunk modes, is ``benchmarks/cacheblend_selection.py``'s.
RAG_QUESTIONS = 12


@pytest.mark.serve
@pytest.mark.sweep  # one more server (SmolLM2, blending); the blend itself: the test above
def test_max_serve_blended_first_tokens_match_full_prefill_on_the_rag_corpus(
    smollm2_hf_dir: Path, tmp_path: Path
) -> None:
    """SmolLM2 behind ``max serve`` with MAXKV_BLEND=1 (the default ratio 0.15,
    check layer 1 and chunks stored as computed in a request): two requests
    store the corpus' 10 passages, then each of its first 12 questions is
    blended from them, in its own order of passages.  Its first token equals
    transformers' greedy first token after the same token ids (full prefill,
    float32) on at least 11 of them (12 of 12 when last run; the chunk-alone
    mode is checked for exact text by the Redis test above)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = json.loads(CORPUS.read_text())
    names = sorted(corpus["chunks"])
    questions = corpus["questions"][:RAG_QUESTIONS]
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_hf_dir), dtype=torch.float32)
    env = {"MAXKV_BLEND": "1"}
    flags = ("--max-length", "2048", "--max-batch-input-tokens", "8192")
    with running_server(smollm2_hf_dir, tmp_path, env, flags=flags) as server:
        for half in (names[:5], names[5:]):  # the store gets every passage
            status, _ = chat_first_token(server, rag_messages(corpus, half, "Hello?"))
            assert status == 200
        same = []
        for q in questions:
            messages = rag_messages(corpus, q["chunks"], q["question"])
            status, first = chat_first_token(server, messages)
            assert status == 200
            text = str(
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            )
            pieces = text.split(SEP)
            ids = [
                t for piece in pieces for t in tokenizer(piece, add_special_tokens=False).input_ids
            ]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            same.append(tokenizer.decode([int(logits.argmax())]) == first)
        counts = totals(server.log.read_text())
    print(f"blended first tokens equal to full prefill's: {sum(same)}/{len(same)}: {same}")
    assert counts["blended"] >= len(questions) and counts["hits"] >= len(questions) * 4
    assert sum(same) >= len(questions) - 1, f"{sum(same)} of {len(questions)}"
