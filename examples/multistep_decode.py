"""maxkv's main job: continuous batching with multistep decoding on a Llama.

    python examples/multistep_decode.py                    # built-in model, a few prompts
    python examples/multistep_decode.py --num-steps 1      # same tokens, more host syncs
    python examples/multistep_decode.py --model-dir DIR --prompts-json prompts.json --verify

Requests join and leave mid-flight (more prompts than batch slots); each
fetch covers --num-steps model steps whose tokens stay on the device; the
host reads tokens back once per round.  --verify checks every output against
a NumPy full-recompute forward pass (no cache) and, when torch is installed,
Hugging Face transformers' greedy generate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from max.driver import CPU, Accelerator, Device, accelerator_count
from max.engine import InferenceSession
from tqdm import tqdm

from maxkv import ContinuousBatchingKVCacheManager
from maxkv.models import LlamaModel, ModelLoadError, default_llama, load_llama
from maxkv.models.hf import hf_from_pretrained, hf_generate, hf_llama, transformers_available
from maxkv.models.llama import cache_params, greedy_reference
from maxkv.scheduler import ContinuousBatchingScheduler

DEFAULT_PROMPTS = [
    [1, 15, 27, 99, 4, 8],
    [1, 200],
    [1, 42, 42, 42, 7, 19, 101, 33, 250, 5, 66],
    [1, 3],
    [1, 77, 12, 180, 9],
    [1, 120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131, 132],
    [1, 9, 8, 7],
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="Hugging Face Llama directory")
    parser.add_argument("--prompts-json", type=Path, help="JSON list of token-id lists")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=3)
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--output-json", type=Path, help="write outputs and the summary here")
    parser.add_argument("--verify", action="store_true", help="check against references")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    return parser.parse_args(argv)


def load_prompts(path: Path | None) -> list[list[int]]:
    if path is None:
        return DEFAULT_PROMPTS
    try:
        prompts = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read prompts from {path}: {error}") from None
    if not isinstance(prompts, list) or not all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
    ):
        raise ValueError(f"{path} must hold a JSON list of non-empty token-id lists")
    return prompts


def pick_device(name: str) -> Device:
    if name == "gpu":
        if accelerator_count() == 0:
            raise ValueError("--device gpu: no GPU is visible to MAX")
        return Accelerator()
    return CPU()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if min(args.max_new_tokens, args.max_batch_size, args.num_steps) < 1:
            raise ValueError("--max-new-tokens, --max-batch-size and --num-steps must be >= 1")
        prompts = load_prompts(args.prompts_json)
        config, weights = load_llama(args.model_dir) if args.model_dir else default_llama()
        device = pick_device(args.device)
    except (ModelLoadError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    max_seq_len = max(len(p) for p in prompts) + args.max_new_tokens + args.num_steps
    session = InferenceSession(devices=[device])
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config),
        args.max_batch_size,
        max_seq_len,
        config.num_hidden_layers,
        [device],
        session,
    )
    print(
        f"model: {args.model_dir or 'built-in random Llama'} ({config.num_hidden_layers} layers, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads of {config.head_dim}); "
        f"{len(prompts)} prompts, batch {args.max_batch_size}, num_steps {args.num_steps}; "
        "compiling (the first run takes a few minutes)..."
    )
    model = LlamaModel(config, weights, manager, session)
    scheduler = ContinuousBatchingScheduler(model, manager, args.max_batch_size, args.num_steps)
    try:
        for prompt in prompts:
            scheduler.submit(prompt, args.max_new_tokens)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    total = len(prompts) * args.max_new_tokens
    with tqdm(total=total, unit="tok", desc="decoding") as bar:
        outputs, stats = scheduler.run(lambda _stats, produced: bar.update(produced))

    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        print(f"request {i}: prompt {len(prompt)} tokens -> {output}")
    summary = stats.as_dict()
    print(
        f"summary: {summary['generated_tokens']} tokens in {summary['elapsed_s']} s "
        f"({summary['tokens_per_s']} tokens/s), {summary['model_steps']} model steps in "
        f"{summary['rounds']} rounds, mean batch occupancy {summary['mean_batch_occupancy']}, "
        f"host syncs per generated token {summary['host_syncs_per_token']}"
    )

    failures = 0
    if args.verify:
        references = {
            "numpy": [greedy_reference(config, weights, p, args.max_new_tokens) for p in prompts]
        }
        if transformers_available():
            hf = hf_from_pretrained(args.model_dir) if args.model_dir else hf_llama(config, weights)
            references["transformers"] = hf_generate(hf, prompts, args.max_new_tokens)
        else:
            print("verify: torch/transformers not installed; NumPy reference only")
        for name, expected in references.items():
            bad = [i for i, (a, b) in enumerate(zip(outputs, expected, strict=True)) if a != b]
            failures += len(bad)
            verdict = "all match" if not bad else f"MISMATCH in requests {bad}"
            print(f"verify against {name}: {verdict} ({len(expected)} requests)")

    if args.output_json:
        args.output_json.write_text(json.dumps({"outputs": outputs, "summary": summary}, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
