"""Prefix caching and fork on the real model.

- Prefix caching: requests sharing a ``system`` message arrive one after
  another (batch 1, each alone, as in a chat service); the prefill time of
  each (its first step, which encodes the uncached rest of its prompt) with
  and without prefix caching, in the same run.
- Fork: ``fork`` of a sequence holding ``context`` tokens (a device copy of
  every layer's keys and values), against one batch-1 decode step at that
  context.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.engine import InferenceSession

from maxkv import ContinuousBatchingKVCacheManager
from maxkv.models.decoder import DecoderModel, cache_params
from maxkv.models.resolve import LoadedModel
from maxkv.serving.scheduler import ContinuousBatchingScheduler

from .timing import median_seconds

#: A ~256-token system message (SmolLM2's tokenizer) shared by every request.
SYSTEM_PROMPT = (
    "You are the help desk assistant of Northwind Rail, a regional railway. Passengers ask "
    "about timetables, tickets, luggage, bicycles, pets, accessibility, delays and refunds. "
    "Answer in at most three short sentences. Trains run every thirty minutes between six in "
    "the morning and midnight on weekdays, and every hour on weekends and public holidays. "
    "Single tickets are valid for three hours, day tickets until four in the morning of the "
    "next day, and monthly passes for thirty days from the first journey. Children under six "
    "travel free; children under fifteen pay half. Bicycles travel free outside the morning "
    "peak from seven to nine, and need a bicycle ticket at other times. Small pets in a "
    "carrier travel free; dogs on a lead need a child ticket. Every station has step-free "
    "access, and staff help passengers in wheelchairs when told fifteen minutes before "
    "departure. When a train is more than twenty minutes late, passengers may ask for a "
    "quarter of the fare back; after an hour, half. Lost property is kept at the central "
    "station for one month. If a question is not about Northwind Rail, say politely that "
    "you can only help with train travel."
)

QUESTIONS = [
    "Can I take my bicycle at eight in the morning?",
    "How long is a single ticket valid?",
    "My train was 40 minutes late. Can I get money back?",
    "Do children pay?",
    "Can I bring my dog?",
    "When do trains run on Sunday?",
    "Where can I find a lost umbrella?",
    "Is there step-free access at the stations?",
]


def prefix_caching_bench(
    session: InferenceSession,
    device: Device,
    model: LoadedModel,
    llama: DecoderModel,
    *,
    new_tokens: int = 16,
    repeats: int = 3,
) -> dict[str, Any]:
    """Prefill time per request, sequential arrivals, with and without prefix caching."""
    assert model.tokenizer is not None
    prompts = [model.tokenizer.encode_chat(q, system=SYSTEM_PROMPT) for q in QUESTIONS]
    c = model.config
    max_len = max(len(p) for p in prompts) + new_tokens + 4
    result: dict[str, Any] = {
        "system_prompt_tokens": len(model.tokenizer.encode_chat("", system=SYSTEM_PROMPT)),
        "requests": len(prompts),
    }
    outputs = {}
    for enabled in (False, True):
        first, later, hits = [], [], 0
        for _ in range(repeats + 1):  # the first pass warms up
            manager = ContinuousBatchingKVCacheManager(
                cache_params(c),
                1,
                max_len,
                c.num_hidden_layers,
                [device],
                session,
                enable_prefix_caching=enabled,
            )
            scheduler = ContinuousBatchingScheduler(llama, manager, 1, num_steps=4)
            for prompt in prompts:
                scheduler.submit(prompt, new_tokens)
            outputs[enabled], stats = scheduler.run()
            times = [r.prefill_s or 0.0 for r in scheduler.requests()]
            first.append(times[0])
            later.append(float(np.median(times[1:])))
            hits = stats.prefix_cache_hit_tokens
        key = "with" if enabled else "without"
        result[f"prefill_s_first_{key}"] = round(float(np.median(first[1:])), 4)
        result[f"prefill_s_later_median_{key}"] = round(float(np.median(later[1:])), 4)
        result[f"hit_tokens_{key}"] = hits
    result["later_over_first_with"] = round(
        result["prefill_s_later_median_with"] / result["prefill_s_first_with"], 3
    )
    result["same_tokens"] = outputs[True] == outputs[False]
    return result


def fork_bench(
    session: InferenceSession,
    device: Device,
    model: LoadedModel,
    llama: DecoderModel,
    *,
    context: int = 1000,
    repeats: int = 9,
) -> dict[str, Any]:
    """ms of ``fork`` of a ``context``-token sequence vs one batch-1 decode step there."""
    c = model.config
    manager = ContinuousBatchingKVCacheManager(
        cache_params(c), 2, context + 8, c.num_hidden_layers, [device], session
    )
    manager.warm_up()
    (seq,) = manager.claim(1)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, c.vocab_size, context).tolist()
    (inputs,) = manager.fetch([seq], active_lengths=[context])
    token = llama.execute(
        Buffer.from_numpy(np.array(prompt, dtype=np.int64)).to(device),
        Buffer.from_numpy(np.array([0, context], dtype=np.uint32)).to(device),
        inputs,
    )
    manager.step({seq: context})

    def fork_and_release() -> None:
        child = manager.fork(seq)
        manager.release(child)

    fork_ms = median_seconds(fork_and_release, warmup=2, repeats=repeats) * 1e3
    one = Buffer.from_numpy(np.array([0, 1], dtype=np.uint32)).to(device)

    def decode_step() -> None:
        (step_inputs,) = manager.fetch([seq])
        llama.execute(token, one, step_inputs).to_numpy()  # not committed: same state each time

    step_ms = median_seconds(decode_step, warmup=2, repeats=repeats) * 1e3
    kv_bytes = 2 * c.num_hidden_layers * context * c.num_key_value_heads * c.head_dim * 4
    return {
        "context": context,
        "fork_ms": round(fork_ms, 3),
        "decode_step_ms": round(step_ms, 3),
        "fork_over_decode_step": round(fork_ms / step_ms, 3),
        "copied_MB": round(kv_bytes / 1e6, 1),
        "fork_GBps": round(2 * kv_bytes / fork_ms / 1e6, 1),  # read + write
    }


def sequence_ops_bench(
    session: InferenceSession, device: Device, model: LoadedModel, *, quick: bool
) -> dict[str, Any]:
    """Both benchmarks with one compiled model."""
    c = model.config
    manager = ContinuousBatchingKVCacheManager(
        cache_params(c), 1, 16, c.num_hidden_layers, [device], session
    )
    llama = DecoderModel(c, model.weights, manager, session, quantized=model.quantized)
    start = time.perf_counter()
    return {
        "prefix_caching": prefix_caching_bench(
            session, device, model, llama, repeats=2 if quick else 3
        ),
        "fork": fork_bench(session, device, model, llama, repeats=5 if quick else 9),
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
