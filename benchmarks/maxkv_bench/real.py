"""End to end on a real model: maxkv vs transformers vs MAX's own pipeline.

SmolLM2-135M-Instruct (float32, the same dequantized weights everywhere),
chat prompts of about 40 tokens, ``new_tokens`` generated per request with
no early stop (greedy; EOS does not end a request), at several batch sizes.
All sides run in this process and are interleaved: after a warm-up run of
each, every repeat runs maxkv, transformers and MAX once; medians.

- maxkv: :class:`~maxkv.serving.scheduler.ContinuousBatchingScheduler` (its
  multistep decoding, ``num_steps`` per fetch) over maxkv's Llama graph,
  without prefix caching (``maxkv_*``) and with it (``maxkv_prefix_caching_*``:
  the chat prompts share SmolLM2's default system message, which a request
  then copies from the one that computed it instead of prefilling it again).
  A fresh manager per run, so nothing is reused from one repeat to the next.
- transformers: ``generate`` on a left-padded batch with an attention mask,
  float32, torch threads = CPU cores, ``eos_token_id=[]`` (nothing stops it).
- MAX: MAX 26.7's own Llama pipeline (``LlamaForCausalLM``, its paged KV
  cache and sampler) on a float32 Hugging Face export of the same weights,
  driven by ``max.pipelines.lib.generate.generate`` with ``top_k=1`` and
  ``ignore_eos=True``, in its default configuration, which has prefix caching
  on (pages of 128 tokens; the settings are recorded with the results).

On a GPU (``device`` not the host): transformers runs on CUDA and MAX's
pipeline on the accelerator; there is no roofline unless the machine's read
bandwidth and matmul rate are given (``benchmarks/run.py`` measures them on
the CPU only).

The roofline of a batch-``b`` decode step reads every weight once (float32)
and the KV cache of ``b`` sequences at the mean context, and does
``2 b`` FLOPs per weight plus attention:
``time = max(bytes / read_bandwidth, flops / matmul_rate)``; tokens/s = b / time.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from max.driver import Device
from max.dtype import DType
from max.engine import InferenceSession

from maxkv import ContinuousBatchingKVCacheManager
from maxkv.models.config import DecoderConfig
from maxkv.models.decoder import DecoderModel, cache_params
from maxkv.models.resolve import LoadedModel, open_model
from maxkv.serving.scheduler import ContinuousBatchingScheduler

#: Short questions; their chat prompts (with SmolLM2's default system
#: message) are 35 to 45 tokens.
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is the chemical symbol for gold?",
    "What is the largest ocean on Earth?",
    "Give me three tips for staying healthy.",
    "What is photosynthesis? Answer in one sentence.",
    "Write one sentence about dogs.",
    "Why is exercise good for you?",
    "How do airplanes stay in the air?",
    "What causes the seasons on Earth?",
    "Explain what a computer program is.",
    "Why do leaves change color in autumn?",
    "What is the difference between weather and climate?",
    "How does a rainbow form?",
    "What are the benefits of reading books?",
    "Describe the water cycle briefly.",
    "What is gravity?",
    "Why is the ocean salty?",
    "How do bees make honey?",
    "What is the speed of light?",
    "Name two famous painters.",
    "What does a thermometer measure?",
    "How many planets are in the solar system?",
    "What is a volcano?",
    "Why do we need to drink water?",
    "What is the tallest mountain in the world?",
    "How do plants grow from seeds?",
    "What is electricity?",
    "Give an example of a renewable energy source.",
    "What is the main language spoken in Brazil?",
    "Why is the sky dark at night?",
    "What is an atom?",
]


def _median(values: list[float]) -> float:
    return float(np.median(values))


class MaxkvSide:
    """maxkv's scheduler over a fresh cache per run; one compiled graph (``build``,
    called with the first run's manager) serves managers of every batch size."""

    def __init__(
        self,
        session: InferenceSession,
        device: Device,
        config: DecoderConfig,
        max_len: int,
        build: Callable[[ContinuousBatchingKVCacheManager], DecoderModel],
        dtype: DType = DType.float32,
    ) -> None:
        self.session, self.device, self.config, self.max_len = session, device, config, max_len
        self.build, self.dtype = build, dtype
        self.llama: DecoderModel | None = None
        #: Prompt tokens the last prefix-caching run found in its prefix cache.
        self.prefix_hit_tokens = 0

    def run(
        self,
        prompts: list[list[int]],
        new_tokens: int,
        num_steps: int,
        *,
        prefix_caching: bool = False,
    ) -> list[list[int]]:
        c = self.config
        manager = ContinuousBatchingKVCacheManager(
            cache_params(c, self.dtype),
            len(prompts),
            self.max_len,
            c.num_hidden_layers,
            [self.device],
            self.session,
            enable_prefix_caching=prefix_caching,
        )
        if self.llama is None:
            self.llama = self.build(manager)
        scheduler = ContinuousBatchingScheduler(
            self.llama, manager, len(prompts), num_steps, stop_at_eos=False
        )
        for prompt in prompts:
            scheduler.submit(prompt, new_tokens)
        outputs, stats = scheduler.run()
        if prefix_caching:
            self.prefix_hit_tokens = stats.prefix_cache_hit_tokens
        return outputs


