"""CacheBlend (``maxkv.blend``): executor, store, retriever, RoPE re-rotation and the
blended prefill on the real model.

The re-rotation is checked against computing K at the new positions directly;
``recompute_ratio=1.0`` must reproduce a full prefill token for token.  The
executor's selection is checked on hand-made arrays, against its definition.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from max.driver import CPU
from max.engine import InferenceSession

from maxkv.blend import (
    CacheBlendExecutor,
    CacheBlendRetriever,
    ChunkKVStore,
    rerotate_numpy,
    rouge_l,
    token_f1,
)
from maxkv.models.resolve import LoadedModel

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------- no compiles


@pytest.mark.unit
def test_metrics() -> None:
    assert token_f1([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_f1([1, 2], [3, 4]) == 0.0
    assert token_f1([1, 2, 2], [2, 5]) == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert rouge_l([1, 2, 3, 4], [1, 3, 4]) == pytest.approx(2 * (3 / 4) * 1 / (3 / 4 + 1))
    assert rouge_l([], []) == 1.0 and rouge_l([1], []) == 0.0


@pytest.mark.unit
def test_executor_selects_most_deviating_and_scatters_later_layers() -> None:
    rng = np.random.default_rng(0)
    n, heads, kv_heads, dim = 10, 2, 1, 4
    positions = np.arange(n, dtype=np.int64)
    valid = np.array([True] * 8 + [False] * 2)  # the last two tokens: the question
    retrieved = rng.standard_normal((n, kv_heads, dim)).astype(np.float32)
    retrieved_v = rng.standard_normal((n, kv_heads, dim)).astype(np.float32)
    identity = lambda k, a, b: k  # noqa: E731 (positions unchanged here)
    executor = CacheBlendExecutor(identity, recompute_ratio=0.25, check_layers=[1])
    starts = np.array([0, n])

    def fresh(rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            rng.standard_normal((rows, heads, dim)).astype(np.float32),
            rng.standard_normal((rows, kv_heads, dim)).astype(np.float32),
            rng.standard_normal((rows, kv_heads, dim)).astype(np.float32),
        )

    q, k, v = fresh(n)
    out = executor.blend(0, retrieved, retrieved_v, valid, positions, q, k, v, positions, starts, 0)
    assert out.query_start_loc is None and out.k is k and len(out.q) == n  # before the check

    q, k, v = fresh(n)
    k[3] = retrieved[3] + 5.0  # the two most deviating valid tokens
    k[6] = retrieved[6] - 4.0
    for i in (0, 1, 2, 4, 5, 7):
        k[i] = retrieved[i] + 0.01
    out = executor.blend(1, retrieved, retrieved_v, valid, positions, q, k, v, positions, starts, 0)
    # ceil(0.25 * 8) = 2 valid tokens, plus both invalid ones, in order.
    np.testing.assert_array_equal(out.local_indices, [3, 6, 8, 9])
    np.testing.assert_array_equal(out.positions, [3, 6, 8, 9])
    np.testing.assert_array_equal(out.q, q[[3, 6, 8, 9]])
    np.testing.assert_array_equal(out.query_start_loc, [0, 4])
    np.testing.assert_array_equal(out.k, k)  # the check layer keeps its fresh K/V

    q, k, v = fresh(4)
    sel = out.positions
    out = executor.blend(
        2, retrieved, retrieved_v, valid, positions, q, k, v, sel, out.query_start_loc, 0
    )
    expected_k = retrieved.copy()
    expected_k[[3, 6, 8, 9]] = k
    np.testing.assert_array_equal(out.k, expected_k)
    expected_v = retrieved_v.copy()
    expected_v[[3, 6, 8, 9]] = v
    np.testing.assert_array_equal(out.v, expected_v)

    with pytest.raises(ValueError, match="recompute_ratio"):
        CacheBlendExecutor(identity, recompute_ratio=1.5)


class _FakePrefill:
    """Stands in for BlendedPrefill: K/V of token t at layer l is (l, t, position)."""

    config = SimpleNamespace(num_hidden_layers=2)
    graphs = SimpleNamespace(shapes={"rope.freqs_cis": (4096, 3)})  # RoPE table rows
    calls = 0

    def kv(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        type(self).calls += 1
        n = len(tokens)
        k = np.zeros((2, n, 1, 3), dtype=np.float32)
        for layer in range(2):
            k[layer, :, 0, 0] = layer
            k[layer, :, 0, 1] = tokens
            k[layer, :, 0, 2] = np.arange(n)
        return k, -k


@pytest.mark.unit
def test_store_on_disk_survives_a_restart_and_retriever_marks_segments(tmp_path: Path) -> None:
    fake = _FakePrefill()
    store = ChunkKVStore(fake, tmp_path)  # type: ignore[arg-type]
    header, chunk_a, chunk_b = [7, 8], [11, 12, 13], [21, 22]
    store.store(header)
    key_a = store.store(chunk_a, context=header)
    assert store.store(chunk_a, context=header) == key_a and fake.calls == 2  # kept: no prefill
    assert key_a != store.key(chunk_a)  # the context is part of the key
    assert not list(tmp_path.glob("*.tmp"))  # written atomically: no leftovers

    restarted = ChunkKVStore(_FakePrefill(), tmp_path)  # type: ignore[arg-type]
    k, _, start = restarted.get(key_a)  # type: ignore[misc]
    assert start == 2 and k.shape == (2, 3, 1, 3)
    np.testing.assert_array_equal(k[1, :, 0, 2], [2, 3, 4])  # positions after the header

    question = [99, 98]
    prompt = np.array(header + chunk_b + chunk_a + question)
    task = CacheBlendRetriever(restarted, context=header).new_request([prompt], [[0, 2, 4, 7]])
    np.testing.assert_array_equal(task.valid_mask, [1, 1, 0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(task.original_positions, [0, 1, 0, 0, 2, 3, 4, 0, 0])
    result = task.result(1)
    assert result.k is not None
    np.testing.assert_array_equal(result.k[4:7, 0, 1], chunk_a)
    with pytest.raises(ValueError, match="outside a prompt"):
        CacheBlendRetriever(restarted).new_request([prompt], [[0, 20]])


@pytest.mark.unit
def test_rerotate_numpy_composes_rotations() -> None:
    rotate = rerotate_numpy(10000.0)
    k = np.random.default_rng(1).standard_normal((5, 2, 8)).astype(np.float32)
    a, b, c = np.arange(5), np.arange(5) + 7, np.arange(5) + 30
    np.testing.assert_allclose(rotate(rotate(k, a, b), b, c), rotate(k, a, c), atol=1e-5)
    np.testing.assert_allclose(rotate(rotate(k, a, c), c, a), k, atol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--recompute-ratio", "2", "--recompute-ratio must be in [0, 1]"),
        ("--questions", "-1", "--questions must be >= 1"),
    ],
)
def test_example_refuses_bad_options(option: str, value: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cacheblend_rag.py"), option, value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {message}"


# ------------------------------------------------------------ the real model


@pytest.fixture(scope="session")
def rag_runner(smollm2: LoadedModel, session: InferenceSession):  # type: ignore[no-untyped-def]
    from maxkv.blend.rag import RagRunner

    return RagRunner(smollm2, session, CPU(), max_seq_len=1024, prefix_slots=4)


@pytest.mark.compile
def test_rerotation_equals_rope_at_the_new_positions(rag_runner) -> None:  # type: ignore[no-untyped-def]
    prefill = rag_runner.prefill
    rng = np.random.default_rng(2)
    h = rng.standard_normal((12, prefill.config.hidden_size)).astype(np.float32)
    original = np.arange(12, dtype=np.int64) + 3
    new = np.arange(12, dtype=np.int64) + 517
    _, k_original, _ = prefill.graphs.qkv(prefill.weights, 5, h, original)
    _, k_new, _ = prefill.graphs.qkv(prefill.weights, 5, h, new)
    moved = prefill.rerotate(k_original, original, new)
    np.testing.assert_allclose(moved, k_new, atol=1e-5, rtol=0)
    # The NumPy re-rotation agrees with the graph.
    np.testing.assert_allclose(
        rerotate_numpy(prefill.config.rope_theta)(k_original, original, new), moved, atol=1e-5
    )


@pytest.mark.model
def test_blend_after_a_cached_prefix_equals_full_prefill_at_ratio_one(
    rag_runner, session: InferenceSession, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A blended prefill from ``start`` > 0 (what ``max serve`` runs after a prefix-cache
    hit) attends to the cached tokens: at ratio 1.0, with chunks retrieved from other
    positions, its logits and cache rows equal a full prefill's.  Queries tiled
    through the attention graph (a long prompt) give the same rows."""
    from maxkv import PagedKVCacheManager
    from maxkv.blend import graphs as blend_graphs
    from maxkv.blend.store import CacheBlendRetrieverTask
    from maxkv.models.decoder import cache_params

    prefill = rag_runner.prefill
    c = prefill.config
    m = PagedKVCacheManager(cache_params(c), 16, 64, 4, 512, c.num_hidden_layers, [CPU()], session)
    tokens = np.random.default_rng(5).integers(10, 40000, 300)
    (full,) = m.claim(1)
    expected = prefill.prefill(tokens, None, None, m, full)
    # Two chunks after a 40-token prefix; their K/V as computed at other positions.
    k, v = prefill.kv(np.concatenate([tokens[100:300], tokens[40:100]]))
    segments = [(60, 200, (k[:, :200], v[:, :200], 0))]  # tokens[100:300]
    segments.append((0, 60, (k[:, 200:], v[:, 200:], 200)))  # tokens[40:100]
    task = CacheBlendRetrieverTask(segments, 260)
    (split,) = m.claim(1)
    prefill.prefill(tokens[:40], None, None, m, split)
    got = prefill.prefill(tokens, task, prefill.executor(1.0, (1,)), m, split, start=40)
    np.testing.assert_allclose(got, expected, atol=2e-3, rtol=0)
    np.testing.assert_allclose(
        m.read_tokens(split, 0, 300), m.read_tokens(full, 0, 300), atol=2e-3, rtol=0
    )
    # Tiled queries: the same layer output.
    rng = np.random.default_rng(6)
    h = rng.standard_normal((50, c.hidden_size)).astype(np.float32)
    q = rng.standard_normal((50, c.num_attention_heads, c.head_dim)).astype(np.float32)
    kk = rng.standard_normal((80, c.num_key_value_heads, c.head_dim)).astype(np.float32)
    positions = np.arange(30, 80, dtype=np.int64)
    whole = prefill.graphs.attention_mlp(prefill.weights, 3, h, q, positions, kk, kk)
    monkeypatch.setattr(blend_graphs, "SCORE_BYTES", 4 * c.num_attention_heads * 80 * 7)
    tiled = prefill.graphs.attention_mlp(prefill.weights, 3, h, q, positions, kk, kk)
    np.testing.assert_allclose(tiled, whole, atol=1e-5, rtol=0)


