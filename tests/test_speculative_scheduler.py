"""Speculative decoding in maxkv's scheduler: greedy outputs with drafts equal
those without, token for token, and the cache is left as if the rejected
drafts had never been appended."""

from __future__ import annotations

from dataclasses import replace

import pytest
from max.driver import CPU
from max.engine import InferenceSession

from maxkv import ContinuousBatchingKVCacheManager, PagedKVCacheManager
from maxkv.models import DecoderModel
from maxkv.models.config import default_llama
from maxkv.models.decoder import cache_params
from maxkv.models.reference import greedy_reference
from maxkv.serving.scheduler import ContinuousBatchingScheduler
from maxkv.serving.speculative import SpeculativeConfig

pytestmark = pytest.mark.compile

CONFIG, WEIGHTS = default_llama()
# Prompts that repeat themselves (drafts to find) and one that does not; the
# demo model's greedy continuations fall into loops, which drafts then follow.
PROMPTS = [
    [1, 5, 9, 13, 5, 9, 13, 5, 9],
    [1, 200, 3],
    [7, 7, 7, 7, 7, 7],
    [1, 40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41],
    [2, 99],
]
MAX_NEW = [24, 17, 9, 30, 1]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [greedy_reference(CONFIG, WEIGHTS, p, n) for p, n in zip(PROMPTS, MAX_NEW, strict=True)]


def make_paged(session: InferenceSession, prefix_caching: bool) -> PagedKVCacheManager:
    return PagedKVCacheManager(
        cache_params(CONFIG),
        4,
        64,
        4,
        64,
        CONFIG.num_hidden_layers,
        [CPU()],
        session,
        enable_prefix_caching=prefix_caching,
    )


def run(
    model: DecoderModel,
    manager: ContinuousBatchingKVCacheManager | PagedKVCacheManager,
    speculative: SpeculativeConfig | None,
    batch: int = 4,
) -> tuple[list[list[int]], dict[str, float | int]]:
    scheduler = ContinuousBatchingScheduler(
        model, manager, batch, stop_at_eos=False, speculative=speculative
    )
    for prompt, n in zip(PROMPTS, MAX_NEW, strict=True):
        scheduler.submit(prompt, n)
    outputs, stats = scheduler.run()
    return outputs, stats.as_dict()


SETTINGS = [
    SpeculativeConfig(num_speculative_tokens=1, prompt_lookup_min=1, prompt_lookup_max=1),
    SpeculativeConfig(num_speculative_tokens=3),
    SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=5),
    SpeculativeConfig(num_speculative_tokens=4, adaptive=False),
]


@pytest.mark.parametrize("output", ["tokens", "logits"])
def test_greedy_outputs_with_drafts_equal_the_reference(
    session: InferenceSession, expected: list[list[int]], output: str
) -> None:
    manager = ContinuousBatchingKVCacheManager(
        cache_params(CONFIG), 4, 64, CONFIG.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(CONFIG, WEIGHTS, manager, session, output=output, head_rows="given")  # type: ignore[arg-type]
    plain, stats = run(model, manager, None)
    assert plain == expected
    assert stats["draft_tokens"] == 0
    accepted = 0
    for setting in SETTINGS:
        for batch in (1, 4):
            got, stats = run(model, manager, setting, batch)
            assert got == expected, (setting, batch)
            assert manager.slots_remaining == 4
            accepted += int(stats["accepted_tokens"])
            assert stats["model_steps"] <= sum(MAX_NEW)
    assert accepted > 0  # drafts were taken, not only proposed


def test_paged_cache_is_left_as_without_drafts(
    session: InferenceSession, expected: list[list[int]]
) -> None:
    """Pages of rejected drafts are given back, and prefix caching records
    only committed tokens: a second run of the same prompts finds the same
    prefixes with and without drafts."""
    spec_manager = make_paged(session, prefix_caching=True)
    model = DecoderModel(CONFIG, WEIGHTS, spec_manager, session, head_rows="given")
    plain_manager = make_paged(session, prefix_caching=True)
    setting = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    hits = []
    cached = []
    for manager, speculative in ((plain_manager, None), (spec_manager, setting)):
        for _ in range(2):
            got, stats = run(model, manager, speculative)
            assert got == expected
            assert manager.free_pages == manager.num_pages
            hits.append(stats["prefix_cache_hit_tokens"])
            cached.append(sum(manager.page_is_cached(p) for p in range(manager.num_pages)))
    assert hits[:2] == hits[2:]
    assert cached[:2] == cached[2:]
    assert hits[1] > 0


def test_eos_inside_an_accepted_draft_ends_the_request(
    session: InferenceSession, expected: list[list[int]]
) -> None:
    # The loop prompt 3's continuation repeats: make a token inside it EOS.
    eos = expected[3][6]
    config = replace(CONFIG, eos_token_ids=(eos,))
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), 4, 64, config.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(config, WEIGHTS, manager, session, head_rows="given")
    want = [greedy_reference(config, WEIGHTS, p, n) for p, n in zip(PROMPTS, MAX_NEW, strict=True)]
    assert want[3][-1] == eos and len(want[3]) < MAX_NEW[3]
    scheduler = ContinuousBatchingScheduler(
        model, manager, 4, speculative=SpeculativeConfig(num_speculative_tokens=5)
    )
    for prompt, n in zip(PROMPTS, MAX_NEW, strict=True):
        scheduler.submit(prompt, n)
    outputs, stats = scheduler.run()
    assert outputs == want
    assert stats.accepted_tokens > 0
    assert manager.slots_remaining == 4


def test_speculation_needs_a_model_that_reads_given_rows(session: InferenceSession) -> None:
    manager = ContinuousBatchingKVCacheManager(
        cache_params(CONFIG), 2, 64, CONFIG.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(CONFIG, WEIGHTS, manager, session)
    with pytest.raises(ValueError, match="head_rows='given'"):
        ContinuousBatchingScheduler(model, manager, 2, speculative=SpeculativeConfig())
    given = DecoderModel(CONFIG, WEIGHTS, manager, session, head_rows="given")
    with pytest.raises(ValueError, match="num_steps=1"):
        ContinuousBatchingScheduler(given, manager, 2, 4, speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match="num_steps=1"):  # multistep feeds one token a row back
        ContinuousBatchingScheduler(given, manager, 2, 4)
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        ContinuousBatchingScheduler(given, manager, 2, speculative={"method": "ngram"})  # type: ignore[arg-type]
