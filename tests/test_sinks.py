"""Attention sinks (StreamingLLM, TVM's ``EnableSlidingWindowForSeq``) through maxkv's
kernels, against transformers.

A Llama 3 checkpoint with ``llama3`` RoPE scaling (random weights, written by
transformers) decodes, one token a step, far past a window of 24 tokens with
4 sink tokens (kept in one page of 8), and with no sinks.  The reference is
transformers' own model over a cache edited as StreamingLLM does: when
maxkv's manager drops tokens, the same tokens leave transformers' cache and
the keys after them are rotated back by as many positions with the model's
RoPE frequencies (in torch), and each new token runs at its place in the
cache.  Every step's logits must agree.  The manager's rules (what is kept,
keys moved, copies before moving shared pages, swap) are checked on NumPy in
``test_window_pages``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.engine import InferenceSession

from maxkv import PagedKVCacheManager
from maxkv.models import DecoderModel, load_model
from maxkv.models.decoder import cache_params

from .family_checkpoints import save_family_checkpoint
from .streaming_reference import streaming_reference

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.compile

PAGE = 8
WINDOW = 24
SINK = 4


@pytest.mark.parametrize("sink", [SINK, 0], ids=["sinks", "window-only"])
def test_streaming_logits_equal_transformers_with_a_streaming_cache(
    sink: int, tmp_path: Path, session: InferenceSession
) -> None:
    from maxkv.models.hf import hf_from_pretrained

    directory = save_family_checkpoint(tmp_path, "llama3", seed=5)
    config, weights = load_model(directory)
    reference_step, reference_drop = streaming_reference(hf_from_pretrained(directory))
    manager = PagedKVCacheManager(
        cache_params(config),
        PAGE,
        16,
        1,
        64,
        config.num_hidden_layers,
        [CPU()],
        session,
        key_rotation=config.key_rotation(),
    )
    model = DecoderModel(config, weights, manager, session, output="logits")
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, config.vocab_size, 130).tolist()
    (seq,) = manager.claim(1)

    def run(new: list[int]) -> np.ndarray:
        start = manager.cache_lengths[seq]
        (kv,) = manager.fetch([seq], 1, active_lengths=[len(new)])
        ids = Buffer.from_numpy(np.array(new, dtype=np.int64))
        offsets = Buffer.from_numpy(np.array([0, len(new)], dtype=np.uint32))
        logits = model.execute(ids, offsets, kv).to_numpy()[0]
        np.testing.assert_allclose(logits, reference_step(new, start), atol=2e-4, rtol=1e-4)
        manager.step({seq: len(new)})
        return logits

    run(tokens[:20])
    manager.enable_sliding_window(seq, WINDOW, sink)
    sinks, evicted, longest = -(-sink // PAGE) * PAGE, 0, 0
    for token in tokens[20:]:
        run([token])
        _, _, now = manager.sliding_window_of(seq)  # type: ignore[misc]
        if now > evicted:  # the manager dropped a page: the reference drops the same tokens
            reference_drop(sinks, now - evicted)
            evicted = now
        longest = max(longest, manager.cache_lengths[seq])
    assert evicted > 100 - WINDOW  # the window slid the whole way
    assert longest <= sinks + WINDOW + PAGE - 1
    assert manager.free_pages == 16 - len(manager.pages(seq))
