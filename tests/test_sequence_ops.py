"""Sequence operations: fork, pop_n and prefix caching (contiguous; paged on the real model).

Copies are checked byte for byte against the slots written through NumPy
(the blocks of a CPU manager are host memory); a forked child's attention
against its parent's and a NumPy reference; prefix caching and rewinding on
the real model against greedy decoding without them and against transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

import maxkv
from maxkv import (
    ContinuousBatchingKVCacheManager,
    FetchContinuousBatchingKVCacheCollection,
    PagedKVCacheManager,
)
from maxkv.cache.prefix import PrefixIndex
from maxkv.cache.protocol import KVCacheManagerBase
from maxkv.models import DecoderModel
from maxkv.models.decoder import cache_params
from maxkv.models.resolve import LoadedModel
from maxkv.serving.scheduler import ContinuousBatchingScheduler

from . import reference
from .conftest import requires_transformers, smollm2_manager

Make = Callable[..., ContinuousBatchingKVCacheManager]
SENTINEL = -7.0


def blocks(manager: ContinuousBatchingKVCacheManager) -> np.ndarray:
    """The device-0 blocks as a writable NumPy view (CPU)."""
    return manager._blocks[0].to_numpy()


def fill(manager: ContinuousBatchingKVCacheManager, slot: int, length: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    view = blocks(manager)
    view[slot, :, :, :length] = rng.standard_normal(view[slot, :, :, :length].shape)


# ------------------------------------------------------------------ fork


@pytest.mark.compile
def test_fork_copies_the_parent_prefix_on_every_layer(make_device_manager: Make) -> None:
    manager = make_device_manager(num_layers=3, max_seq_len=16)
    view = blocks(manager)
    view[:] = SENTINEL
    (parent,) = manager.claim(1)
    fill(manager, parent, 10, seed=1)
    manager.step({parent: 10})
    before = view[parent].copy()

    child = manager.fork(parent, 6)
    assert child != parent and manager.cache_lengths == {parent: 10, child: 6}
    np.testing.assert_array_equal(view[child, :, :, :6], before[:, :, :6])
    assert (view[child, :, :, 6:] == SENTINEL).all(), "nothing past fork_pos is written"
    np.testing.assert_array_equal(view[parent], before)  # the parent is unchanged

    whole = manager.fork(parent)  # default: every committed token
    assert manager.cache_lengths[whole] == 10
    np.testing.assert_array_equal(view[whole, :, :, :10], before[:, :, :10])
    untouched = [s for s in range(4) if s not in (parent, child, whole)]
    assert (view[untouched] == SENTINEL).all()
    empty = manager.fork(child, 0)
    assert manager.cache_lengths[empty] == 0 and manager.slots_remaining == 0


@pytest.mark.unit
def test_pop_n_and_fork_bad_input_changes_nothing(make_manager: Make) -> None:
    manager = make_manager(max_cache_batch_size=2)
    (a,) = manager.claim(1)
    manager.step({a: 5})
    snapshot = (dict(manager.cache_lengths), manager.slots_remaining)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: manager.fork(1), "not claimed"),
        (lambda: manager.fork(9), "out of range"),
        (lambda: manager.fork(a, 6), "fork_pos 6 is past seq_id 0's 5"),
        (lambda: manager.fork(a, -1), "fork_pos must be >= 0"),
        (lambda: manager.pop_n(a, 6), "cannot pop 6 tokens: seq_id 0 holds 5"),
        (lambda: manager.pop_n(a, 0), "n must be >= 1"),
        (lambda: manager.pop_n(1, 1), "not claimed"),
        (lambda: manager.step({a: 2}, tokens={a: [1]}), "1 token ids for 2 committed"),
        (lambda: manager.step({a: 1}, tokens={1: [1]}), "does not commit"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert (dict(manager.cache_lengths), manager.slots_remaining) == snapshot
    manager.claim(1)
    with pytest.raises(ValueError, match="no sequence can be claimed"):
        manager.fork(a)
    manager.pop_n(a, 5)
    assert manager.cache_lengths[a] == 0


@pytest.mark.compile
def test_forked_child_attends_like_its_parent(make_device_manager: Make, kernels: Path) -> None:
    manager = make_device_manager(num_layers=1, max_seq_len=16, n_kv_heads=2, head_dim=8)
    params = manager.params
    heads = 4
    (parent,) = manager.claim(1)
    fill(manager, parent, 9, seed=3)
    manager.step({parent: 9})
    child = manager.fork(parent)
    view = blocks(manager)
    view[child, :, :, 9] = view[parent, :, :, 9]  # the new token's K/V, as a step writes it

    ref = DeviceRef.CPU()
    types = [
        *manager.input_symbols()[0],
        TensorType(DType.float32, ["tokens", heads, params.head_dim], ref),
        TensorType(DType.uint32, ["offsets"], ref),
    ]
    with Graph("fork_attention", input_types=types, custom_extensions=[kernels]) as graph:
        *cache, q, offsets = (v.tensor for v in graph.inputs)
        kv = FetchContinuousBatchingKVCacheCollection(params)(*cache)
        graph.output(maxkv.ops.flash_attention_ragged(params, q, offsets, kv, 0))
    model = manager.session.load(graph)
    query = np.random.default_rng(4).standard_normal((1, heads, params.head_dim)).astype(np.float32)
    (inputs,) = manager.fetch([parent, child])
    (out,) = model.execute(
        *inputs,
        Buffer.from_numpy(np.concatenate([query, query])),
        Buffer.from_numpy(np.array([0, 1, 2], dtype=np.uint32)),
    )
    got = out.to_numpy()
    np.testing.assert_array_equal(got[0], got[1])
    expected = reference.attention(
        query, view[parent, 0, 0, :10], view[parent, 1, 0, :10], 9, True, params.head_dim**-0.5
    )
    np.testing.assert_allclose(got[0], expected[0], atol=1e-5)


# ------------------------------------------------------------------ prefix caching


@pytest.mark.unit
def test_prefix_index_chains_blocks_and_keeps_released_slots_lru() -> None:
    index = PrefixIndex(block_size=4)
    index.append(0, list(range(10)))
    index.append(1, [*range(6), 50, 51])
    assert index.longest_prefix(list(range(12)), {0, 1}) == (0, 10)
    assert index.longest_prefix([*range(6), 50, 51, 52], {0, 1}) == (1, 8)
    assert index.longest_prefix([*range(5)], {1}) == (1, 5)
    assert index.longest_prefix([9, 9], {0, 1}) == (None, 0)
    index.release(1)
    index.release(0)
    assert index.released_lru() == [1, 0]
    index.reuse(1)  # slot 1 taken by a new sequence: its two blocks are evicted
    assert index.stats.evictions == 2 and index.released_lru() == [0]
    index.truncate(0, 5)
    assert index.longest_prefix(list(range(12)), {0}) == (0, 5)
    index.copy(0, 2, 3)
    assert index.tokens(2) == [0, 1, 2]


@pytest.mark.compile
def test_claim_prefix_takes_released_slots_in_place_and_copies_live_ones(
    make_device_manager: Make,
) -> None:
    manager = make_device_manager(
        max_cache_batch_size=3, max_seq_len=32, enable_prefix_caching=True, prefix_block_size=4
    )
    view = blocks(manager)
    prompt = list(range(1, 13))
    a, cached = manager.claim_prefix(prompt)
    assert cached == 0
    fill(manager, a, 12, seed=5)
    with pytest.raises(ValueError, match="pass tokens= for seq_ids"):
        manager.step({a: 12})
    manager.step({a: 12}, tokens={a: prompt})

    b, cached = manager.claim_prefix([*prompt[:10], 99, 98])  # a is live: copied
    assert b != a and cached == 10 and manager.cache_lengths[b] == 10
    np.testing.assert_array_equal(view[b, :, :, :10], view[a, :, :, :10])
    c, cached = manager.claim_prefix(prompt)  # a whole match leaves one token to compute
    assert cached == 11
    manager.release(a)
    manager.release(c)
    d, cached = manager.claim_prefix([*prompt[:8], 7])  # a's KV is kept: taken in place
    assert cached == 8 and d in (a, c)
    stats = manager.prefix_cache_stats
    assert (stats.lookups, stats.hit_tokens) == (4, 10 + 11 + 8)
    (e,) = manager.claim(1)  # the last free slot held a released prefix: evicted
    assert manager.prefix_cache_stats.evictions >= 2
    assert manager.cached_prefix_length(prompt) == 10  # b (live) holds its first 10
    with pytest.raises(ValueError, match="all 3 slots are in use"):
        manager.claim_prefix(prompt)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        make_device_manager().claim_prefix(prompt)
    assert {b, d, e} == {0, 1, 2}


SYSTEM = (
    "You are a careful assistant for a small museum of natural history. "
    "Visitors ask about fossils, minerals, meteorites, birds, insects and the history of the "
    "building, which was a railway station until 1931. Answer in one or two short sentences, "
    "name the hall where a visitor can see what they ask about (the Fossil Hall, the Mineral "
    "Gallery, the Sky Room, the Bird Hall or the Insect Room), and never invent exhibits. "
    "Opening hours are nine to five from Tuesday to Sunday; the museum is closed on Mondays. "
    "Tickets cost eight euros for adults and nothing for children under twelve. The cafe is "
    "on the first floor next to the Bird Hall, and the gift shop is at the exit. Guided tours "
    "start every hour from the main entrance and last forty minutes. Photography without "
    "flash is allowed everywhere except in the Sky Room, where the light is kept low for the "
    "meteorite collection. If a visitor asks about anything else, say politely that you only "
    "know about the museum."
)


_paged_llama: dict[str, DecoderModel] = {}


@pytest.mark.model
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_prefix_caching_gives_the_same_tokens(
    cache: str, smollm2: LoadedModel, smollm2_llama: DecoderModel, session: InferenceSession
) -> None:
    """Contiguous: rows copied from the slot that holds the prefix; paged: pages of
    16 tokens shared by reference.  Either way the tokens of running without."""
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    questions = ["Where are the fossils?", "When is the museum open?", "Can I take photos?"]
    prompts = [tokenizer.encode_chat(q, system=SYSTEM) for q in questions]
    assert min(len(p) for p in prompts) > 200
    new_tokens = 10

    def manager_for(prefix_caching: bool) -> KVCacheManagerBase:
        if cache == "contiguous":
            return smollm2_manager(smollm2, session, 3, 320, enable_prefix_caching=prefix_caching)
        config = smollm2.config
        return PagedKVCacheManager(
            cache_params(config),
            16,
            3 * 20,
            3,
            320,
            config.num_hidden_layers,
            [CPU()],
            session,
            enable_prefix_caching=prefix_caching,
        )

    def model_for(manager: KVCacheManagerBase) -> DecoderModel:
        if cache == "contiguous":
            return smollm2_llama
        if "paged" not in _paged_llama:  # one graph for every paged manager of 16-token pages
            _paged_llama["paged"] = DecoderModel(
                smollm2.config, smollm2.weights, manager, session, quantized=smollm2.quantized
            )
        return _paged_llama["paged"]

    def run(prefix_caching: bool) -> tuple[list[list[int]], ContinuousBatchingScheduler]:
        manager = manager_for(prefix_caching)
        scheduler = ContinuousBatchingScheduler(model_for(manager), manager, 3, num_steps=4)
        for prompt in prompts:
            scheduler.submit(prompt, new_tokens)
        outputs, _ = scheduler.run()
        return outputs, scheduler

    plain, _ = run(False)
    cached, scheduler = run(True)
    assert cached == plain
    requests = scheduler.requests()
    assert requests[0].cached_tokens == 0
    shared = len(tokenizer.encode_chat("", system=SYSTEM)) - 8
    if cache == "paged":
        shared -= shared % 16  # whole pages
    assert all(r.cached_tokens >= shared for r in requests[1:])
    requires_transformers()
    from maxkv.models.hf import hf_from_pretrained, hf_generate

    assert smollm2.path is not None
    expected = hf_generate(
        hf_from_pretrained(smollm2.path), prompts, new_tokens, smollm2.config.eos_token_ids
    )
    assert cached == expected


@pytest.mark.model
def test_pop_n_rewinds_like_speculative_decoding(
    smollm2: LoadedModel, smollm2_llama: DecoderModel, session: InferenceSession
) -> None:
    """Decode, write rejected draft tokens, pop them, decode on: the same tokens as a
    sequence that never saw the draft.

    Both runs take the same steps with the same shapes, so they must agree token for
    token on any machine. (A reference through the scheduler once differed on another
    CPU at a token whose top-2 logit margin is 0.036: kernels there round differently
    for a different batch shape. This prompt's smallest margin over 10 tokens is 0.19.)
    """
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    prompt = tokenizer.encode_chat("What color is the sky on a clear day?")
    manager = smollm2_manager(smollm2, session, 2, 128)

    def decode(seq: int, tokens: list[int]) -> int:
        """One step feeding ``tokens``; commits them; returns the next greedy token."""
        (inputs,) = manager.fetch([seq], active_lengths=[len(tokens)])
        out = smollm2_llama.execute(
            Buffer.from_numpy(np.array(tokens, dtype=np.int64)),
            Buffer.from_numpy(np.array([0, len(tokens)], dtype=np.uint32)),
            inputs,
        )
        manager.step({seq: len(tokens)})
        return int(out.to_numpy()[0])

    def generate(draft: list[int] | None) -> list[int]:
        (seq,) = manager.claim(1)
        generated = [decode(seq, prompt)]
        for _ in range(4):
            generated.append(decode(seq, [generated[-1]]))
        if draft is not None:
            # A draft after the last accepted token is verified and rejected.
            decode(seq, [generated[-1], *draft])
            manager.pop_n(seq, 1 + len(draft))  # the drafts and the last token's K/V
            assert manager.cache_lengths[seq] == len(prompt) + 4
        while len(generated) < 10:
            generated.append(decode(seq, [generated[-1]]))
        manager.release(seq)
        return generated

    expected = generate(None)
    assert generate([11, 12, 13]) == expected
    assert manager.slots_remaining == 2


@pytest.mark.compile
def test_n_completions_fork_after_the_prompt(session: InferenceSession) -> None:
    """Greedy completions forked from one prompt all equal the NumPy reference;
    sampled ones are reproducible from their seed and differ from each other."""
    from maxkv.models.config import default_llama
    from maxkv.models.decoder import cache_params
    from maxkv.models.reference import greedy_reference

    config, weights = default_llama()
    prompts = [[1, 15, 27, 99, 4, 8], [1, 200, 3]]
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), 6, 40, config.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(config, weights, manager, session, output="logits")

    def run(temperature: float, seed: int) -> tuple[list[list[list[int]]], int]:
        scheduler = ContinuousBatchingScheduler(model, manager, 6, stop_at_eos=False)
        for i, prompt in enumerate(prompts):
            scheduler.submit(prompt, 8, temperature=temperature, n=3, seed=seed + 10 * i)
        _, stats = scheduler.run()
        assert manager.slots_remaining == 6
        return scheduler.completions(), stats.forks

    greedy, forks = run(0.0, 0)
    assert forks == 4
    for prompt, completions in zip(prompts, greedy, strict=True):
        expected = greedy_reference(config, weights, prompt, 8)
        assert completions == [expected] * 3
    sampled, _ = run(1.5, 5)
    assert run(1.5, 5)[0] == sampled  # the same seeds, the same completions
    assert all(len({tuple(c) for c in completions}) > 1 for completions in sampled)
    assert run(1.5, 6)[0] != sampled


@pytest.mark.compile
def test_head_at_given_rows_reads_every_drafted_position(session: InferenceSession) -> None:
    """A ``head_rows="given"`` model returns the logits (and tokens) of the
    rows it is told: every position of a prompt and of a sequence with
    drafts appended, as speculative decoding checks them, against the
    float64 reference at each position; then a rejected draft is popped and
    decoding goes on as if it had never been appended."""
    from maxkv.models.config import default_llama
    from maxkv.models.decoder import cache_params
    from maxkv.models.reference import greedy_reference, logits_reference

    config, weights = default_llama()
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), 2, 40, config.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(config, weights, manager, session, output="logits", head_rows="given")
    prompts = [[1, 15, 27, 99, 4, 8], [1, 200, 3]]
    seqs = manager.claim(len(prompts))
    tokens = np.concatenate(prompts).astype(np.int64)
    lengths = [len(p) for p in prompts]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
    rows = np.array([0, 2, 5, 6, 8, 7], dtype=np.int64)  # any rows, in any order
    (inputs,) = manager.fetch(seqs, active_lengths=lengths)
    got = model.execute(
        Buffer.from_numpy(tokens), Buffer.from_numpy(offsets), inputs, Buffer.from_numpy(rows)
    ).to_numpy()
    assert got.shape == (len(rows), config.vocab_size)
    flat = [(b, i) for b, p in enumerate(prompts) for i in range(len(p))]
    for row, logits in zip(rows, got, strict=True):
        b, i = flat[row]
        want = logits_reference(config, weights, prompts[b][: i + 1])
        assert np.abs(logits - want).max() < 1e-3 * np.abs(want).max()
    # The tokens graph (the greedy head where the CPU has one) on the same
    # step: the argmax of each given row.
    greedy = DecoderModel(config, weights, manager, session, head_rows="given")
    picked = greedy.execute(
        Buffer.from_numpy(tokens), Buffer.from_numpy(offsets), inputs, Buffer.from_numpy(rows)
    ).to_numpy()
    assert picked.tolist() == got.argmax(axis=-1).tolist()
    manager.step(dict(zip(seqs, lengths, strict=True)))

    # Sequence 0 decodes its next token with two drafts: the right one, then a
    # wrong one; the head reads all three rows; the wrong draft is popped.
    expected = greedy_reference(config, weights, prompts[0], 4)
    first = int(np.argmax(logits_reference(config, weights, prompts[0])))
    assert first == expected[0]
    wrong = (expected[2] + 1) % config.vocab_size
    step = np.array([first, expected[1], wrong], dtype=np.int64)
    (inputs,) = manager.fetch([seqs[0]], active_lengths=[3])
    argmax = (
        model.execute(
            Buffer.from_numpy(step),
            Buffer.from_numpy(np.array([0, 3], dtype=np.uint32)),
            inputs,
            Buffer.from_numpy(np.arange(3, dtype=np.int64)),
        )
        .to_numpy()
        .argmax(axis=-1)
    )
    assert argmax.tolist()[:2] == expected[1:3]  # the drafted positions, checked at once
    manager.step({seqs[0]: 3})
    manager.pop_n(seqs[0], 1)  # the wrong draft
    assert manager.cache_lengths[seqs[0]] == len(prompts[0]) + 2
    (inputs,) = manager.fetch([seqs[0]], active_lengths=[1])
    last = model.execute(
        Buffer.from_numpy(np.array([expected[2]], dtype=np.int64)),
        Buffer.from_numpy(np.array([0, 1], dtype=np.uint32)),
        inputs,
        Buffer.from_numpy(np.zeros(1, dtype=np.int64)),
    ).to_numpy()
    assert int(last.argmax()) == expected[3]
    with pytest.raises(ValueError, match="rows"):
        model.execute(Buffer.from_numpy(step), Buffer.from_numpy(offsets), inputs)
    with pytest.raises(ValueError, match="below total_tokens"):
        model.execute(
            Buffer.from_numpy(np.array([expected[2]], dtype=np.int64)),
            Buffer.from_numpy(np.array([0, 1], dtype=np.uint32)),
            inputs,
            Buffer.from_numpy(np.array([1], dtype=np.int64)),
        )
