"""MAX 26.7's ``KVConnector`` protocol over maxkv's tiered block store.

:class:`TieredConnector` is what sits between a paged cache's device pages
and the tiers (:class:`~maxkv.tiers.store.TieredBlockStore`), with MAX's
signatures (``max.pipelines.kv_cache.kv_connector``): one leaf (``"maxkv"``,
full attention), blocks named by their page hash in bytes.  maxkv's
:class:`~maxkv.PagedKVCacheManager` drives it in MAX's order, per step:

1. ``lookup`` (a prompt is claimed): which of its next page hashes a tier holds
   (:meth:`~maxkv.PagedKVCacheManager.prefetch`, called when a request arrives,
   has brought them to host memory by then where it could);
2. ``load``: those blocks into fresh pages (a :class:`KVLoadRefused` for a
   block gone or found invalid since, after which the prompt computes the rest);
3. ``offload`` (the step committed full pages): their bytes into the host
   tier at once, the disk and Redis tiers by the store's writer thread;
4. the model runs.

Pages move through :class:`PageBuffers`.  On a CPU cache a page is host
memory, read and written in place.  On a GPU cache a call's pages are copied
through pinned staging memory with MAX's asynchronous copies
(``Buffer.inplace_copy_from`` on the device's queue, runs of consecutive pages
as one copy), ordered after the model's work on that queue, and the call waits
on one event for them.  Either way the copies are done when the call
returns: every call hands back a :class:`CompletedTransfer` and nothing stays
pinned.

Beyond MAX's signatures, ``load`` and ``offload`` take the blocks' ``tenant``
(keyword): the ``cache_salt`` of the sequences they belong to, whose key signs
them on disk and in Redis (:mod:`maxkv.tiers.auth`).  All blocks of one call
belong to one tenant; the default ``None`` is the tenant of unsalted requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from max.driver import Buffer, Usage
from max.dtype import DType
from max.nn.kv_cache import KVCacheGroupId
from max.nn.kv_cache.metrics import KVCacheMetrics
from max.pipelines.kv_cache.kv_connector import (
    ByteCount,
    CompletedTransfer,
    KVLoadFailed,
    KVLoadRefused,
)

from .store import TieredBlockStore

__all__ = ["LEAF", "KVLoadFailed", "KVLoadRefused", "PageBuffers", "TieredConnector"]

#: The one leaf (KV cache group) a maxkv cache has.
LEAF = "maxkv"


def host_view(buffer: Buffer) -> np.ndarray:
    """A NumPy view (no copy) of a host buffer; bfloat16, which NumPy lacks, as
    its uint16 bit patterns (what :class:`~maxkv.tiers.blocks.BlockLayout` stores)."""
    if buffer.dtype == DType.bfloat16:
        buffer = buffer.view(DType.uint16)
    array: np.ndarray = buffer.to_numpy()
    return array


def _page_runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, first page, count)`` of each run of consecutive pages in ``pages``."""
    runs: list[tuple[int, int, int]] = []
    for i, page in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == page and runs[-1][0] + runs[-1][2] == i:
            index, first, count = runs[-1]
            runs[-1] = (index, first, count + 1)
        else:
            runs.append((i, page, 1))
    return runs


def _rows(buffer: Buffer, start: int, stop: int) -> Buffer:
    """Rows ``[start, stop)`` of ``buffer`` along its first axis (a contiguous slice)."""
    return buffer[(slice(start, stop),) + (slice(None),) * (buffer.rank - 1)]