class _Transformers:
    def __init__(self, model: LoadedModel, gpu: bool) -> None:
        import torch

        from maxkv.models.hf import hf_from_pretrained

        assert model.path is not None
        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.where = "cuda" if gpu else "cpu"
        hf: Any = hf_from_pretrained(model.path)
        self.hf: Any = hf.to(self.where)
        self.pad = model.config.eos_token_ids[0] if model.config.eos_token_ids else 0

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        config = copy.deepcopy(self.hf.generation_config)
        config.do_sample = False
        config.max_new_tokens = new_tokens
        config.eos_token_id = []  # no early stop
        config.pad_token_id = self.pad
        with torch.no_grad():
            out = self.hf.generate(
                ids.to(self.where), attention_mask=mask.to(self.where), generation_config=config
            )
        return [row[width:].tolist() for row in out]


class MaxPipeline:
    """MAX 26.7's own Llama pipeline on a Hugging Face directory (``encoding``: its
    weights' dtype, ``"float32"`` or ``"bfloat16"``), greedy through MAX's ``generate``."""

    def __init__(
        self, directory: Path, max_batch: int, max_len: int, gpu: bool, encoding: str = "float32"
    ) -> None:
        from max.driver import DeviceSpec
        from max.pipelines import PIPELINE_REGISTRY
        from max.pipelines.lib import PipelineArgs, PipelineConfig

        args = PipelineArgs.from_flat_kwargs(
            model_path=str(directory),
            device_specs=[DeviceSpec.accelerator() if gpu else DeviceSpec.cpu()],
            quantization_encoding=encoding,
            max_length=max_len,
            max_batch_size=max_batch,
        )
        config = PipelineConfig.from_args(args)
        kv_cache = config.model.kv_cache
        #: MAX's KV-cache settings in this run (its defaults).
        self.kv_cache = {
            "enable_prefix_caching": bool(kv_cache.enable_prefix_caching),
            "page_size": int(kv_cache.kv_cache_page_size),
        }
        retrieved = PIPELINE_REGISTRY.retrieve_factory(config)
        self.pipeline = retrieved.factory()

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from max.pipelines.lib.generate import generate

        result = generate(
            self.pipeline, prompts, max_new_tokens=new_tokens, top_k=1, ignore_eos=True
        )
        return [list(seq[len(p) :]) for seq, p in zip(result.sequences, prompts, strict=True)]


def _hf_export(model: LoadedModel) -> Path:
    """A float32 Hugging Face directory of ``model``, written once into the cache."""
    from maxkv.cachedir import cache_dir
    from maxkv.models.export import export_hf_directory

    directory = cache_dir() / "models" / f"{model.spec}-hf-float32"
    if not (directory / "model.safetensors").is_file():
        staging = directory.with_name(directory.name + f".staging.{os.getpid()}")
        export_hf_directory(model, staging)
        os.replace(staging, directory)
    return directory


