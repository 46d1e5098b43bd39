"""Loading a Llama from disk: a Hugging Face directory or a GGUF file.

:func:`load_llama` takes a Hugging Face directory (``config.json`` and
``*.safetensors``), a ``.gguf`` file, or a directory holding one ``.gguf``
(and no ``config.json``); :func:`resolve_model` also accepts the name of a
model maxkv can fetch (:mod:`maxkv.models.fetch`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from .config import LlamaConfig, ModelLoadError, Weights, check_weights
from .gguf_file import find_gguf, read_gguf


def model_file(path: str | Path) -> Path:
    """What :func:`load_llama` reads at ``path``: a ``.gguf`` file or an HF directory.

    A directory with a ``config.json`` is a Hugging Face directory; one
    without it must hold exactly one ``.gguf`` file, which is returned.

    Raises:
        ModelLoadError: If ``path`` does not exist or holds neither.
    """
    path = Path(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(
                f"{path} is not a .gguf file; pass a GGUF file or a model directory"
            )
        return path
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} does not exist")
    if (path / "config.json").is_file():
        return path
    found = find_gguf(path)
    if found is None:
        raise ModelLoadError(f"{path} holds neither config.json (Hugging Face) nor a .gguf file")
    return found


def load_llama(
    path: str | Path, progress: Callable[[int, int], None] | None = None
) -> tuple[LlamaConfig, Weights]:
    """Loads a Llama: configuration and float32 weights under Hugging Face names.

    Args:
        path: A Hugging Face directory (``config.json`` + ``*.safetensors``),
            a ``.gguf`` file, or a directory holding one ``.gguf``.
        progress: For GGUF files, called with (tensors done, tensors in all).

    Raises:
        ModelLoadError: On a missing, truncated or corrupt file, an
            unsupported architecture or tensor type, or a weight that is
            missing or mis-shaped.
    """
    source = model_file(path)
    if source.is_file():
        return read_gguf(source, progress)
    return _load_hf_directory(source)


def _load_hf_directory(directory: Path) -> tuple[LlamaConfig, Weights]:
    from safetensors.numpy import load_file

    config_file = directory / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{config_file} is not valid JSON: {error}") from None
    config = LlamaConfig.from_hf(raw)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors file in {directory}")
    weights: Weights = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except Exception as error:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read {file}: {error}") from None
    return config, check_weights(config, weights)
