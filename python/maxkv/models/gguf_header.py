"""A GGUF file's header, read in one pass: its metadata and its table of tensors.

``gguf.GGUFReader`` (the ``gguf`` package's) decodes every metadata value as
it opens a file, a NumPy view per string: a Llama 3 vocabulary (128,256
tokens and 280,147 merges) takes it 9 s on a 2-core server.  :func:`read_header`
walks the same bytes with :mod:`struct` and decodes a value only when asked
(:meth:`GGUFField.contents`), so opening an 8B file takes well under a
second.  The values and the tensor table are the reader's (version 2 and 3
files, little-endian); the file's bytes are untrusted until checked: every
length, count, type and offset is checked against the file, and anything
else is a :class:`~maxkv.models.config.ModelLoadError`.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelLoadError

_MAGIC = b"GGUF"
_UINT32, _STRING, _ARRAY = 4, 8, 9
#: GGUF's scalar value types -> their little-endian NumPy dtypes.
_SCALARS: dict[int, np.dtype[Any]] = {
    0: np.dtype("u1"),
    1: np.dtype("i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("?"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFField:
    """One metadata value: a scalar, a string, or an array of either.

    ``type`` is GGUF's value type (``gguf.GGUFValueType``), ``item_type`` an
    array's element type, ``count`` its length (1 for a scalar or string).
    """

    name: str
    type: int
    item_type: int
    count: int
    _buffer: Any
    _offset: int
    _path: Path

    def contents(self) -> Any:
        """The value: a Python ``int``, ``float``, ``bool`` or ``str``, or a list of them.

        Raises:
            ModelLoadError: If a string is not UTF-8, or the value is an array of arrays.
        """
        if self.item_type == _ARRAY:
            raise ModelLoadError(
                f"cannot read GGUF file {self._path}: metadata {self.name!r} is an array of "
                f"arrays, which maxkv does not read"
            )
        try:
            return self._contents()
        except UnicodeDecodeError:
            raise ModelLoadError(
                f"cannot read GGUF file {self._path}: metadata {self.name!r} is not UTF-8"
            ) from None

    def _contents(self) -> Any:
        if self.type == _STRING:
            return _string(self._buffer, self._offset)[0]
        if self.type != _ARRAY:
            return np.frombuffer(self._buffer, _SCALARS[self.type], 1, self._offset)[0].item()
        if self.item_type == _STRING:
            values, offset = [], self._offset
            for _ in range(self.count):
                value, offset = _string(self._buffer, offset)
                values.append(value)
            return values
        array = np.frombuffer(self._buffer, _SCALARS[self.item_type], self.count, self._offset)
        return array.tolist()

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table.

    ``shape`` as GGUF lists it (``ne0``, the fastest-varying dimension,
    first); ``data`` its bytes, uint8 ``[rows, bytes per row]`` (a view of
    the mapped file) where a row is ``shape[0]`` values.
    """

    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    data_offset: int
    n_bytes: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file opened by :func:`read_header`: ``fields`` by name, ``tensors`` in
    the file's order, ``mapping`` the file mapped read-only (its tensors' views)."""

    path: Path
    fields: dict[str, GGUFField]
    tensors: list[GGUFTensor]
    mapping: mmap.mmap


class _Bad(Exception):
    """What is wrong with a file's header (raised as a :class:`ModelLoadError`)."""


def read_header(path: Path) -> GGUFHeader:
    """Opens ``path`` and reads its metadata and tensor table (no tensor is read).

    Raises:
        ModelLoadError: If the file is missing, not GGUF, of another version or
            byte order, truncated, or its table does not fit the file.
    """
    try:
        return _read_header(path)
    except _Bad as bad:
        raise ModelLoadError(f"cannot read GGUF file {path}: {bad}") from None


