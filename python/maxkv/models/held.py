"""A model's weights held as its file stores them.

A GGUF file stores most matrices in blocks of small integers
(:mod:`maxkv.cpu.quantized`), a bfloat16 or float16 checkpoint as 16-bit
floats.  :class:`HeldWeights` is what :func:`~maxkv.models.load_model`
returns for such a file: the other tensors (norms, biases, float32
matrices) as float32 arrays, and the block-quantized and 16-bit matrices as
:class:`FileBlocks`, read from the mapped file when asked for and kept
nowhere.  The decoder packs each of those straight
into the layout its kernels stream (:func:`~maxkv.models.decoder.graph_weights`);
no float32 copy of such a matrix is made.  Read as a mapping of float32
arrays (``weights[name]``, for references and tools) a held matrix is
dequantized on each access, into an array its caller owns.
"""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..cpu.quantized import (
    HELD_FORMATS,
    HeldMatrix,
    PackedFormat,
    from_file_bytes,
    stacked_format,
)
from .config import DecoderConfig, ModelLoadError, check_weights


@dataclass(frozen=True)
class HeldTensor:
    """One block-quantized or 16-bit matrix in a mapped file."""

    #: Its GGML type (one of :data:`~maxkv.cpu.quantized.HELD_TYPES`; a safetensors
    #: file's 16-bit matrices are ``BF16`` and ``F16`` too).
    type_name: str
    #: ``(N, K)``.
    shape: tuple[int, int]
    #: Its bytes as uint8 ``[N, bytes per row]``, a view of the mapping.
    raw: np.ndarray
    #: Where its bytes lie in the mapping: ``(offset, length)``.
    span: tuple[int, int]
    #: The file's row of each of its rows (llama.cpp's Q/K permutation undone), or ``None``.
    order: np.ndarray | None = None
    #: The mapping ``raw`` lies in (its pages released by :meth:`FileBlocks.release`).
    mapping: mmap.mmap | None = None


class FileBlocks(Mapping[str, HeldMatrix]):
    """Block-quantized or 16-bit matrices of mapped files, each read when asked for.

    ``blocks[name]`` reads the matrix's bytes from the mapping into a new
    :class:`~maxkv.cpu.quantized.BlockQuantized` (or
    :class:`~maxkv.cpu.quantized.Floats16`, a view of the mapping),
    :meth:`read` some of its rows; nothing is cached, so holding this mapping
    holds only the files' mappings.  :meth:`release` gives the pages of a
    matrix read so far back to the OS (read again if asked for), so a file
    read once resides once.
    """

    def __init__(self, tensors: Mapping[str, HeldTensor], *, source: Path | None = None):
        self._tensors = dict(tensors)
        #: The one file the blocks are read from, where known (the packed cache's key).
        self.source = source

    def __getitem__(self, name: str) -> HeldMatrix:
        return self.read(name, 0, self.shape(name)[0])

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def tensors(self) -> dict[str, HeldTensor]:
        """Name -> where each matrix lies (to merge the blocks of several files)."""
        return dict(self._tensors)

    def shape(self, name: str) -> tuple[int, int]:
        """``(N, K)`` of matrix ``name``, without reading it."""
        return self._tensors[name].shape

    def identity(self, name: str) -> list[object]:
        """What matrix ``name``'s values are made from: its GGML type, shape, bytes'
        span in the file and row order (a digest), as JSON values."""
        tensor = self._tensors[name]
        order = None
        if tensor.order is not None:
            order = hashlib.blake2b(tensor.order.astype(np.int64).tobytes(), digest_size=8)
        return [
            tensor.type_name,
            list(tensor.shape),
            list(tensor.span),
            None if order is None else order.hexdigest(),
        ]

    def format(self, name: str) -> PackedFormat:
        """The kernel format matrix ``name`` is read in."""
        return HELD_FORMATS[self._tensors[name].type_name]

    def stacked(self, names: Sequence[str]) -> tuple[PackedFormat, int, int]:
        """``(format, N, K)`` of matrices ``names`` stacked by rows: the smallest
        format holding them all (:func:`~maxkv.cpu.quantized.stacked_format`)."""
        fmt = stacked_format([self.format(name) for name in names])
        return fmt, sum(self.shape(name)[0] for name in names), self.shape(names[0])[1]

    def read(self, name: str, start: int, stop: int) -> HeldMatrix:
        """Rows ``start:stop`` of matrix ``name``.

        Raises:
            ModelLoadError: If the file's bytes are not blocks of its type.
        """
        tensor = self._tensors[name]
        rows = slice(start, stop) if tensor.order is None else tensor.order[start:stop]
        try:
            return from_file_bytes(
                tensor.type_name, tensor.raw[rows], (stop - start, tensor.shape[1])
            )
        except ValueError as error:
            raise ModelLoadError(f"cannot read {name}: {error}") from None

    def release(self, name: str | None = None) -> None:
        """Drops the pages of matrix ``name`` (every matrix: ``None``) from this
        process's resident memory; the file stays mapped."""
        tensors = [self._tensors[name]] if name else list(self._tensors.values())
        page = mmap.PAGESIZE
        for tensor in tensors:
            mapping = tensor.mapping
            if mapping is None or mapping.closed:
                continue
            offset, length = tensor.span
            start = offset // page * page
            end = min(-(-(offset + length) // page) * page, len(mapping))
            if end > start:
                mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


class HeldWeights(Mapping[str, np.ndarray]):
    """A model's weights under Hugging Face names: ``dense`` float32 arrays, and
    the matrices ``blocks`` holds as their file stores them (see the module).

    As a mapping every weight reads as float32; a held matrix is dequantized
    on each access (``q * scale + offset``, exactly the file's values).
    """

    def __init__(self, dense: Mapping[str, np.ndarray], blocks: FileBlocks) -> None:
        overlap = sorted(set(dense) & set(blocks))
        if overlap:
            raise ValueError(f"weights {', '.join(overlap[:5])} are both dense and held")
        #: The float32 weights.
        self.dense: dict[str, np.ndarray] = dict(dense)
        #: The matrices held as blocks.
        self.blocks = blocks

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.dense:
            return self.dense[name]
        return self.blocks[name].dequantize()

    def __iter__(self) -> Iterator[str]:
        yield from self.dense
        yield from self.blocks

    def __len__(self) -> int:
        return len(self.dense) + len(self.blocks)

    def __contains__(self, name: object) -> bool:
        return name in self.dense or name in self.blocks


def check_held(config: DecoderConfig, weights: HeldWeights) -> HeldWeights:
    """:func:`~maxkv.models.config.check_weights` for held weights: every weight
    ``config`` needs is there with its shape (held matrices are checked by
    shape, not read); dense ones become float32.

    Raises:
        ModelLoadError: If a weight is missing or has the wrong shape.
    """
    shapes = {name: weights.blocks.shape(name) for name in weights.blocks}
    return HeldWeights(check_weights(config, weights.dense, shapes), weights.blocks)
