"""A GGUF's packed tiles kept on disk between loads.

Packing a file's matrices into the tiles the CPU kernels stream
(:func:`~maxkv.models.decoder.graph_weights`) decodes every block once: about
half a minute for an 8B Q4_K_M file on two cores, at every load.  With
``MAXKV_PACKED_CACHE=1`` (the default) the first load also writes the tiles to
``<cache>/packed/<key>/`` (:func:`~maxkv.cachedir.cache_dir`), one raw file
per array beside a manifest, and later loads of the same file map them instead
(copy-on-write, as the GGUF itself is mapped): the file's bytes again, plus
about 7% (the tiles' scales).

The key is a digest of what the tiles are made from: the file (its resolved
path, size, modification time and inode), each stacked matrix's parts (GGML
type, shape, byte span, whether its rows are permuted) and the layout version
below; a file rewritten in place gets a new key.  What is mapped is checked
before the kernels see it: the manifest must name exactly the arrays the
layout asks for, with their shapes, and every array's SHA-256 digest must
match; otherwise the folder is removed and the tiles are packed again.
Writes go to a temporary folder renamed into place, so a reader never sees a
half-written one.  Nothing evicts old folders: delete ``<cache>/packed`` to
reclaim the space.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .. import settings
from ..cachedir import cache_dir
from ..cpu.features import usable_cores
from ..cpu.quantized import PackedFormat
from .held import FileBlocks

#: Tiles of one graph weight: ``(q, sm, format)``.
Tiles = tuple[np.ndarray, np.ndarray, PackedFormat]

#: Bumped whenever the tile layout or the way a format is chosen changes.
LAYOUT_VERSION = 2

#: Bytes hashed or copied at a time.
_CHUNK = 1 << 24


def load_or_pack(
    blocks: FileBlocks,
    matrices: Mapping[str, Sequence[str]],
    pack: Callable[[FileBlocks, Mapping[str, Sequence[str]]], dict[str, Tiles]],
    activations: str = "float32",
) -> dict[str, Tiles]:
    """``pack(blocks, matrices)``, or the same tiles from the disk cache.

    ``matrices``: graph weight name -> the held matrices it stacks by rows;
    ``activations``: the layout ``pack`` gives them
    (:meth:`~maxkv.cpu.quantized.PackedFormat.for_activations`).
    The cache is skipped without ``MAXKV_PACKED_CACHE`` or where ``blocks``
    does not know its file; a cache that cannot be read or written is
    reported on stderr and the tiles are packed as usual.
    """
    if not matrices or not settings.PACKED_CACHE.read() or blocks.source is None:
        return pack(blocks, matrices)
    try:
        folder = cache_dir() / "packed" / cache_key(blocks, matrices, activations)
    except OSError as error:  # the file is gone or unreadable: nothing to key
        _say(f"not cached ({error})")
        return pack(blocks, matrices)
    expected = _expected_shapes(blocks, matrices, activations)
    if folder.is_dir():
        found = _read(folder, expected)
        if found is not None:
            return found
        shutil.rmtree(folder, ignore_errors=True)
    tiles = pack(blocks, matrices)
    _write(folder, tiles)
    return tiles


def cache_key(
    blocks: FileBlocks, matrices: Mapping[str, Sequence[str]], activations: str = "float32"
) -> str:
    """The digest naming the folder of ``matrices``' tiles from ``blocks``' file,
    laid out for ``activations``."""
    assert blocks.source is not None
    source = blocks.source.resolve()
    stat = source.stat()
    recipe = {
        "layout": LAYOUT_VERSION,
        "activations": activations,
        "file": [str(source), stat.st_size, stat.st_mtime_ns, stat.st_ino],
        "matrices": {
            stem: [blocks.identity(part) for part in parts] for stem, parts in matrices.items()
        },
    }
    text = json.dumps(recipe, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


#: A graph weight's format and the shapes of its ``q`` and ``sm``.
Expected = tuple[PackedFormat, tuple[int, ...], tuple[int, ...]]


def _expected_shapes(
    blocks: FileBlocks, matrices: Mapping[str, Sequence[str]], activations: str
) -> dict[str, Expected]:
    """Graph weight -> ``(format, q shape, sm shape)`` the layout gives it."""
    out: dict[str, Expected] = {}
    for stem, parts in matrices.items():
        fmt, n, k = blocks.stacked(parts)
        fmt = fmt.for_activations(activations)
        out[stem] = (fmt, *fmt.shapes(n, k))
    return out


def _files(stem: str) -> tuple[str, str]:
    return f"{stem}.q", f"{stem}.sm"


def _read(folder: Path, expected: Mapping[str, Expected]) -> dict[str, Tiles] | None:
    """The tiles in ``folder`` if they are exactly the ones expected, else ``None``."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        arrays = manifest["arrays"]
        wanted: dict[str, tuple[list[int], str]] = {}
        for stem, (_, q_shape, sm_shape) in expected.items():
            q_name, sm_name = _files(stem)
            wanted[q_name] = (list(q_shape), "uint8")
            wanted[sm_name] = (list(sm_shape), "float32")
        if manifest.get("layout") != LAYOUT_VERSION or sorted(arrays) != sorted(wanted):
            raise ValueError("it holds other arrays")
        for name, (dims, kind) in wanted.items():
            if [arrays[name]["shape"], arrays[name]["dtype"]] != [dims, kind]:
                raise ValueError(f"{name} is not {kind} {dims}")

        def load(name: str) -> np.ndarray:
            shape, dtype = wanted[name]
            path = folder / name
            if path.stat().st_size != math.prod(shape) * np.dtype(dtype).itemsize:
                raise ValueError(f"{name} has another size")
            # Mapped copy-on-write, as the GGUF itself is: writable (MAX keeps a
            # reference to the array, so the mapping lives as long as the model),
            # page-aligned, its pages the page cache's until written.
            array = np.memmap(path, dtype, mode="c", shape=tuple(shape)).view(np.ndarray)
            view = _bytes(array)
            digest = hashlib.sha256()
            for start in range(0, view.nbytes, _CHUNK):
                digest.update(view[start : start + _CHUNK])
            if digest.hexdigest() != arrays[name]["sha256"]:
                raise ValueError(f"{name} does not match its digest")
            return array

        with ThreadPoolExecutor(_threads()) as pool:
            loaded = dict(zip(wanted, pool.map(load, wanted), strict=True))
    except (OSError, ValueError, KeyError, TypeError) as error:
        _say(f"{folder} not used ({error}): packing again")
        return None
    tiles = {}
    for stem, (fmt, _, _) in expected.items():
        q, sm = _files(stem)
        tiles[stem] = (loaded[q], loaded[sm], fmt)
    return tiles