def _read_header(path: Path) -> GGUFHeader:
    import gguf

    try:
        with path.open("rb") as file:
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as error:  # ValueError: an empty file
        raise _Bad(error) from None
    reader = _Reader(mapping)
    if reader.take(4) != _MAGIC:
        raise _Bad("not a GGUF file (no GGUF magic)")
    (version,) = reader.unpack("<I")
    if version not in (2, 3):
        order = " (or big-endian, which maxkv does not read)" if version & 0xFFFF == 0 else ""
        raise _Bad(f"GGUF version {version}{order}; maxkv reads 2 and 3")
    tensor_count, field_count = reader.unpack("<QQ")
    fields: dict[str, GGUFField] = {}
    for _ in range(field_count):
        name = reader.string()
        if name in fields:
            raise _Bad(f"metadata {name!r} appears twice")
        fields[name] = reader.field(name, path)
    entries = []
    for _ in range(tensor_count):
        name = reader.string()
        (dims,) = reader.unpack("<I")
        if dims > 4:
            raise _Bad(f"tensor {name!r} has {dims} dimensions")
        shape = reader.unpack(f"<{dims}Q")
        type_id, offset = reader.unpack("<IQ")
        if 0 in shape:
            raise _Bad(f"tensor {name!r} has an empty dimension {shape}")
        entries.append((name, shape, type_id, offset))
    if len({entry[0] for entry in entries}) != len(entries):
        raise _Bad("a tensor name appears twice")
    alignment = _DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        field = fields["general.alignment"]
        alignment = field.contents() if field.type == _UINT32 else 0
        if alignment <= 0 or alignment & (alignment - 1):
            raise _Bad("general.alignment is not a uint32 power of two")
    start = -(-reader.offset // alignment) * alignment
    tensors = []
    for name, shape, type_id, offset in entries:
        try:
            tensor_type = gguf.GGMLQuantizationType(type_id)
            per_block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        except (ValueError, KeyError):
            raise _Bad(f"tensor {name!r} has unknown type {type_id}") from None
        row = shape[0] if shape else 1
        if row % per_block:
            raise _Bad(f"tensor {name!r}'s rows of {row} are not blocks of {per_block}")
        rows, row_bytes = math.prod(shape[1:]), row // per_block * type_size
        begin, n_bytes = start + offset, rows * row_bytes
        if offset % alignment or begin + n_bytes > len(mapping):
            raise _Bad(f"tensor {name!r} lies outside the file's data (truncated?)")
        data = np.frombuffer(mapping, np.uint8, n_bytes, begin).reshape(rows, row_bytes)
        tensors.append(GGUFTensor(name, tuple(shape), tensor_type, begin, n_bytes, data))
    return GGUFHeader(path, fields, tensors, mapping)


def _string(buffer: Any, offset: int) -> tuple[str, int]:
    """The string at ``offset`` (a uint64 length, then UTF-8) and the offset after it."""
    (length,) = struct.unpack_from("<Q", buffer, offset)
    end = offset + 8 + length
    return str(buffer[offset + 8 : end], "utf-8"), end


class _Reader:
    """A cursor over the mapped header; every read checked against the file's end."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.offset = buffer, 0

    def _need(self, size: int) -> None:
        if size < 0 or self.offset + size > len(self.buffer):
            raise _Bad("truncated: its header runs past the end of the file")

    def take(self, size: int) -> bytes:
        self._need(size)
        data = self.buffer[self.offset : self.offset + size]
        self.offset += size
        return data

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        self._need(size)
        values = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        try:
            return str(self.take(length), "utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"the string at byte {self.offset - length} is not UTF-8") from None

    def skip_strings(self, count: int) -> None:
        buffer, offset, end = self.buffer, self.offset, len(self.buffer)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if offset + 8 > end:
                break
            offset += 8 + unpack(buffer, offset)[0]
        else:
            if offset <= end:
                self.offset = offset
                return
        raise _Bad("truncated: its header runs past the end of the file")

    def field(self, name: str, path: Path) -> GGUFField:
        (kind,) = self.unpack("<I")
        start = self.offset
        if kind == _STRING:
            self.string()
            return GGUFField(name, kind, kind, 1, self.buffer, start, path)
        if kind in _SCALARS:
            self.skip_values(kind, 1)
            return GGUFField(name, kind, kind, 1, self.buffer, start, path)
        if kind != _ARRAY:
            raise _Bad(f"metadata {name!r} has unknown type {kind}")
        item, count = self.unpack("<IQ")
        start = self.offset
        self.skip_values(item, count)
        return GGUFField(name, kind, item, count, self.buffer, start, path)

    def skip_values(self, kind: int, count: int, depth: int = 0) -> None:
        """Moves past ``count`` values of type ``kind`` (arrays of arrays too, a few deep)."""
        if kind == _STRING:
            self.skip_strings(count)
        elif kind in _SCALARS:
            self._need(count * _SCALARS[kind].itemsize)
            self.offset += count * _SCALARS[kind].itemsize
        elif kind == _ARRAY and depth < 4:
            for _ in range(count):
                item, inner = self.unpack("<IQ")
                self.skip_values(item, inner, depth + 1)
        else:
            raise _Bad(f"a metadata value has unknown type {kind} (or arrays nest too deep)")
