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


@pytest.mark.parametrize(
    "output",
    # The logits head at given rows: also tests/test_sequence_ops.py.
    ["tokens", pytest.param("logits", marks=pytest.mark.sweep)],
)
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


def _chi_square_critical(dof: int, z: float = 4.753) -> float:
    """The chi-square value at 1 - 1e-6 (``z``: the normal's), Wilson-Hilferty."""
    return float(dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3)


def test_sampled_speculation_keeps_the_models_distribution(session: InferenceSession) -> None:
    """Speculative sampling on the demo model: after a prompt ending ``15 15``
    whose first sampled token is mostly 15 again, the next step drafts 15 (the
    model gives it about 0.45 at temperature 0.3, so drafts stand and fall);
    the second tokens of 1,500 seeded requests follow the float64 reference's
    distribution (chi-square, p = 1e-6), as do the first ones."""
    import numpy as np

    from maxkv.models.reference import logits_reference

    prompt = [218, 163, 131, 70, 120, 173, 53, 30, 243, 87, 15, 15]
    temperature, count = 0.3, 1500

    def probs(tokens: list[int]) -> np.ndarray:
        scaled = np.asarray(logits_reference(CONFIG, WEIGHTS, tokens)) / temperature
        p = np.exp(scaled - scaled.max())
        return p / p.sum()

    manager = ContinuousBatchingKVCacheManager(
        cache_params(CONFIG), 64, 32, CONFIG.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(CONFIG, WEIGHTS, manager, session, output="logits", head_rows="given")
    setting = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, adaptive=False)
    scheduler = ContinuousBatchingScheduler(
        model, manager, 64, stop_at_eos=False, speculative=setting
    )
    for seed in range(count):
        scheduler.submit(prompt, 2, temperature=temperature, seed=seed)
    outputs, stats = scheduler.run()
    assert stats.draft_tokens > 0 and 0 < stats.accepted_tokens < stats.draft_tokens

    def check(tokens: list[int], expected: np.ndarray) -> None:
        counts = np.bincount(tokens, minlength=len(expected)).astype(np.float64)
        want = len(tokens) * expected
        bins = want >= 5  # tokens expected 5 times or more; the rest pooled
        observed = np.append(counts[bins], counts[~bins].sum())
        wanted = np.append(want[bins], want[~bins].sum())
        statistic = float(((observed - wanted) ** 2 / wanted).sum())
        assert statistic < _chi_square_critical(len(observed) - 1), statistic

    check([o[0] for o in outputs], probs(prompt))
    seconds = [o[1] for o in outputs if o[0] == 15]
    assert len(seconds) > count // 2
    check(seconds, probs([*prompt, 15]))
