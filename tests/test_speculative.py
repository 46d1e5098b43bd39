"""Prompt-lookup drafting, draft acceptance and the speculation policy
(``maxkv.serving.speculative``), against brute-force references and the
distributions they must keep."""

from __future__ import annotations

import numpy as np
import pytest

from maxkv.errors import ArgumentTypeError
from maxkv.serving.speculative import (
    PromptLookup,
    SpeculationPolicy,
    accept_greedy,
    accept_sampled,
)

pytestmark = pytest.mark.unit


def brute_force_propose(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """Written from the definition: the longest n first, the latest earlier
    occurrence ending before the last token, the k tokens after it."""
    length = len(tokens)
    for n in range(high, low - 1, -1):
        if n > length - 1:
            continue
        suffix = tokens[length - n :]
        # occurrences [start, start + n) ending before the last token, latest first
        for start in range(length - 1 - n, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_propose_follows_the_latest_longest_match() -> None:
    lookup = PromptLookup(prompt_lookup_min=2, prompt_lookup_max=2)
    assert lookup.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]
    # (2, 3) twice earlier: the later occurrence's continuation.
    assert lookup.propose([2, 3, 9, 2, 3, 7, 5, 2, 3], 3) == [7, 5, 2]
    # A longer match wins over a later shorter one.
    longer = PromptLookup(prompt_lookup_min=1, prompt_lookup_max=3)
    assert longer.propose([1, 2, 3, 8, 9, 5, 3, 6, 1, 2, 3], 2) == [8, 9]
    # The continuation stops at the end of the sequence.
    assert lookup.propose([5, 6, 5, 6], 4) == [5, 6]
    assert lookup.propose([1, 2, 3, 4], 4) == []
    assert lookup.propose([1, 2, 1, 2], 0) == []
    assert lookup.propose([7], 3) == []


@pytest.mark.parametrize(("low", "high"), [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_propose_matches_brute_force(low: int, high: int) -> None:
    rng = np.random.default_rng(low * 10 + high)
    lookup = PromptLookup(prompt_lookup_min=low, prompt_lookup_max=high)
    for _ in range(400):
        length = int(rng.integers(1, 60))
        tokens = rng.integers(0, int(rng.integers(2, 6)), size=length).tolist()
        k = int(rng.integers(0, 6))
        expected = brute_force_propose(tokens, k, low, high)
        assert lookup.propose(tokens, k) == expected, (tokens, k)
        assert lookup.propose(np.asarray(tokens, dtype=np.int32), k) == expected


def test_bad_lookup_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        PromptLookup(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        PromptLookup(prompt_lookup_min=0)
    with pytest.raises(ArgumentTypeError):
        PromptLookup(prompt_lookup_max=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be"):
        PromptLookup().propose([1, 2, 3], -1)
    with pytest.raises(ValueError, match="one sequence"):
        PromptLookup().propose(np.zeros((2, 3), dtype=np.int64), 2)


def test_greedy_acceptance_is_one_token_at_a_time_decoding() -> None:
    assert accept_greedy([4, 5, 6], np.array([4, 5, 6, 7])) == [4, 5, 6, 7]
    assert accept_greedy([4, 5, 6], np.array([4, 9, 6, 7])) == [4, 9]
    assert accept_greedy([4, 5, 6], np.array([1, 5, 6, 7])) == [1]
    assert accept_greedy([], np.array([3])) == [3]
    with pytest.raises(ValueError, match="rows"):
        accept_greedy([1, 2], np.array([1, 2]))


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


# chi-square critical values at 1 - 1e-6 for 4 and 5 degrees of freedom.
CRITICAL = {4: 33.4, 5: 35.9}


def test_sampled_acceptance_keeps_the_models_distribution() -> None:
    rng = np.random.default_rng(0)
    vocab = 6
    probs = rng.dirichlet(np.ones(vocab), size=3)
    probs[1, 5] = 0.0  # a token the model never picks
    probs[1] /= probs[1].sum()
    drafts = [2, 0]  # a likely-ish first draft, then any
    trials = 60_000
    first = np.zeros(vocab)
    second = np.zeros(vocab)  # given the first draft stood
    third = np.zeros(vocab)  # given both drafts stood
    for _ in range(trials):
        out = accept_sampled(drafts, probs, rng)
        assert 1 <= len(out) <= 3
        assert out[:-1] == drafts[: len(out) - 1]  # only accepted drafts before the last token
        first[out[0]] += 1
        if len(out) >= 2:
            second[out[1]] += 1
        if len(out) == 3:
            third[out[2]] += 1
    assert chi_square(first, probs[0]) < CRITICAL[5]
    assert chi_square(second, probs[1]) < CRITICAL[4]  # token 5 has probability 0
    assert chi_square(third, probs[2]) < CRITICAL[5]
    assert abs(second.sum() / trials - probs[0, 2]) < 0.01


def test_the_distribution_check_catches_a_biased_scheme() -> None:
    """Resampling from the full distribution after a rejection (the draft not
    removed) over-weights the draft: the same check must fail on it."""
    rng = np.random.default_rng(1)
    vocab = 6
    probs = rng.dirichlet(np.ones(vocab), size=1)[0]
    first = np.zeros(vocab)
    for _ in range(60_000):
        if rng.random() < probs[2]:
            first[2] += 1
        else:
            first[rng.choice(vocab, p=probs)] += 1
    assert chi_square(first, probs) > CRITICAL[5]


def test_sampled_acceptance_refuses_bad_shapes() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="shape"):
        accept_sampled([1], np.full((1, 4), 0.25), rng)
    with pytest.raises(ValueError, match="vocabulary"):
        accept_sampled([7], np.full((2, 4), 0.25), rng)


def test_policy_caps_drafts_by_batch_rows() -> None:
    policy = SpeculationPolicy(num_speculative_tokens=4, row_cost=0.0, max_batch_tokens=32)
    assert policy.draft_length(0, 1) == 4
    assert policy.draft_length(1, 8) == 3  # (32 - 8) // 8
    assert policy.draft_length(2, 16) == 1
    assert policy.draft_length(3, 32) == 0
    assert SpeculationPolicy(num_speculative_tokens=0).draft_length(0, 1) == 0
    fixed = SpeculationPolicy(num_speculative_tokens=4, adaptive=False)
    fixed.record(0, 4, 0)
    assert fixed.draft_length(0, 64) == 4


def tokens_per_cost(acceptance: float, k: int, row_cost: float, batch: int = 1) -> float:
    """A step of ``batch`` rows plus ``k`` drafts of one sequence, in units of a one-row step."""
    extra = sum(acceptance**j for j in range(1, k + 1))
    return (batch + extra) / (1 + (batch - 1 + k) * row_cost)


@pytest.mark.parametrize("row_cost", [0.0, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_policy_drafts_the_length_that_pays_most(row_cost: float, batch: int) -> None:
    policy = SpeculationPolicy(num_speculative_tokens=8, row_cost=row_cost)
    for acceptance in np.linspace(0.01, 0.99, 50):
        a = float(acceptance)
        got = policy.best_length(a, 8, batch)
        best = max(tokens_per_cost(a, k, row_cost, batch) for k in range(9))
        assert tokens_per_cost(a, got, row_cost, batch) >= best * (1 - 1e-9)
        if got:
            assert tokens_per_cost(a, got, row_cost, batch) > tokens_per_cost(a, 0, row_cost, batch)


def test_larger_batches_need_a_higher_acceptance_to_draft() -> None:
    policy = SpeculationPolicy(num_speculative_tokens=4, row_cost=0.3)
    assert policy.best_length(0.5, 4, 1) >= 1
    assert policy.best_length(0.5, 4, 16) == 0
    assert policy.best_length(0.95, 4, 16) >= 1
    threshold = {
        b: next(a for a in np.linspace(0, 1, 101) if policy.best_length(a, 4, b))
        for b in (1, 4, 16)
    }
    assert threshold[1] < threshold[4] < threshold[16]


def test_policy_drafts_more_as_drafts_stand_and_pauses_when_they_fail() -> None:
    policy = SpeculationPolicy(num_speculative_tokens=4, row_cost=0.2, decay=0.8)
    assert policy.acceptance(7) == 0.5
    assert policy.draft_length(7, 1) == 1  # the prior pays for one draft, not two
    policy.record(7, 1, 1)
    policy.record(7, 3, 3)
    assert policy.acceptance(7) > 0.8
    assert policy.draft_length(7, 1) == 4
    lengths = []
    for _ in range(30):  # from now on every draft fails
        k = policy.draft_length(7, 1)
        lengths.append(k)
        policy.record(7, k, 0)
    # Shorter and shorter drafts, then pauses of 1, 2, 4 and 8 steps, each
    # followed by a probe of one draft.
    assert lengths == [4, 3, 2, 1, 1, 1, 1, 0, 1, 0, 0, 1, *[0] * 4, 1, *[0] * 8, 1, 0, 0, 0, 0]
    assert policy.draft_length(8, 1) == 1  # other sequences are not affected
    policy.record(7, 1, 1)  # a probe that stands ends the backoff
    policy.forget(7)
    assert policy.acceptance(7) == 0.5


def test_policy_pause_is_bounded() -> None:
    policy = SpeculationPolicy(num_speculative_tokens=2, max_pause=4)
    lengths = []
    for _ in range(40):
        k = policy.draft_length(1, 1)
        lengths.append(k)
        policy.record(1, k, 0)
    assert lengths[:11] == [1, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0]
    assert lengths[11:36] == [1, 0, 0, 0, 0] * 5  # pauses stay at max_pause


def test_bad_policy_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculationPolicy(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="row_cost"):
        SpeculationPolicy(num_speculative_tokens=2, row_cost=1.5)
    with pytest.raises(ValueError, match="prior"):
        SpeculationPolicy(num_speculative_tokens=2, prior=0.0)
    with pytest.raises(ValueError, match="decay"):
        SpeculationPolicy(num_speculative_tokens=2, decay=1.0)
    policy = SpeculationPolicy(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="exceeds"):
        policy.record(0, 1, 2)
    with pytest.raises(ValueError, match="batch_size"):
        policy.draft_length(0, 0)
