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

On a CPU cache a page is host memory, so both copies are done when the call
returns: every call hands back a :class:`CompletedTransfer` and nothing stays
pinned.  Tiers need host-visible pages (:class:`PageBuffers` refuses others).

Beyond MAX's signatures, ``load`` and ``offload`` take the blocks' ``tenant``
(keyword): the ``cache_salt`` of the sequences they belong to, whose key signs
them on disk and in Redis (:mod:`maxkv.tiers.auth`).  All blocks of one call
belong to one tenant; the default ``None`` is the tenant of unsalted requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from max.driver import Buffer
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


class PageBuffers:
    """Host views of a paged cache's buffers ``[num_pages, 2, layers, page_size, heads, head_dim]``,
    one per device: a page read or written as one ``[devices, 2, ...]`` array.

    Raises:
        ValueError: If a buffer is not in host memory (a GPU cache).
    """

    def __init__(self, buffers: Sequence[Buffer]) -> None:
        if not all(b.is_host for b in buffers):
            raise ValueError("KV tiers need the pages in host memory (a CPU cache)")
        self._views = [host_view(b) for b in buffers]

    @property
    def page_nbytes(self) -> int:
        return sum(int(v[0].nbytes) for v in self._views)

    def read(self, page: int) -> np.ndarray:
        """A copy of ``page`` of every device."""
        return np.stack([v[page] for v in self._views])

    def write(self, page: int, block: np.ndarray) -> None:
        for d, view in enumerate(self._views):
            view[page] = block[d]


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
        for page, block in zip(ids, hashes, strict=True):
            entry = self.store.get(block, tenant=tenant)
            if entry is None:
                self._add(connector_loads_refused=1)
                raise KVLoadRefused(f"block {block.hex()} is in no tier", LEAF, block)
            self.pages.write(page, entry[0])
            self._add(h2d_bytes_copied=int(entry[0].nbytes))
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
        taken = []
        for page, block in zip(ids, hashes, strict=True):
            if block in self.store.host:
                self.store.touch([block])
                continue
            data = self.pages.read(page)
            self.store.put(block, data, tenant=tenant)
            self._add(d2h_bytes_copied=int(data.nbytes))
            taken.append(page)
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