@pytest.mark.model
def test_blend_at_ratio_one_equals_full_prefill(rag_runner, smollm2: LoadedModel) -> None:  # type: ignore[no-untyped-def]
    from maxkv.blend.rag import build_rag_prompt

    corpus = json.loads((ROOT / "examples" / "data" / "rag_corpus.json").read_text())
    for q in corpus["questions"][:2]:
        chunks = [corpus["chunks"][c] for c in q["chunks"][:3]]
        prompt = build_rag_prompt(smollm2, chunks, q["question"])
        rag_runner.store_segments(prompt)
        full = rag_runner.full(prompt, 12)
        blend = rag_runner.blend(prompt, 12, recompute_ratio=1.0)
        assert blend.tokens == full.tokens
        assert blend.reused_tokens == len(prompt.tokens) - len(prompt.segments[-1])
        partial = rag_runner.blend(prompt, 4, recompute_ratio=0.15)
        computed = rag_runner.prefill.tokens_per_layer
        # Layer 0 computes every token; from the check layer (1) on, Q holds about 15% of
        # the retrieved tokens plus the question.
        assert computed[0] == len(prompt.tokens)
        assert computed[1] == computed[-1] < 0.3 * len(prompt.tokens)
        assert len(partial.tokens) >= 1
    assert rag_runner.manager.slots_remaining == 2  # every slot released


@pytest.mark.unit
def test_chunk_store_shares_chunks_through_redis_and_refuses_other_models() -> None:
    import fakeredis

    from maxkv.tiers import TierConfig

    client = fakeredis.FakeRedis()
    config = TierConfig(
        model_id="fake", redis_url="redis://fake:0/0", redis_client=client, secret="s" * 16
    )
    first = ChunkKVStore(_FakePrefill(), tiers=config)  # type: ignore[arg-type]
    key = first.store([5, 6, 7])
    first.close()
    other_process = ChunkKVStore(_FakePrefill(), tiers=config)  # type: ignore[arg-type]
    calls = _FakePrefill.calls
    k, v, start = other_process.get(key)  # type: ignore[misc]
    np.testing.assert_array_equal(k[1, :, 0, 1], [5, 6, 7])
    np.testing.assert_array_equal(v, -k)
    assert start == 0 and _FakePrefill.calls == calls  # read, not recomputed
    assert other_process.tiers.stats.redis_hits == 1
    other_model = TierConfig(
        model_id="another", redis_url="redis://fake:0/0", redis_client=client, secret="s" * 16
    )
    assert ChunkKVStore(_FakePrefill(), tiers=other_model).get(key) is None  # type: ignore[arg-type]
