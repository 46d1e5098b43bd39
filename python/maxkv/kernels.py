"""Where the maxkv Mojo kernels live, and a compiled copy of them.

MAX compiles a Mojo *source* package passed as ``custom_extensions`` again for
every graph that names it (about 15 s on two cores).  :func:`kernels_path`
compiles the package once into a ``.mojoc`` file keyed by the hash of its
sources and of the Mojo compiler, and returns that file, so every later graph,
in this process or the next, skips the step.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .cachedir import cache_dir

_PACKAGE_NAME = "mojo_ops"
_lock = threading.Lock()


def kernels_source_path() -> Path:
    """Returns the Mojo source package (the folder holding ``__init__.mojo``).

    Works for a wheel install, where the package ships as ``maxkv/mojo_ops``,
    and for a source checkout or editable install, where it is the
    repository's top-level ``mojo_ops/``.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / _PACKAGE_NAME, here.parent.parent / _PACKAGE_NAME):
        if (candidate / "__init__.mojo").is_file():
            return candidate
    raise FileNotFoundError(f"maxkv's Mojo package was not found next to {here}; reinstall maxkv")


def _source_digest(source: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(source.rglob("*.mojo")):
        digest.update(path.relative_to(source).as_posix().encode())
        digest.update(path.read_bytes())
    digest.update(_mojo_version().encode())
    return digest.hexdigest()[:24]


def _mojo_version() -> str:
    from importlib.metadata import version

    try:
        return version("mojo")
    except Exception:  # pragma: no cover - mojo always ships with modular
        return "unknown"


def kernels_path() -> Path:
    """Returns a path to pass to ``Graph(..., custom_extensions=[...])``.

    The first call compiles the Mojo package (``mojo precompile``) into a
    cache folder (:func:`maxkv.cachedir.cache_dir`); later
    calls, and later processes, reuse the file while the sources and the
    compiler are unchanged.  Thread-safe; concurrent processes publish the
    file with an atomic rename.

    Raises:
        RuntimeError: If the Mojo compiler rejects the package (the message
            carries the compiler's output).
    """
    return compiled_package(kernels_source_path())


def compiled_package(source: Path) -> Path:
    """A Mojo source package (a folder with ``__init__.mojo``) compiled once into a
    ``.mojoc``, cached by the hash of its sources and compiler (see :func:`kernels_path`).

    Raises:
        RuntimeError: If the Mojo compiler rejects the package.
    """
    with _lock:
        target = cache_dir() / f"maxkv_kernels_{_source_digest(source)}" / f"{source.name}.mojoc"
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.parent / f".staging.{os.getpid()}.{threading.get_ident()}"
        staging.mkdir(exist_ok=True)
        staged = staging / target.name
        try:
            _precompile(source, staged)
            os.replace(staged, target)
        finally:
            staged.unlink(missing_ok=True)
            staging.rmdir()
        return target


def _precompile(source: Path, output: Path) -> None:
    from mojo.run import subprocess_run_mojo

    try:
        subprocess_run_mojo(
            ["precompile", str(source), "-o", str(output)], capture_output=True, check=True
        )
    except subprocess.CalledProcessError as exc:
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else str(exc.stderr)
        raise RuntimeError(f"compiling the Mojo package {source} failed:\n{stderr}") from exc


#: The Mojo compiler's warning about the code MAX generates around maxkv's
#: collections (each op's wrapper moves the collection with ``^``; the
#: collections are trivial register types, on purpose: a move is a copy, which
#: keeps MAX's code generation from using a moved-from value on a GPU).  It
#: has no effect and nothing a user can act on.
HARMLESS_WARNING = "warning: transfer from a value of trivial register type"


@contextmanager
def harmless_warnings_filtered() -> Iterator[None]:
    """Drops :data:`HARMLESS_WARNING` (with its source excerpt) from what the
    process writes to standard error inside the block; everything else is
    written out, in order, when the block ends (also on an exception).

    MAX's graph compiler prints from native code straight to file
    descriptor 2, so the descriptor is redirected to a temporary file for the
    block.  Nested blocks pass through.
    """
    global _filtering
    with _filter_lock:
        nested = _filtering
        _filtering = True
    if nested:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                captured.seek(0)
                kept = _without_harmless(captured.read().decode(errors="replace"))
                if kept:
                    sys.stderr.write(kept)
                    sys.stderr.flush()
    finally:
        os.close(saved)
        with _filter_lock:
            _filtering = False


def _without_harmless(text: str) -> str:
    """``text`` without :data:`HARMLESS_WARNING` blocks (the warning line, then
    its indented source and caret lines)."""
    kept: list[str] = []
    skipping = False
    for line in text.splitlines(keepends=True):
        if line.startswith(HARMLESS_WARNING):
            skipping = True
            continue
        if skipping and (not line.strip() or line[:1].isspace()):
            continue
        skipping = False
        kept.append(line)
    return "".join(kept)


def load_graph(session: Any, graph: Any, **kwargs: Any) -> Any:
    """``session.load(graph, **kwargs)`` with :func:`harmless_warnings_filtered`.

    A ``weights_registry`` must hold no read-only NumPy array: MAX 26.7 reads a
    CPU weight where it lies and keeps a reference to a writable array, but not
    to a read-only one (a view of a memory-mapped GGUF or safetensors file, or
    of ``bytes``), whose memory is then freed, or unmapped, under the compiled
    model as soon as the caller drops it (``max generate`` on a GGUF file died
    with a segmentation fault in its first step this way).  Copy such arrays
    first (:func:`maxkv.cpu.arrays.aligned` does), and keep the registry as
    long as the model.

    Raises:
        ValueError: On a read-only array in ``weights_registry``.
    """
    registry = kwargs.get("weights_registry") or {}
    read_only = sorted(
        name
        for name, value in registry.items()
        if isinstance(value, np.ndarray) and not value.flags.writeable
    )
    if read_only:
        raise ValueError(
            f"weights {', '.join(read_only[:5])} are read-only arrays: MAX does not keep "
            "them alive under the compiled model; pass writable copies"
        )
    with harmless_warnings_filtered():
        return session.load(graph, **kwargs)


_filter_lock = threading.Lock()
_filtering = False
