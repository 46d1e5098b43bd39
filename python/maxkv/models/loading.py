"""Loading a model from disk: a Hugging Face directory or a GGUF file.

:func:`load_model` takes a Hugging Face directory (``config.json`` and
``*.safetensors``) of any registered family (:mod:`maxkv.models.family`), a
Llama ``.gguf`` file, or a directory holding one ``.gguf`` (and no
``config.json``); :func:`resolve_model` also accepts the name of a model
maxkv can fetch (:mod:`maxkv.models.fetch`).  Weights stored as float32,
float16 or bfloat16 load as float32: the CPU computes in float32; a GGUF's
block-quantized matrices stay as their blocks (:mod:`maxkv.models.held`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from .config import DecoderConfig, ModelLoadError, Weights, check_weights
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


def load_model(
    path: str | Path, progress: Callable[[int, int], None] | None = None
) -> tuple[DecoderConfig, Mapping[str, np.ndarray]]:
    """Loads a model: configuration and weights under Hugging Face names.

    The weights read as float32 arrays; a GGUF file's are a
    :class:`~maxkv.models.held.HeldWeights`, whose block-quantized matrices
    stay as the file stores them until read.

    Args:
        path: A Hugging Face directory (``config.json`` + ``*.safetensors``),
            a ``.gguf`` file, or a directory holding one ``.gguf``.
        progress: For GGUF files, called with (tensors done, tensors in all).

    Raises:
        ModelLoadError: On a missing, truncated or corrupt file, an
            unsupported architecture, feature or tensor type (named), or a
            weight that is missing or mis-shaped.
    """
    source = model_file(path)
    if source.is_file():
        return read_gguf(source, progress)
    return _load_hf_directory(source)


#: The name :func:`load_model` had when maxkv ran Llamas only.
load_llama = load_model

#: safetensors dtypes -> NumPy (bfloat16 is read as its bits, see :func:`read_safetensors`).
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """The tensors of a ``.safetensors`` file as float32 (``F32``, ``F16``,
    ``BF16``, ``F64``), read after checking the header against the file.

    NumPy has no bfloat16, so ``BF16`` tensors are widened from their bits
    (exactly: bfloat16 is float32's top half).

    Raises:
        ModelLoadError: On a truncated or malformed file, offsets outside
            the data or not matching the shape, or another tensor type.
    """
    data = file.read_bytes()
    if len(data) < 8:
        raise ModelLoadError(f"{file} is not a safetensors file (truncated)")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise ModelLoadError(f"{file}: header length {length} runs past the file")
    try:
        header = json.loads(data[8 : 8 + length])
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{file}: header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{file}: header is not a JSON object")
    body = memoryview(data)[8 + length :]
    tensors: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(int(d) for d in shape)
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{file}: tensor {name!r} has a malformed header entry") from None
        if dtype not in _SAFETENSORS_DTYPES:
            raise ModelLoadError(f"{file}: tensor {name} is {dtype}; maxkv reads F32, F16, BF16")
        np_dtype = np.dtype(_SAFETENSORS_DTYPES[dtype])
        count = int(np.prod(shape, dtype=np.int64))
        if not (0 <= start <= end <= len(body)) or end - start != count * np_dtype.itemsize:
            raise ModelLoadError(f"{file}: tensor {name} has offsets outside its data")
        array = np.frombuffer(body[start:end], dtype=np_dtype).reshape(shape)
        if dtype == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array.astype(np.float32, copy=False)
    return tensors


def hf_directory_config(directory: Path) -> DecoderConfig:
    """The configuration of a Hugging Face directory (its ``config.json``), no weight read.

    Raises:
        ModelLoadError: If ``config.json`` is not valid JSON or describes a model
            maxkv does not run.
    """
    config_file = directory / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{config_file} is not valid JSON: {error}") from None
    return DecoderConfig.from_hf(raw)


def _load_hf_directory(directory: Path) -> tuple[DecoderConfig, Weights]:
    config = hf_directory_config(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors file in {directory}")
    weights: Weights = {}
    for file in files:
        try:
            weights.update(read_safetensors(file))
        except OSError as error:
            raise ModelLoadError(f"cannot read {file}: {error}") from None
    return config, check_weights(config, weights)
