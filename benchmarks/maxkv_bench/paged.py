"""Paged vs contiguous, both maxkv, in one run.

- ``attention``: one decode step of flash attention over the same keys,
  values and queries, written into a contiguous slot and into pages (the
  page table interleaves pages of different sequences); outputs must be
  bit-identical.
- ``overhead``: host time of ``fetch`` (batch 64) for each manager.
- ``memory``: real allocations.  32 requests with log-normal lengths (as in
  :mod:`maxkv_bench.memory`) are claimed and fetched on a real
  ``PagedKVCacheManager`` and a real ``ContinuousBatchingKVCacheManager``;
  utilisation = live tokens / tokens the manager holds storage for (pages
  held x page size, or slots x ``max_seq_len``).
- ``end_to_end``: SmolLM2-135M-Instruct, the same prompts through the
  scheduler over each manager, tokens/s (median of repeats) and whether the
  tokens are the same.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import numpy as np
from max.driver import CPU, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph

from maxkv import ContinuousBatchingKVCacheManager, KVCacheParams, PagedKVCacheManager, kernels_path
from maxkv import ops as kvops
from maxkv.cache.protocol import KVCacheManagerBase
from maxkv.models.decoder import DecoderModel, cache_params
from maxkv.models.resolve import LoadedModel
from maxkv.serving.scheduler import ContinuousBatchingScheduler

from .attention import AttentionShape, DecodeData, make_data, query_buffers, query_types
from .timing import interleaved_median_seconds, median_seconds


class _DecodeAttention:
    """flash_attention_ragged over one maxkv manager (contiguous or paged)."""

    def __init__(
        self, manager: KVCacheManagerBase, shape: AttentionShape, session: InferenceSession
    ):
        self.manager = manager
        self.shape = shape
        params = manager.params
        ref = DeviceRef.from_device(manager.devices[0])
        types = [*manager.input_symbols()[0], *query_types(shape, ref)]
        with Graph("decode_attention", input_types=types, custom_extensions=[kernels_path()]) as g:
            *cache, q, offsets = (v.tensor for v in g.inputs)
            kv = manager.collection_fetcher()(*cache)
            g.output(kvops.flash_attention_ragged(params, q, offsets, kv, 0))
        self.model: Model = session.load(g)

    def prepare(self, data: DecodeData) -> list[Buffer]:
        """Writes the data into the cache (through the manager's own table) and fetches."""
        batch, context = data.batch, data.context
        m = self.manager
        ids = m.claim(batch)
        # Grow the sequences in turns so the pages of different sequences interleave.
        chunk = self.shape.page_size
        done = 0
        while done < context - 1:
            step = min(chunk, context - 1 - done)
            m.fetch(ids, active_lengths=[step] * batch)
            m.step({i: step for i in ids})
            done += step
        (inputs,) = m.fetch(ids)
        storage = inputs[0].to_numpy()
        table = inputs[2].to_numpy()
        for b in range(batch):
            for t in range(context):
                if isinstance(m, PagedKVCacheManager):
                    page, row = table[b, t // m.page_size], t % m.page_size
                    storage[page, 0, 0, row] = data.k[b, t]
                    storage[page, 1, 0, row] = data.v[b, t]
                else:
                    storage[table[b], 0, 0, t] = data.k[b, t]
                    storage[table[b], 1, 0, t] = data.v[b, t]
        for i in ids:
            m.release(i)
        return [*inputs, *query_buffers(data, m.devices[0])]

    def run(self, inputs: list[Buffer]) -> Buffer:
        (out,) = self.model.execute(*inputs)
        return out


def paged_attention(
    session: InferenceSession,
    device: Device,
    batches: list[int],
    contexts: list[int],
    *,
    warmup: int,
    repeats: int,
    rounds: int = 3,
) -> list[dict[str, Any]]:
    """Median ms of one decode step, contiguous vs paged, same data (bit-identical outputs).

    Each point's two sides are timed in turns (``repeats`` each), in ``rounds``
    rounds over all points; ``ratio`` is the median of the rounds' paged /
    contiguous ratios, ``round_ratios`` lists them.
    """
    shape = AttentionShape(max_batch=max(batches), max_context=max(contexts))
    params = KVCacheParams(DType.float32, shape.n_heads, shape.head_dim)
    pages = shape.max_batch * math.ceil(shape.max_context / shape.page_size)
    contiguous = _DecodeAttention(
        ContinuousBatchingKVCacheManager(
            params, shape.max_batch, shape.max_context, 1, [device], session
        ),
        shape,
        session,
    )
    paged = _DecodeAttention(
        PagedKVCacheManager(
            params, shape.page_size, pages, shape.max_batch, shape.max_context, 1, [device], session
        ),
        shape,
        session,
    )
    points = []
    for batch in batches:
        for context in contexts:
            data = make_data(batch, context, shape)
            a, b = contiguous.prepare(data), paged.prepare(data)
            if not np.array_equal(contiguous.run(a).to_numpy(), paged.run(b).to_numpy()):
                raise RuntimeError(f"paged and contiguous differ at batch {batch}, {context}")
            points.append((batch, context, a, b))
    # Every point is measured once per round, rounds one after another, so a slow
    # spell of a shared machine moves one round's figures, not a point's median.
    samples: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for batch, context, a, b in points:

            def run_contiguous(inputs: list[Buffer] = a) -> None:
                contiguous.run(inputs)

            def run_paged(inputs: list[Buffer] = b) -> None:
                paged.run(inputs)

            medians = interleaved_median_seconds(
                {"contiguous": run_contiguous, "paged": run_paged}, warmup=warmup, repeats=repeats
            )
            samples.setdefault((batch, context), []).append(
                (medians["contiguous"], medians["paged"])
            )
    rows = []
    for (batch, context), pairs in samples.items():
        c_ms = statistics.median(c for c, _ in pairs) * 1e3
        p_ms = statistics.median(p for _, p in pairs) * 1e3
        rows.append(
            {
                "batch": batch,
                "context": context,
                "contiguous_ms": round(c_ms, 4),
                "paged_ms": round(p_ms, 4),
                "ratio": round(statistics.median(p / c for c, p in pairs), 3),
                "round_ratios": [round(p / c, 3) for c, p in pairs],
                "bit_identical": True,
            }
        )
    return rows


def fetch_overhead(
    session: InferenceSession, batch: int = 64, repeats: int = 200
) -> dict[str, float]:
    """Host time of one ``fetch`` (decode step, sequences of 500 tokens), each manager."""
    params = KVCacheParams(DType.float32, 1, 8)
    managers: dict[str, KVCacheManagerBase] = {
        "contiguous": ContinuousBatchingKVCacheManager(params, batch, 1024, 2, [CPU()], session),
        "paged": PagedKVCacheManager(params, 16, batch * 64, batch, 1024, 2, [CPU()], session),
    }
    result = {}
    for name, m in managers.items():
        ids = m.claim(batch)
        m.fetch(ids, active_lengths=[500] * batch)
        m.step({i: 500 for i in ids})

        def fetch(m: KVCacheManagerBase = m, ids: list[int] = ids) -> None:
            m.fetch(ids)

        result[f"{name}_fetch_us"] = round(
            median_seconds(fetch, warmup=10, repeats=repeats) * 1e6, 1
        )
    return result


def paged_memory(
    session: InferenceSession,
    max_seq_lens: list[int],
    *,
    batch: int = 32,
    page_size: int = 128,
    snapshots: int = 40,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Utilisation with real managers: live tokens / tokens with storage held."""
    rng = np.random.default_rng(seed)
    params = KVCacheParams(DType.float32, 1, 1)  # tiny rows: the count, not the bytes, matters
    rows = []
    for max_seq_len in max_seq_lens:
        pages = batch * math.ceil(max_seq_len / page_size)
        paged = PagedKVCacheManager(
            params, page_size, pages, batch, max_seq_len, 1, [CPU()], session
        )
        contiguous = ContinuousBatchingKVCacheManager(
            params, batch, max_seq_len, 1, [CPU()], session
        )
        live_total = paged_held = contiguous_held = 0
        for _ in range(snapshots):
            prompts = rng.lognormal(mean=np.log(200), sigma=0.9, size=batch)
            outputs = rng.lognormal(mean=np.log(150), sigma=0.8, size=batch)
            total = np.clip(prompts + outputs, 1, max_seq_len)
            prompt = np.minimum(prompts, total)
            live = np.ceil(prompt + rng.uniform(size=batch) * (total - prompt)).astype(int)
            live = np.clip(live, 1, max_seq_len)
            for m in (paged, contiguous):
                ids = m.claim(batch)
                m.fetch(ids, active_lengths=live.tolist())
                m.step(dict(zip(ids, live.tolist(), strict=True)))
            paged_held += (paged.num_pages - paged.free_pages) * page_size
            contiguous_held += batch * max_seq_len  # every claimed slot holds max_seq_len
            live_total += int(live.sum())
            for m in (paged, contiguous):
                for i in list(m.cache_lengths):
                    m.release(i)
            assert paged.free_pages == paged.num_pages
        rows.append(
            {
                "max_seq_len": max_seq_len,
                "batch": batch,
                "page_size": page_size,
                "contiguous_utilization": round(live_total / contiguous_held, 4),
                "paged_utilization": round(live_total / paged_held, 4),
            }
        )
    return rows


def paged_end_to_end(
    session: InferenceSession,
    device: Device,
    model: LoadedModel,
    prompts: list[list[int]],
    *,
    new_tokens: int = 64,
    num_steps: int = 4,
    page_size: int = 16,
    repeats: int = 3,
) -> dict[str, Any]:
    """Tokens/s of the scheduler over each manager on the real model, same prompts."""
    c = model.config
    max_len = max(len(p) for p in prompts) + new_tokens + num_steps
    batch = len(prompts)
    managers: dict[str, KVCacheManagerBase] = {
        "contiguous": ContinuousBatchingKVCacheManager(
            cache_params(c), batch, max_len, c.num_hidden_layers, [device], session
        ),
        "paged": PagedKVCacheManager(
            cache_params(c),
            page_size,
            batch * math.ceil(max_len / page_size),
            batch,
            max_len,
            c.num_hidden_layers,
            [device],
            session,
        ),
    }
    result: dict[str, Any] = {"batch": batch, "new_tokens": new_tokens, "page_size": page_size}
    outputs = {}
    for name, manager in managers.items():
        llama = DecoderModel(c, model.weights, manager, session, quantized=model.quantized)
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            scheduler = ContinuousBatchingScheduler(
                llama, manager, batch, num_steps, stop_at_eos=False
            )
            for prompt in prompts:
                scheduler.submit(prompt, new_tokens)
            start = time.perf_counter()
            outputs[name], _ = scheduler.run()
            times.append(time.perf_counter() - start)
        result[f"{name}_tokens_per_s"] = round(batch * new_tokens / float(np.median(times[1:])), 1)
    result["same_tokens"] = outputs["contiguous"] == outputs["paged"]
    return result


def paged_bench(
    session: InferenceSession, device: Device, model: LoadedModel, *, quick: bool
) -> dict[str, Any]:
    """Every paged-vs-contiguous measure of this module."""
    from .real import QUESTIONS

    assert model.tokenizer is not None
    prompts = [model.tokenizer.encode_chat(q) for q in QUESTIONS[:8]]
    return {
        "attention": paged_attention(
            session,
            device,
            [1, 8] if quick else [1, 8, 32],
            [512, 2048] if quick else [128, 512, 2048],
            warmup=3,
            repeats=21 if quick else 41,
        ),
        "overhead": fetch_overhead(session),
        "memory": paged_memory(session, [512, 2048, 8192]),
        "end_to_end": paged_end_to_end(session, device, model, prompts, repeats=2 if quick else 3),
    }
