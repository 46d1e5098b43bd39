"""Capabilities: what a manager offers beyond the step protocol is declared, and the
layers above the cache ask the declaration, never the manager's class."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from max.driver import CPU
from max.dtype import DType

from maxkv import KVCacheParams
from maxkv.cache.hybrid import HybridKVCacheManager
from maxkv.cache.protocol import CacheCapabilities, KVCacheManagerBase
from maxkv.serving.pipelines.kv_adapter import MaxkvKVManager
from maxkv.serving.scheduler import ContinuousBatchingScheduler

from .fakes import NumpyCacheDevice, contiguous, paged

pytestmark = pytest.mark.unit

PARAMS = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=4)
PACKAGE = Path(__file__).resolve().parents[1] / "python" / "maxkv"

#: Each capability's methods, as KVCacheManagerBase declares them.
METHODS = {
    "pages": ("free_pages", "pages_to_claim"),
    "swap": ("swap_out", "swap_in", "swap_in_pages"),
    "sinks": ("enable_attention_sinks",),
    "blending": ("read_tokens", "mark_blended", "blended_position"),
}


def managers() -> dict[str, KVCacheManagerBase]:
    hybrid = HybridKVCacheManager(
        PARAMS, 4, [8, 8], 2, 64, (None, 16), [CPU()], None, cache_device=NumpyCacheDevice()
    )
    return {
        "contiguous": contiguous(PARAMS, 2, 64),
        "paged": paged(PARAMS, 4, 16, 2, 64),
        "hybrid": hybrid,
    }


def test_each_manager_declares_what_it_offers() -> None:
    found = {name: m.capabilities for name, m in managers().items()}
    assert found["paged"] == CacheCapabilities(
        pages=True, swap=True, sinks=True, blending=True, tiers=True, events=True
    )
    assert found["contiguous"] == CacheCapabilities(events=True)
    assert found["hybrid"].names() == ("pages", "swap", "tiers", "events")


@pytest.mark.parametrize("kind", ["contiguous", "paged", "hybrid"])
def test_a_declared_capability_is_implemented_and_an_undeclared_one_refused(kind: str) -> None:
    manager = managers()[kind]
    (seq,) = manager.claim(1)
    manager.reserve({seq: 4})
    manager.step({seq: 4})
    calls: dict[str, Any] = {
        "free_pages": lambda: manager.free_pages,
        "pages_to_claim": lambda: manager.pages_to_claim([1, 2, 3]),
        "swap_out": lambda: manager.swap_out(seq),
        "enable_attention_sinks": lambda: manager.enable_sliding_window(seq, 16, 4),
        "read_tokens": lambda: manager.read_tokens(seq, 0, 2),
        "mark_blended": lambda: manager.approximate_from(seq, 2),
    }
    for capability, methods in METHODS.items():
        declared = getattr(manager.capabilities, capability)
        for method in methods:
            own = getattr(type(manager), method) is not getattr(KVCacheManagerBase, method)
            # Declared: implemented.  Undeclared: refused by name, whether the base's
            # declaration or a class that has it for other instances (a hybrid cache
            # is the paged manager with a table per layer group) answers the call.
            assert own or not declared or method == "blended_position", (kind, method)
            if method in calls and not declared:
                with pytest.raises(ValueError, match=f"no '{capability}' capability"):
                    calls[method]()
    # A refusal changes nothing: the sequence is as it was.
    assert manager.cache_lengths == {seq: 4}


def test_without_blending_no_kv_is_blended() -> None:
    manager = contiguous(PARAMS, 2, 64)
    (seq,) = manager.claim(1)
    assert manager.blended_position(seq) is None
    assert manager.approximate_position(seq) is None  # the older name
    with pytest.raises(ValueError, match=r"seq_id 1"):
        manager.blended_position(1)


@pytest.mark.parametrize(("preemption", "capability"), [("swap", "swap"), ("recompute", "pages")])
def test_preemption_asks_the_manager_for_its_capability(preemption: str, capability: str) -> None:
    model: Any = SimpleNamespace()  # refused before the model is looked at
    with pytest.raises(ValueError, match=f"the '{capability}' capability.*Continuous"):
        ContinuousBatchingScheduler(model, contiguous(PARAMS, 2, 64), 2, preemption=preemption)


def test_serving_features_ask_the_manager_for_their_capability() -> None:
    params = SimpleNamespace(page_size=4)
    with pytest.raises(ValueError, match="attention sinks need the paged cache, not Hybrid"):
        MaxkvKVManager(managers()["hybrid"], params, sinks=(16, 4))
    blender: Any = SimpleNamespace()
    with pytest.raises(ValueError, match=r"CacheBlend .* needs the paged cache, not Continuous"):
        MaxkvKVManager(contiguous(PARAMS, 2, 64), params, blender=blender)
    MaxkvKVManager(paged(PARAMS, 4, 16, 2, 64), params, sinks=(16, 4))


def test_no_manager_class_is_tested_above_the_cache() -> None:
    """Features above ``maxkv/cache`` are decided by capabilities: no ``isinstance``
    against a concrete manager class there."""
    concrete = {"PagedKVCacheManager", "ContinuousBatchingKVCacheManager", "HybridKVCacheManager"}
    found, files = [], 0
    for path in PACKAGE.rglob("*.py"):
        files += 1
        if path.parent.name == "cache":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if names & concrete:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert files > 50  # the package's sources were read
    assert not found