def roofline_tokens_per_s(
    config: DecoderConfig,
    batch: int,
    context: int,
    read_bandwidth_gbps: float,
    matmul_gflops: float,
) -> float:
    """Decode tokens/s of a batch-``batch`` step at the machine's limits (module docstring)."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = (
        c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    )
    matrix_params = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size
    kv_bytes = batch * context * 2 * c.num_hidden_layers * kv * 4
    bytes_read = matrix_params * 4 + kv_bytes
    attention_flops = 4 * batch * context * c.num_hidden_layers * q
    flops = 2 * batch * matrix_params + attention_flops
    step_s = max(bytes_read / (read_bandwidth_gbps * 1e9), flops / (matmul_gflops * 1e9))
    return batch / step_s


def end_to_end_real(
    session: InferenceSession,
    device: Device,
    batches: list[int],
    *,
    read_bandwidth_gbps: float | None,
    matmul_gflops: float | None,
    new_tokens: int = 64,
    repeats: int = 3,
    num_steps: int = 4,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Tokens/s of maxkv, transformers and MAX's pipeline per batch size (module docstring)."""
    if max(batches) > len(QUESTIONS):
        raise ValueError(f"at most {len(QUESTIONS)} prompts are defined")
    model = open_model("smollm2-135m")
    assert model.tokenizer is not None
    prompts = [model.tokenizer.encode_chat(q) for q in QUESTIONS[: max(batches)]]
    max_len = max(len(p) for p in prompts) + new_tokens + num_steps
    log("end to end (real model): compiling maxkv, loading transformers and MAX's pipeline ...")
    sides: dict[str, Callable[[list[list[int]]], list[list[int]]]] = {}
    gpu = not device.is_host
    ours = MaxkvSide(
        session,
        device,
        model.config,
        max_len,
        lambda manager: DecoderModel(
            model.config, model.weights, manager, session, quantized=model.quantized
        ),
    )
    sides["maxkv"] = lambda p: ours.run(p, new_tokens, num_steps)
    sides["maxkv_prefix_caching"] = lambda p: ours.run(
        p, new_tokens, num_steps, prefix_caching=True
    )
    try:
        hf = _Transformers(model, gpu)
        sides["hf"] = lambda p: hf.run(p, new_tokens)
    except ImportError:
        log("  transformers side skipped: torch is not installed")
    theirs = MaxPipeline(_hf_export(model), max(batches), max_len, gpu)
    sides["max_pipeline"] = lambda p: theirs.run(p, new_tokens)

    rows = []
    for batch in batches:
        batch_prompts = prompts[:batch]
        outputs = {name: run(batch_prompts) for name, run in sides.items()}  # warm-up
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(repeats):
            for name, run in sides.items():
                start = time.perf_counter()
                run(batch_prompts)
                times[name].append(time.perf_counter() - start)
        generated = batch * new_tokens
        context = int(np.mean([len(p) for p in batch_prompts])) + new_tokens // 2
        row: dict[str, Any] = {
            "batch": batch,
            "prompt_tokens_mean": round(float(np.mean([len(p) for p in batch_prompts])), 1),
            "new_tokens": new_tokens,
            "num_steps": num_steps,
        }
        for name in sides:
            row[f"{name}_tokens_per_s"] = round(generated / _median(times[name]), 1)
        row["prompt_tokens"] = sum(len(p) for p in batch_prompts)
        row["max_pipeline_kv_cache"] = theirs.kv_cache
        ours_names = [n for n in ("maxkv", "maxkv_prefix_caching") if n in sides]
        if "maxkv_prefix_caching" in sides:
            row["prefix_cache_hit_tokens"] = ours.prefix_hit_tokens
            row["prefix_caching_same_tokens_as_maxkv"] = (
                outputs["maxkv_prefix_caching"] == outputs["maxkv"]
            )
        if read_bandwidth_gbps is not None and matmul_gflops is not None:
            row["roofline_tokens_per_s"] = round(
                roofline_tokens_per_s(
                    model.config, batch, context, read_bandwidth_gbps, matmul_gflops
                ),
                1,
            )
            row["fraction_of_roofline"] = round(
                row["maxkv_tokens_per_s"] / row["roofline_tokens_per_s"], 3
            )
        for name in ours_names:
            prefix = "" if name == "maxkv" else "prefix_caching_"
            if "hf" in outputs:
                row[f"{prefix}same_tokens_as_hf"] = outputs[name] == outputs["hf"]
                row[f"{prefix}speedup_vs_hf"] = round(
                    row[f"{name}_tokens_per_s"] / row["hf_tokens_per_s"], 2
                )
            row[f"{prefix}speedup_vs_max_pipeline"] = round(
                row[f"{name}_tokens_per_s"] / row["max_pipeline_tokens_per_s"], 2
            )
        if "hf" in outputs:
            row["max_pipeline_same_tokens_as_hf"] = outputs["max_pipeline"] == outputs["hf"]
        log(f"  {row}")
        rows.append(row)
    return rows
