"""Host time per decode step to prepare the cache inputs.

maxkv: ``fetch`` once per ``num_steps`` steps, ``increment_cache_lengths``
between them, ``step`` to commit.  MAX paged: ``alloc`` + ``runtime_inputs``
per step, then ``update`` + ``step`` per request.  No model runs: this is the
cache bookkeeping a serving loop pays on the host.
"""

from __future__ import annotations

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef

from maxkv import ContinuousBatchingKVCacheManager, KVCacheParams

from .timing import median_seconds


def maxkv_step_overhead_us(
    session: InferenceSession, device: Device, batch: int, num_steps: int, *, repeats: int
) -> float:
    """Median microseconds per decode step for ``batch`` sequences."""
    params = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=8)
    manager = ContinuousBatchingKVCacheManager(params, batch, 4096, 1, [device], session)
    manager.warm_up()
    ids = manager.claim(batch)
    manager.step(dict.fromkeys(ids, 100))
    offsets = Buffer.from_numpy(np.arange(batch + 1, dtype=np.uint32)).to(device)
    tokens = Buffer.from_numpy(np.zeros(batch, dtype=np.int64)).to(device)

    def one_round() -> None:
        inputs = manager.fetch(ids, num_steps)
        for _ in range(num_steps - 1):
            inputs = manager.increment_cache_lengths(inputs, (tokens, offsets))
        manager.step(dict.fromkeys(ids, num_steps))
        device.synchronize()

    seconds = median_seconds(one_round, warmup=3, repeats=repeats)
    return seconds / num_steps * 1e6


def max_paged_step_overhead_us(
    session: InferenceSession, device: Device, batch: int, *, repeats: int
) -> float:
    """Median microseconds per decode step of MAX's ``PagedKVCacheManager``."""
    from max.nn.kv_cache import MHAKVCacheParams
    from max.pipelines.context import TextContext, TokenBuffer
    from max.pipelines.kv_cache import PagedKVCacheManager
    from max.pipelines.modeling.types import RequestID

    params = MHAKVCacheParams(
        dtype=DType.float32,
        n_kv_heads=1,
        head_dim=8,
        num_layers=1,
        page_size=128,
        devices=[DeviceRef.from_device(device)],
    )
    manager = PagedKVCacheManager(
        params=params, session=session, total_num_pages=batch * 40, max_batch_size=batch
    )
    contexts = []
    for _ in range(batch):
        ctx = TextContext(
            request_id=RequestID(),
            max_length=4096,
            tokens=TokenBuffer(np.zeros(100, dtype=np.int64)),
        )
        manager.claim(ctx)
        contexts.append(ctx)

    def one_step() -> None:
        for ctx in contexts:
            manager.alloc(ctx)
        manager.runtime_inputs([contexts])
        for ctx in contexts:
            ctx.update(0)
            manager.step(ctx)
        device.synchronize()

    return median_seconds(one_step, warmup=3, repeats=repeats) * 1e6
