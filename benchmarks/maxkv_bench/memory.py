"""Bytes reserved vs bytes holding live tokens: continuous slots vs pages.

A continuous-batching slot reserves ``max_seq_len`` tokens for its whole life;
a paged cache reserves whole pages of the tokens present.  The stream of
requests has a realistic length spread (log-normal prompt and output lengths,
as in chat traffic), and the cache is sampled at random moments of the
requests' lives with ``batch`` of them in flight.
"""

from __future__ import annotations

import numpy as np


def memory_footprint(
    max_seq_lens: list[int],
    *,
    batch: int = 32,
    page_size: int = 128,
    bytes_per_token: int = 2 * 32 * 8 * 128 * 2,
    snapshots: int = 2000,
    seed: int = 0,
) -> list[dict[str, float | int | str]]:
    """Mean reserved and live bytes per scheme and ``max_seq_len``.

    ``bytes_per_token`` defaults to a Llama-3-8B-like cache: K and V, 32
    layers, 8 KV heads of 128, bfloat16 (128 KiB per token).
    """
    rng = np.random.default_rng(seed)
    rows: list[dict[str, float | int | str]] = []
    for max_seq_len in max_seq_lens:
        prompts = rng.lognormal(mean=np.log(200), sigma=0.9, size=(snapshots, batch))
        outputs = rng.lognormal(mean=np.log(150), sigma=0.8, size=(snapshots, batch))
        total = np.clip(prompts + outputs, 1, max_seq_len)
        prompt = np.minimum(prompts, total)
        # A moment in each request's life: its prompt plus part of its output.
        live = np.ceil(prompt + rng.uniform(size=total.shape) * (total - prompt))
        live_bytes = live.sum(axis=1).mean() * bytes_per_token
        schemes = {
            "continuous": float(batch * max_seq_len),
            "paged": float((np.ceil(live / page_size) * page_size).sum(axis=1).mean()),
        }
        for scheme, reserved_tokens in schemes.items():
            reserved = reserved_tokens * bytes_per_token
            rows.append(
                {
                    "scheme": scheme,
                    "max_seq_len": max_seq_len,
                    "batch": batch,
                    "page_size": page_size,
                    "reserved_bytes": int(reserved),
                    "live_bytes": int(live_bytes),
                    "utilization": round(live_bytes / reserved, 4),
                }
            )
    return rows
