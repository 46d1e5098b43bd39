"""The GPU study's own code, checked here so that it still runs when a GPU is
lent (``benchmarks/gpu_study.py`` runs nowhere else, and once reached a GPU
with an import and a name that no longer existed).

- Every module of the study imports.
- The graph weights it prepares for maxkv's model from Hugging Face ones
  (unpacked: a GPU's layout) are the model's own (:func:`graph_weights`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from max.dtype import DType

from maxkv.models.config import default_llama, random_weights
from maxkv.models.decoder import graph_weights

pytestmark = pytest.mark.unit

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def study():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from maxkv_bench import gpu

        yield gpu
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_study_prepares_the_models_own_graph_weights(study) -> None:  # type: ignore[no-untyped-def]
    config, weights = default_llama()
    prepared = study.prepared_graph_weights(config, weights, DType.float32)
    expected = graph_weights(config, weights, packed=False)
    assert sorted(prepared) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(np.asarray(prepared[name]), np.asarray(array), err_msg=name)


@pytest.mark.parametrize(
    ("shape", "family", "bias", "qk_norm"),
    [
        ("qwen2.5-0.5b@tiny", "qwen2", True, False),
        ("qwen3-0.6b@tiny", "qwen3", False, True),
        ("gemma-3-1b@tiny", "gemma3", False, True),
    ],
)
def test_family_shapes_are_read_by_maxkvs_registry_and_prepared_as_the_model_does(
    study, shape: str, family: str, bias: bool, qk_norm: bool
) -> None:  # type: ignore[no-untyped-def]
    """A family shape's ``config.json`` (transformers' own) reads as that family,
    and the graph weights the study stacks (a QKV bias too) are the model's."""
    config, raw = study.shape_config(shape)
    assert raw is not None and config.family == family
    assert config.num_hidden_layers == 2 and config.hidden_size == 64
    assert (config.qkv_bias, config.qk_norm) == (bias, qk_norm)
    weights = random_weights(config)
    prepared = study.prepared_graph_weights(config, weights, DType.float32)
    expected = graph_weights(config, weights, packed=False)
    assert sorted(prepared) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(np.asarray(prepared[name]), np.asarray(array), err_msg=name)


def test_the_study_script_and_its_machine_check_parse() -> None:
    for script in ("gpu_study.py", "gpu_check.py"):
        compile((BENCHMARKS / script).read_text(), script, "exec")
