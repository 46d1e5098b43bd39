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
import threading
from pathlib import Path

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