class PageBuffers:
    """A paged cache's buffers ``[num_pages, 2, layers, page_size, heads, head_dim]``,
    one per device: pages read or written as ``[n, devices, 2, ...]`` host arrays.

    Host buffers (a CPU cache) are read and written in place through NumPy
    views.  Device buffers (a GPU cache) are staged: a call's pages go
    through pinned host memory (``Usage.STAGING``) by MAX's asynchronous
    copies on each device's default queue, after the work queued there
    before (the step that wrote them), each run of consecutive pages one
    copy, and the call waits on one event per device.

    Args:
        buffers: The cache's buffers, one per device.
        staged: Copy through staging buffers even for host buffers (the
            device path, on any device); default: for device buffers only.
    """

    def __init__(self, buffers: Sequence[Buffer], *, staged: bool | None = None) -> None:
        self._buffers = list(buffers)
        self.staged = (not all(b.is_host for b in buffers)) if staged is None else staged
        self._views = [] if self.staged else [host_view(b) for b in self._buffers]

    @property
    def page_nbytes(self) -> int:
        return sum(int(b.num_elements // b.shape[0]) * b.element_size for b in self._buffers)

    def read_pages(self, pages: Sequence[int]) -> np.ndarray:
        """A host copy of ``pages`` of every device: ``[len(pages), devices, 2, ...]``."""
        pages = list(pages)
        if not self.staged:
            return np.stack([np.stack([v[p] for v in self._views]) for p in pages])
        per_device = []
        for buffer in self._buffers:
            staging = self._staging(buffer, len(pages))
            for index, first, count in _page_runs(pages):
                _rows(staging, index, index + count).inplace_copy_from(
                    _rows(buffer, first, first + count)
                )
            buffer.device.default_queue.record_event().synchronize()
            per_device.append(host_view(staging).copy())
        return np.stack(per_device, axis=1)

    def write_pages(self, pages: Sequence[int], blocks: np.ndarray) -> None:
        """Writes ``blocks[i]`` (``[devices, 2, ...]``) into page ``pages[i]`` of every
        device (done on return)."""
        pages = list(pages)
        if not self.staged:
            for page, block in zip(pages, blocks, strict=True):
                for d, view in enumerate(self._views):
                    view[page] = block[d]
            return
        if len(blocks) != len(pages):
            raise ValueError(f"{len(blocks)} blocks for {len(pages)} pages")
        for d, buffer in enumerate(self._buffers):
            staging = self._staging(buffer, len(pages))
            host_view(staging)[...] = blocks[:, d]
            for index, first, count in _page_runs(pages):
                _rows(buffer, first, first + count).inplace_copy_from(
                    _rows(staging, index, index + count)
                )
            # The staging memory is freed when this returns: wait for its copies.
            buffer.device.default_queue.record_event().synchronize()

    def read(self, page: int) -> np.ndarray:
        """A copy of ``page`` of every device."""
        block: np.ndarray = self.read_pages([page])[0]
        return block

    def write(self, page: int, block: np.ndarray) -> None:
        self.write_pages([page], block[None])

    @staticmethod
    def _staging(buffer: Buffer, n: int) -> Buffer:
        """Pinned host memory for ``n`` pages of ``buffer`` (its device's staging memory)."""
        return Buffer(
            buffer.dtype,
            [n, *buffer.shape[1:]],
            device=buffer.device,
            usage=Usage.STAGING | Usage.UNTRACKED,
        )


class TieredConnector:
    """A ``KVConnector`` (MAX 26.7) over one paged cache's pages and a tiered store.

    Args:
        store: The tiers (its layout is the cache's).
        pages: The cache's pages.
    """

    def __init__(self, store: TieredBlockStore, pages: PageBuffers) -> None:
        self.store = store
        self.pages = pages
        self._metrics = KVCacheMetrics()
        self._taken = KVCacheMetrics()

    @property
    def leaves(self) -> Mapping[str, KVCacheGroupId]:
        return {LEAF: KVCacheGroupId("full")}

    @property
    def name(self) -> str:
        return "maxkv-tiers"

    def lookup(
        self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: bytes | None = None
    ) -> Mapping[str, Sequence[bool]]:
        """Which of ``block_hashes`` some tier holds (presence only; nothing moves)."""
        del replica_idx, hint
        return {LEAF: self.store.contains(block_hashes)}

    def load(
        self,
        block_ids: Mapping[str, Sequence[int]],
        block_hashes: Mapping[str, Sequence[bytes]],
        replica_idx: int = 0,
        hint: bytes | None = None,
        *,
        tenant: str | None = None,
    ) -> CompletedTransfer:
        """Reads ``block_hashes[leaf][i]`` (of ``tenant``) into page ``block_ids[leaf][i]``
        (done on return).

        Raises:
            KVLoadRefused: At the first block no tier holds a valid copy of
                (the pages before it are loaded; the caller frees the rest).
        """
        del replica_idx, hint
        ids, hashes = block_ids.get(LEAF, ()), block_hashes.get(LEAF, ())
        if len(ids) != len(hashes):
            raise ValueError(f"{len(ids)} pages for {len(hashes)} block hashes")
        pages: list[int] = []
        blocks: list[np.ndarray] = []
        refused: bytes | None = None
        for page, block in zip(ids, hashes, strict=True):
            entry = self.store.get(block, tenant=tenant)
            if entry is None:
                refused = block
                break
            pages.append(page)
            blocks.append(entry[0])
        if pages:  # one batch of copies for the blocks found (the pages before a refusal)
            self.pages.write_pages(pages, np.stack(blocks))
            self._add(h2d_bytes_copied=sum(int(b.nbytes) for b in blocks))
        if refused is not None:
            self._add(connector_loads_refused=1)
            raise KVLoadRefused(f"block {refused.hex()} is in no tier", LEAF, refused)
        return CompletedTransfer()

    def offload(
        self,
        block_ids: Mapping[str, Sequence[int]],
        block_hashes: Mapping[str, Sequence[bytes]],
        replica_idx: int = 0,
        *,
        tenant: str | None = None,
    ) -> CompletedTransfer:
        """Copies each page not in host memory yet to the store (host now, disk/Redis soon,
        signed for ``tenant``)."""
        del replica_idx
        ids, hashes = block_ids.get(LEAF, ()), block_hashes.get(LEAF, ())
        taken, blocks = [], []
        for page, block in zip(ids, hashes, strict=True):
            if block in self.store.host:
                self.store.touch([block])
                continue
            taken.append(page)
            blocks.append(block)
        if taken:  # one batch of copies for the pages not in host memory yet
            for block, data in zip(blocks, self.pages.read_pages(taken), strict=True):
                self.store.put(block, data, tenant=tenant)
                self._add(d2h_bytes_copied=int(data.nbytes))
        return CompletedTransfer({LEAF: taken})

    def touch(self, block_hashes: Sequence[bytes], replica_idx: int = 0) -> None:
        del replica_idx
        self.store.touch(block_hashes)

    def poll_transfers(self) -> None:
        return

    def shutdown(self) -> None:
        self.store.close()

    @property
    def host_byte_count(self) -> ByteCount:
        host = self.store.host
        return ByteCount(free=host.budget_bytes - host.used_bytes, total=host.budget_bytes)

    @property
    def disk_byte_count(self) -> ByteCount:
        disk = self.store.disk
        if disk is None:
            return ByteCount(free=0, total=0)
        return ByteCount(free=disk.budget_bytes - disk.used_bytes, total=disk.budget_bytes)

    def reset_prefix_cache(self) -> None:
        """Forgets the local tiers (host, disk); the shared Redis tier keeps its blocks."""
        self.store.clear_local()

    @property
    def metrics(self) -> KVCacheMetrics:
        return self._metrics

    def take_metrics(self) -> KVCacheMetrics:
        taken, self._taken = self._taken, KVCacheMetrics()
        return taken

    def _add(self, **counts: int) -> None:
        for metrics in (self._metrics, self._taken):
            for name, value in counts.items():
                setattr(metrics, name, getattr(metrics, name) + value)
