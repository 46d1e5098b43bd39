"""The MAX names maxkv replaces, wraps, overrides, reads or imports privately
(:mod:`maxkv.seams`) are where maxkv expects them in the installed MAX, and the
package touches no other: private imports, private attributes it reads but never
defines, and overrides of MAX's underscored methods are found in its source (the
AST) and its classes."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

import maxkv
from maxkv import seams

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("seam", seams.SEAMS, ids=lambda s: s.path)
def test_every_seam_is_in_the_installed_max(seam: object) -> None:
    assert isinstance(seam, seams.Seam)
    target = seam.resolve()  # raises SeamMovedError naming the seam
    if seam.use == "overridden":
        owner = seam.owner()
        overrides = [
            cls.__dict__[seam.attribute]
            for cls in _maxkv_classes()
            if issubclass(cls, owner) and seam.attribute in cls.__dict__
        ]
        assert overrides, f"no class of maxkv overrides {seam.path}"
        for ours in overrides:  # each still takes what MAX's method takes
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


#: Underscored names of Python's own: ``typing.NamedTuple``'s public API, and
#: what ``abc`` and ``typing.Protocol`` set on every class they make.
PYTHON_API = frozenset({"_fields", "_replace", "_asdict", "_make", "_field_defaults"})
PYTHON_MACHINERY = frozenset({"_abc_impl", "_is_protocol", "_is_runtime_protocol"})


def _sources() -> Iterator[tuple[str, str]]:
    for path in sorted((ROOT / "python" / "maxkv").rglob("*.py")):
        yield str(path.relative_to(ROOT)), path.read_text()


def foreign_private_reads(sources: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Underscored attributes the code reads or calls (``x._name``) that it never
    defines itself (no ``def``, class, assignment, argument or import of that
    name anywhere in ``sources``): someone else's private names, by name, with
    where they are read."""
    defined: set[str] = set()
    reads: dict[str, list[str]] = {}
    for where, text in sources:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
                defined.add(node.attr)
            elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                defined.add(node.id)
            elif isinstance(node, ast.alias):
                defined.add(node.asname or node.name.rsplit(".", 1)[-1])
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                if not node.attr.startswith("__"):
                    reads.setdefault(node.attr, []).append(f"{where}:{node.lineno}")
    return {name: at for name, at in reads.items() if name not in defined | PYTHON_API}


def test_every_private_max_attribute_maxkv_reads_is_a_seam() -> None:
    """Every underscored attribute the package reads or calls and never defines
    (MAX's ``self._pipeline_model``, ``model._logprobs_model``...) is a seam's."""
    listed = {s.attribute for s in seams.SEAMS}
    undeclared = {
        name: at for name, at in foreign_private_reads(_sources()).items() if name not in listed
    }
    assert not undeclared, f"private names read but not in seams.SEAMS: {undeclared}"


def test_an_undeclared_private_read_is_found() -> None:
    """The scan above finds a MAX private the package reads and does not declare, in
    a method as maxkv's pipeline reads them, and leaves maxkv's own alone."""
    code = """
class Pipeline(text_generation.TextGenerationPipeline):
    def __init__(self):
        self._drafting = None

    def step(self):
        return self._pipeline_model.run(self._drafting, self._helper())

    def _helper(self):
        return self._scheduler._queue
"""
    found = foreign_private_reads([("pipeline.py", code)])
    assert sorted(found) == ["_pipeline_model", "_queue", "_scheduler"]
    assert found["_pipeline_model"] == ["pipeline.py:7"]


@functools.cache
def _maxkv_classes() -> list[type]:
    """Every class defined in maxkv's modules (each module imported)."""
    classes = []
    for module_info in pkgutil.walk_packages(maxkv.__path__, "maxkv."):
        if module_info.name.endswith("__main__"):
            continue
        module = importlib.import_module(module_info.name)
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                classes.append(value)
    return classes


def test_every_override_of_a_private_max_method_is_a_seam() -> None:
    """Every underscored method a maxkv class defines that a MAX class it inherits
    from has too (``TextTokenizer._generate_prompt_and_token_ids``) is an
    ``overridden`` seam of that MAX class."""
    overridden = {(s.owner(), s.attribute) for s in seams.SEAMS if s.use == "overridden"}
    undeclared = []
    for cls in _maxkv_classes():
        max_bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] == "max"]
        for name in cls.__dict__:
            if not name.startswith("_") or name.startswith("__") or name in PYTHON_MACHINERY:
                continue
            owners = [b for b in max_bases if name in b.__dict__]
            if owners and not any((owner, name) in overridden for owner in owners):
                undeclared.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    assert not undeclared, f"overrides of MAX methods not in seams.SEAMS: {undeclared}"


#: Run in a fresh interpreter: what each import leaves of the MAX names maxkv
#: changes (functions by identity, the router by its routes, the format table by
#: its keys).
IMPORTS_CHANGE_NOTHING = """
import json
from maxkv import seams

changed = [s for s in seams.SEAMS if s.use in ("wrapped", "extended")]

def state(seam):
    value = seam.resolve()
    if hasattr(value, "routes"):
        return [[getattr(r, "path", ""), id(getattr(r, "endpoint", None))] for r in value.routes]
    if isinstance(value, dict):
        return sorted(map(str, value))
    return id(value)

def states():
    return {s.path: state(s) for s in changed}

first = states()
import maxkv, maxkv.serving.pipelines, maxkv.serving.pipelines.architecture  # the library
library = states()
import maxkv.pipelines  # MAX's entry point for --custom-architectures
entry = states()
maxkv.serving.pipelines.install()  # once per process
print(json.dumps({"first": first, "library": library, "entry": entry, "again": states()}))
"""


def test_importing_maxkv_changes_nothing_of_max_and_the_entry_point_installs() -> None:
    """``import maxkv`` and ``import maxkv.serving.pipelines`` leave every name MAX
    holds as it was; ``import maxkv.pipelines`` (what ``--custom-architectures``
    imports) changes each wrapped or extended seam that serving needs, and a
    second :func:`~maxkv.serving.pipelines.install` changes nothing more."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", IMPORTS_CHANGE_NOTHING],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    states = json.loads(done.stdout.strip().splitlines()[-1])
    assert states["library"] == states["first"]
    changed = {path for path in states["first"] if states["entry"][path] != states["first"][path]}
    installed = {
        seams.PARSE_OPENAI_REQUEST.path,
        seams.OPENAI_ROUTER.path,
        seams.CANCELLED_REQUESTS.path,
        seams.PENDING_REQUESTS.path,
        seams.KV_CACHE_FORMATS.path,
    }
    assert installed <= changed, installed - changed
    assert states["again"] == states["entry"]
