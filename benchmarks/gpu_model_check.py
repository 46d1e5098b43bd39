"""maxkv's Llama graph on a GPU at a chosen depth, against the NumPy reference.

    python benchmarks/gpu_model_check.py [--layers 2] [--shape smollm2|tiny]
                                         [--device gpu|cpu] [--num-steps 1]

Builds a Llama of SmolLM2-135M's shape (hidden 576, 9 query heads over 3 KV
heads of 64, vocabulary 49,152; ``--shape tiny``: the built-in model's) with
``--layers`` layers of seeded random weights, compiles maxkv's graph for it on
the device (:class:`maxkv.models.LlamaModel` over a contiguous cache), decodes
three prompts greedily with the scheduler and compares the tokens with
:func:`maxkv.models.reference.greedy_reference` (float64 NumPy, no cache).
Prints the compile time and the verdict; exits 1 on a failure or a mismatch.
Written to find the depth at which MAX 26.7's GPU compile fails (README,
*Mojo side*); ``--device cpu`` runs the same check here.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from max.driver import CPU, Accelerator, Device
from max.engine import InferenceSession

from maxkv import ContinuousBatchingKVCacheManager
from maxkv.models import LlamaModel
from maxkv.models.config import LlamaConfig, Weights, random_weights
from maxkv.models.llama import cache_params
from maxkv.models.reference import greedy_reference
from maxkv.scheduler import ContinuousBatchingScheduler

#: (vocab, hidden, intermediate, query heads, KV heads, head_dim) per --shape.
SHAPES = {"smollm2": (49152, 576, 1536, 9, 3, 64), "tiny": (256, 64, 128, 4, 2, 16)}
PROMPTS = [[1, 5, 9, 200, 3], [7, 7, 100], [42]]
NEW_TOKENS = 6


def random_llama(shape: str, layers: int) -> tuple[LlamaConfig, Weights]:
    vocab, hidden, inter, heads, kv_heads, head_dim = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
    )
    return config, random_weights(config)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--num-steps", type=int, default=1, help="model steps per fetch")
    args = parser.parse_args()
    device: Device = Accelerator() if args.device == "gpu" else CPU()
    session = InferenceSession(devices=[device])
    config, weights = random_llama(args.shape, args.layers)
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), len(PROMPTS), 64, args.layers, [device], session
    )
    start = time.perf_counter()
    try:
        model = LlamaModel(config, weights, manager, session)
    except Exception:
        traceback.print_exc()
        print(f"{args.layers} layers: compile FAILED after {time.perf_counter() - start:.1f} s")
        return 1
    print(f"{args.layers} layers: compiled in {time.perf_counter() - start:.1f} s", flush=True)
    scheduler = ContinuousBatchingScheduler(
        model, manager, len(PROMPTS), args.num_steps, stop_at_eos=False
    )
    for prompt in PROMPTS:
        scheduler.submit(prompt, NEW_TOKENS)
    outputs, _ = scheduler.run()
    expected = [greedy_reference(config, weights, p, NEW_TOKENS) for p in PROMPTS]
    same = outputs == expected
    print(f"maxkv {outputs}\nnumpy {expected}\nsame tokens as NumPy: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
