"""The guard on what a request asks of the sampler
(:func:`maxkv.serving.pipelines.api.check_sampling`), on MAX's own
``SamplingParams``.  (Against a real server: ``tests/test_serve_fuzz.py``.)"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def _params(**fields: object) -> object:
    from max.pipelines.context.sampling_params import SamplingParams

    return SamplingParams(**fields)  # type: ignore[arg-type]


def test_a_top_k_past_the_vocabulary_is_the_vocabulary() -> None:
    from maxkv.serving.pipelines.api import check_sampling

    # MAX's sampler sizes its buffers by the batch's largest top_k: 2**31 took
    # 23 GB of a 24 GB machine before the model worker was killed.
    for top_k, expected in [(2**31, 97), (98, 97), (97, 97), (5, 5), (-1, -1), (1, 1)]:
        params = _params(top_k=top_k, temperature=1.0)
        check_sampling(params, 97)
        assert params.top_k == expected, (top_k, params.top_k)  # type: ignore[attr-defined]


def test_what_the_worker_queue_or_vocabulary_cannot_take_is_refused() -> None:
    from max.pipelines.context.exceptions import InputError

    from maxkv.serving.pipelines.api import check_sampling

    with pytest.raises(InputError, match="outside the 64-bit integers"):
        check_sampling(_params(seed=2**64), 97)
    with pytest.raises(InputError, match="`stop_token_ids` holds 97"):
        check_sampling(_params(stop_token_ids=[3, 97]), 97)
    check_sampling(_params(seed=2**63 - 1, stop_token_ids=[0, 96]), 97)  # (no error)