def _write(folder: Path, tiles: Mapping[str, Tiles]) -> None:
    """Writes ``tiles`` to ``folder`` (through a temporary folder renamed into
    place); skipped, and said, where the disk lacks the room or refuses."""
    size = sum(q.nbytes + sm.nbytes for q, sm, _ in tiles.values())
    temporary = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(folder.parent).free
        if free < size + (1 << 30):
            _say(f"not cached: {size / 2**30:.1f} GiB of tiles, {free / 2**30:.1f} GiB free")
            return
        temporary.mkdir()

        def save(item: tuple[str, np.ndarray]) -> tuple[str, dict[str, object]]:
            name, array = item
            view = _bytes(np.ascontiguousarray(array))
            digest = hashlib.sha256()
            with (temporary / name).open("wb") as file:
                for start in range(0, view.nbytes, _CHUNK):
                    file.write(view[start : start + _CHUNK])
                    digest.update(view[start : start + _CHUNK])
            return name, {
                "shape": list(array.shape),
                "dtype": str(array.dtype),
                "sha256": digest.hexdigest(),
            }

        items = [
            (name, array)
            for stem, (q, sm, _) in tiles.items()
            for name, array in zip(_files(stem), (q, sm), strict=True)
        ]
        with ThreadPoolExecutor(_threads()) as pool:
            arrays = dict(pool.map(save, items))
        manifest = {"layout": LAYOUT_VERSION, "arrays": arrays}
        (temporary / "manifest.json").write_text(json.dumps(manifest, indent=1))
        try:
            temporary.rename(folder)
        except OSError:  # another process wrote it first
            pass
        else:
            _say(f"{size / 2**30:.2f} GiB of packed tiles kept in {folder}")
    except OSError as error:
        _say(f"not cached ({error})")
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _threads() -> int:
    """Arrays read or written at once (file I/O and hashing release the GIL)."""
    return max(1, min(usable_cores(), 8))


def _bytes(array: np.ndarray) -> memoryview:
    """A C-contiguous ``array``'s bytes, without a copy."""
    return memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _say(message: str) -> None:
    print(f"maxkv packed cache: {message}", file=sys.stderr, flush=True)
