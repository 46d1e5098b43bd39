"""A NumPy device layer for the managers: their bookkeeping without a MAX session.

:class:`NumpyCacheDevice` does on host buffers what
:class:`maxkv.cache.device.MaxCacheDevice` does with MAX graphs: zero-filled
buffers, length increments, and token copies between two sequences (slots or
pages).  The real device layer is checked against the same expectations in the
``compile`` tier (``test_sequence_ops``, ``test_paged``, ``test_collection_graph``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType

from maxkv import ContinuousBatchingKVCacheManager, KVCacheParams, PagedKVCacheManager
from maxkv.cache.spec import KVCacheInputs


class NumpyCacheDevice:
    """:class:`maxkv.cache.protocol.CacheDevice` on the host, in NumPy (one CPU device)."""

    copies_supported = True

    def __init__(self) -> None:
        self.copies = 0
        self.increments = 0

    def zeros(self, shape: Sequence[int], dtype: DType) -> list[Buffer]:
        buffer = Buffer.zeros(list(shape), dtype, device=CPU())
        CPU().synchronize()
        return [buffer]

    def increment(self, row_offsets: Buffer, cache_lengths: Sequence[Buffer]) -> list[Buffer]:
        self.increments += 1
        delta = np.diff(row_offsets.to_numpy()).astype(np.uint32)
        return [Buffer.from_numpy(lengths.to_numpy() + delta) for lengths in cache_lengths]

    def copy_tokens(self, inputs: Sequence[KVCacheInputs], start: int, end: int) -> None:
        if end <= start:
            return
        self.copies += 1
        for blocks_buffer, lengths, table_buffer, _ in inputs:
            blocks, table = blocks_buffer.to_numpy(), table_buffer.to_numpy()
            assert lengths.to_numpy()[0] >= end, "copy past the source's cached tokens"
            if table.ndim == 1:  # contiguous: [slots, 2, layers, max_seq_len, ...]
                blocks[table[1], :, :, start:end] = blocks[table[0], :, :, start:end]
                continue
            page = blocks.shape[3]  # paged: [pages, 2, layers, page_size, ...]
            for t in range(start, end):
                blocks[table[1, t // page], :, :, t % page] = blocks[
                    table[0, t // page], :, :, t % page
                ]

    def warm_up(self) -> None:
        pass


def contiguous(
    params: KVCacheParams, slots: int, max_seq_len: int, num_layers: int = 1, **kw: object
) -> ContinuousBatchingKVCacheManager:
    """A contiguous manager on :class:`NumpyCacheDevice`."""
    return ContinuousBatchingKVCacheManager(
        params,
        slots,
        max_seq_len,
        num_layers,
        [CPU()],
        None,
        cache_device=NumpyCacheDevice(),
        **kw,  # type: ignore[arg-type]
    )


def paged(
    params: KVCacheParams,
    page_size: int,
    num_pages: int,
    max_batch_size: int,
    max_seq_len: int,
    num_layers: int = 1,
    **kw: object,
) -> PagedKVCacheManager:
    """A paged manager on :class:`NumpyCacheDevice`."""
    return PagedKVCacheManager(
        params,
        page_size,
        num_pages,
        max_batch_size,
        max_seq_len,
        num_layers,
        [CPU()],
        None,
        cache_device=NumpyCacheDevice(),
        **kw,  # type: ignore[arg-type]
    )
