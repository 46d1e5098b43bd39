"""A model's weights held as its file stores them.

A GGUF file stores most matrices in blocks of small integers
(:mod:`maxkv.cpu.quantized`).  :class:`HeldWeights` is what
:func:`~maxkv.models.load_model` returns for such a file: the other tensors
(norms, biases, float16 or float32 matrices) as float32 arrays, and the
block-quantized matrices as :class:`FileBlocks`, read from the mapped file
when asked for and kept nowhere.  The decoder packs each of those straight
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
    GGUF_FORMATS,
    BlockQuantized,
    PackedFormat,
    from_gguf_blocks,
    stacked_format,
)
from .config import DecoderConfig, ModelLoadError, check_weights


@dataclass(frozen=True)
class HeldTensor:
    """One block-quantized matrix in a mapped file."""

    #: Its GGML type (one of :data:`~maxkv.cpu.quantized.GGUF_TYPES`).
    type_name: str
    #: ``(N, K)``.
    shape: tuple[int, int]
    #: Its bytes as uint8 ``[N, bytes per row]``, a view of the mapping.
    raw: np.ndarray
    #: Where its bytes lie in the mapping: ``(offset, length)``.
    span: tuple[int, int]
    #: The file's row of each of its rows (llama.cpp's Q/K permutation undone), or ``None``.
    order: np.ndarray | None = None


class FileBlocks(Mapping[str, BlockQuantized]):
    """Block-quantized matrices of a mapped file, each read when asked for.

    ``blocks[name]`` reads the matrix's bytes from the mapping into a new
    :class:`~maxkv.cpu.quantized.BlockQuantized`, :meth:`read` some of its
    rows; nothing is cached, so holding this mapping holds only the file's
    mapping.  :meth:`release` gives the pages of a matrix read so far back to
    the OS (read again if asked for), so a file read once resides once.
    """

    def __init__(
        self,
        tensors: Mapping[str, HeldTensor],
        mapping: mmap.mmap | None = None,
        *,
        source: Path | None = None,
    ):
        self._tensors = dict(tensors)
        self._mapping = mapping
        #: The file the blocks are read from, where known (the packed cache's key).
        self.source = source

    def __getitem__(self, name: str) -> BlockQuantized:
        return self.read(name, 0, self.shape(name)[0])

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

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
        return GGUF_FORMATS[self._tensors[name].type_name]

    def stacked(self, names: Sequence[str]) -> tuple[PackedFormat, int, int]:
        """``(format, N, K)`` of matrices ``names`` stacked by rows: the smallest
        format holding them all (:func:`~maxkv.cpu.quantized.stacked_format`)."""
        fmt = stacked_format([self.format(name) for name in names])
        return fmt, sum(self.shape(name)[0] for name in names), self.shape(names[0])[1]

    def read(self, name: str, start: int, stop: int) -> BlockQuantized:
        """Rows ``start:stop`` of matrix ``name``.

        Raises:
            ModelLoadError: If the file's bytes are not blocks of its type.
        """
        tensor = self._tensors[name]
        rows = slice(start, stop) if tensor.order is None else tensor.order[start:stop]
        try:
            return from_gguf_blocks(
                tensor.type_name, tensor.raw[rows], (stop - start, tensor.shape[1])
            )
        except ValueError as error:
            raise ModelLoadError(f"cannot read {name}: {error}") from None

    def release(self, name: str | None = None) -> None:
        """Drops the pages of matrix ``name`` (every matrix: ``None``) from this
        process's resident memory; the file stays mapped."""
        if self._mapping is None or self._mapping.closed:
            return
        spans = [self._tensors[name].span] if name else [t.span for t in self._tensors.values()]
        page = mmap.PAGESIZE
        for offset, length in spans:
            start = offset // page * page
            end = min(-(-(offset + length) // page) * page, len(self._mapping))
            if end > start:
                self._mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


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
