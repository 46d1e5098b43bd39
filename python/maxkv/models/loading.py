"""Loading a model from disk: a Hugging Face directory or a GGUF file.

:func:`load_model` takes a Hugging Face directory (``config.json`` and
``*.safetensors``) of any registered family (:mod:`maxkv.models.family`), a
Llama ``.gguf`` file, or a directory holding one ``.gguf`` (and no
``config.json``); :func:`resolve_model` also accepts the name of a model
maxkv can fetch (:mod:`maxkv.models.fetch`).  The CPU computes in float32;
a checkpoint's bfloat16 and float16 matrices stay as their 16-bit values and a
GGUF's block-quantized matrices as their blocks, in the mapped file
(:mod:`maxkv.models.held`), each widened exactly where it is read; other
tensors (norms, biases, float32 matrices) load as float32.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from .config import DecoderConfig, ModelLoadError, Weights
from .gguf_file import find_gguf, read_gguf
from .held import FileBlocks, HeldTensor, HeldWeights, check_held


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

    The weights are a :class:`~maxkv.models.held.HeldWeights`: float32 arrays,
    and the matrices a file stores as blocks or 16-bit floats, which stay as
    the file stores them until read (as float32, ``weights[name]``).

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

#: safetensors dtypes -> NumPy (bfloat16 is read as its bits, see :func:`map_safetensors`).
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def map_safetensors(file: Path) -> tuple[dict[str, np.ndarray], FileBlocks]:
    """A ``.safetensors`` file, mapped: its 2-D ``BF16`` and ``F16`` tensors as
    :class:`~maxkv.models.held.FileBlocks` (16-bit values read from the
    mapping when asked for), every other tensor as float32; the header is
    checked against the file first.

    Raises:
        ModelLoadError: On a truncated or malformed file, offsets outside
            the data or not matching the shape, or another tensor type.
    """
    try:
        with file.open("rb") as handle:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:  # an empty file cannot be mapped
        raise ModelLoadError(f"{file} is not a safetensors file (truncated)") from None
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
    body_start = 8 + length
    body = memoryview(data)[body_start:]
    tensors: dict[str, np.ndarray] = {}
    held: dict[str, HeldTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape, start, end = tuple(int(d) for d in shape), int(start), int(end)
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{file}: tensor {name!r} has a malformed header entry") from None
        if dtype not in _SAFETENSORS_DTYPES:
            raise ModelLoadError(f"{file}: tensor {name} is {dtype}; maxkv reads F32, F16, BF16")
        np_dtype = np.dtype(_SAFETENSORS_DTYPES[dtype])
        count = int(np.prod(shape, dtype=np.int64))
        if not (0 <= start <= end <= len(body)) or end - start != count * np_dtype.itemsize:
            raise ModelLoadError(f"{file}: tensor {name} has offsets outside its data")
        if dtype in ("BF16", "F16") and len(shape) == 2 and count:
            raw = np.frombuffer(body[start:end], dtype=np.uint8).reshape(shape[0], -1)
            span = (body_start + start, end - start)
            held[name] = HeldTensor(dtype, (shape[0], shape[1]), raw, span, None, data)
            continue
        array = np.frombuffer(body[start:end], dtype=np_dtype).reshape(shape)
        if dtype == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        # F32 tensors: read-only views of the mapping (clean file pages, no copy).
        tensors[name] = array.astype(np.float32, copy=False)
    return tensors, FileBlocks(held)


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


def _load_hf_directory(directory: Path) -> tuple[DecoderConfig, HeldWeights]:
    config = hf_directory_config(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors file in {directory}")
    dense: Weights = {}
    held: dict[str, HeldTensor] = {}
    for file in files:
        try:
            tensors, blocks = map_safetensors(file)
        except OSError as error:
            raise ModelLoadError(f"cannot read {file}: {error}") from None
        twice = sorted((set(tensors) | set(blocks)) & (set(dense) | set(held)))
        if twice:
            raise ModelLoadError(
                f"{file} holds {', '.join(twice[:5])} again (another shard has it)"
            )
        dense.update(tensors)
        held.update(blocks.tensors())
    return config, check_held(config, HeldWeights(dense, FileBlocks(held)))
