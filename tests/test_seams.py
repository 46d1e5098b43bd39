"""The MAX names maxkv replaces, wraps, overrides or imports privately
(:mod:`maxkv.seams`) are where maxkv expects them in the installed MAX."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from maxkv import seams

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("seam", seams.SEAMS, ids=lambda s: s.path)
def test_every_seam_is_in_the_installed_max(seam: object) -> None:
    assert isinstance(seam, seams.Seam)
    target = seam.resolve()  # raises SeamMovedError naming the seam
    if seam.use == "overridden":
        from maxkv.serving.pipelines import MaxkvTextGenerationPipeline

        method = seam.attribute
        ours = MaxkvTextGenerationPipeline.__dict__[method]
        # the override still takes what MAX's method takes
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(target).parameters
        ), seam.path
    if seam.use in ("replaced", "wrapped"):
        assert callable(target), seam.path


def test_a_moved_seam_is_named() -> None:
    gone = seams.Seam("max.pipelines.lib", "no_such_name", "replaced", "a test")
    with pytest.raises(seams.SeamMovedError, match=r"max\.pipelines\.lib\.no_such_name"):
        gone.resolve()
    with pytest.raises(seams.SeamMovedError, match="no_such_module"):
        seams.Seam("max.no_such_module", "f", "private", "a test").resolve()


def test_a_replaced_seam_is_restored() -> None:
    seam = seams.LOAD_KV_MANAGER
    original = seam.resolve()
    with seam.replaced("stand-in"):
        assert seam.resolve() == "stand-in"
    assert seam.resolve() is original


def test_the_package_touches_max_privately_only_through_listed_seams() -> None:
    """Every private MAX name the package's code mentions (``max....._x`` or an
    override of an underscored MAX method) is a seam's."""
    listed = {s.attribute for s in seams.SEAMS}
    package = ROOT / "python" / "maxkv"
    for path in package.rglob("*.py"):
        text = path.read_text()
        for module, name in re.findall(r"from (max\.[\w.]+) import (_\w+)", text):
            assert name in listed, f"{path.name}: {module}.{name} is not in seams.SEAMS"
        for name in re.findall(r"from max\.[\w.]*\.(_\w+) import", text):
            # a private module: the names imported from it are listed
            assert any(s.module.endswith(name) for s in seams.SEAMS), f"{path.name}: {name}"
