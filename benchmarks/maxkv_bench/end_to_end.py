"""Greedy decoding throughput: the demo model on maxkv vs transformers (torch CPU)."""

from __future__ import annotations

import time

import numpy as np
from max.driver import Device
from max.engine import InferenceSession

from maxkv import ContinuousBatchingKVCacheManager
from maxkv.models.config import default_llama
from maxkv.models.decoder import DecoderModel, cache_params
from maxkv.serving.scheduler import ContinuousBatchingScheduler


def end_to_end(
    session: InferenceSession,
    device: Device,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    num_steps: int,
    *,
    repeats: int,
) -> dict[str, float | int | bool]:
    """Tokens/s of both on the same weights and prompts (medians of ``repeats`` runs)."""
    config, weights = default_llama()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, prompt_len).tolist() for _ in range(batch)]
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config),
        batch,
        prompt_len + new_tokens + num_steps,
        config.num_hidden_layers,
        [device],
        session,
    )
    model = DecoderModel(config, weights, manager, session)

    def run_maxkv() -> tuple[list[list[int]], float]:
        scheduler = ContinuousBatchingScheduler(model, manager, batch, num_steps)
        for prompt in prompts:
            scheduler.submit(prompt, new_tokens)
        start = time.perf_counter()
        outputs, _ = scheduler.run()
        return outputs, time.perf_counter() - start

    run_maxkv()  # warm-up
    maxkv_runs = [run_maxkv() for _ in range(repeats)]
    maxkv_s = float(np.median([t for _, t in maxkv_runs]))
    result: dict[str, float | int | bool] = {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "num_steps": num_steps,
        "maxkv_tokens_per_s": round(batch * new_tokens / maxkv_s, 1),
    }
    try:
        import torch

        from maxkv.models.hf import hf_llama
    except ImportError:
        return result
    hf = hf_llama(config, weights)
    ids = torch.tensor(prompts, dtype=torch.long)

    def run_hf() -> tuple[list[list[int]], float]:
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(  # type: ignore[attr-defined]
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, prompt_len:].tolist(), time.perf_counter() - start

    run_hf()
    hf_runs = [run_hf() for _ in range(repeats)]
    hf_s = float(np.median([t for _, t in hf_runs]))
    result["hf_tokens_per_s"] = round(batch * new_tokens / hf_s, 1)
    result["speedup"] = round(hf_s / maxkv_s, 2)
    result["same_tokens"] = maxkv_runs[0][0] == hf_runs[0][0]
    result["torch_threads"] = torch.get_num_threads()
    return result
