"""transformers with a KV cache edited as StreamingLLM does: the independent
reference of maxkv's attention sinks (``test_sinks``, ``test_pipelines``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


def streaming_reference(
    hf: object,
) -> tuple[Callable[[list[int], int], np.ndarray], Callable[[int, int], None]]:
    """transformers' model with a cache that StreamingLLM edits: ``step(ids, start)``
    runs new tokens at positions ``start..``; ``drop(first, count)`` removes cached
    tokens ``[first, first + count)`` of every layer and rotates the keys after
    them back by ``count`` positions with the model's own RoPE frequencies (torch)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    rotary = hf.model.rotary_emb  # type: ignore[attr-defined]
    inv_freq = rotary.inv_freq.to(torch.float64)

    def step(ids: list[int], start: int) -> np.ndarray:
        positions = torch.arange(start, start + len(ids))[None]
        with torch.no_grad():
            out = hf(torch.tensor([ids]), position_ids=positions, past_key_values=cache)  # type: ignore[operator]
        return out.logits[0, -1].numpy()

    def drop(first: int, count: int) -> None:
        angle = -count * inv_freq
        cos, sin = torch.cos(angle), torch.sin(angle)
        for layer in cache.layers:
            keys, values = layer.keys, layer.values  # [1, heads, tokens, head_dim]
            kept = torch.cat([keys[:, :, :first], keys[:, :, first + count :]], dim=2)
            moved = kept[:, :, first:].to(torch.float64)
            half = moved.shape[-1] // 2
            a, b = moved[..., :half], moved[..., half:]
            kept[:, :, first:] = torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(
                keys.dtype
            )
            layer.keys = kept
            layer.values = torch.cat([values[:, :, :first], values[:, :, first + count :]], 2)

    return step, drop


def streaming_completion(
    directory: Path, prompt: str, new_tokens: int, window: int, sinks: int, page_size: int
) -> str:
    """Greedy completion of ``prompt`` (stops at token 0, as the test models' EOS) with
    the rule maxkv's manager documents: after each step, the oldest whole pages of
    the window past ``window + page_size - 1`` tokens leave the cache."""
    from transformers import AutoTokenizer

    from maxkv.models.hf import hf_from_pretrained

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    step, drop = streaming_reference(hf_from_pretrained(directory))
    kept = -(-sinks // page_size) * page_size
    ids = tokenizer(prompt).input_ids
    length, new, out = 0, ids, []
    for _ in range(new_tokens):
        token = int(np.argmax(step(new, length)))
        length += len(new)
        pages = (length - kept - window) // page_size
        if pages > 0:
            drop(kept, pages * page_size)
            length -= pages * page_size
        if token == 0:
            break
        out.append(token)
        new = [token]
    return str(tokenizer.decode(out, skip_special_tokens=True))
