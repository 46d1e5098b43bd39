"""maxkv's Llama as a MAX ``PipelineModelWithKVCache``.

The model graph is :func:`maxkv.models.llama.build_llama_graph` (the same
code the demo runs) with ``output="logits"``: the float32 logits of each
sequence's last token, which MAX's sampler turns into the next token.  The
cache is a :class:`~maxkv.ContinuousBatchingKVCacheManager` with one slot
per ``--max-batch-size`` and ``--max-length`` tokens per slot; its inputs
reach the graph through :class:`~maxkv.pipelines.kv_adapter.MaxkvKVManager`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.nn.transformer import ReturnLogits
from max.pipelines.architectures.llama3.model_config import Llama3Config
from max.pipelines.context import TextContext
from max.pipelines.lib.interfaces import ModelInputs, ModelOutputs, PipelineModelWithKVCache

from ..manager import ContinuousBatchingKVCacheManager
from ..models.gguf_file import read_gguf_quantized
from ..models.llama import LlamaModel, cache_params
from ..models.loading import load_llama, model_file

logger = logging.getLogger("maxkv.pipelines")


class CacheDoesNotFitError(ValueError):
    """maxkv's contiguous cache for ``--max-batch-size`` x ``--max-length`` does not fit."""


@dataclass(kw_only=True)
class MaxkvLlamaInputs(ModelInputs):
    """One ragged step: token ids, row offsets, and maxkv's cache inputs."""

    tokens: Buffer
    """int64 ``[total_tokens]`` on the model's device."""
    input_row_offsets: Buffer
    """uint32 ``[batch + 1]`` on the model's device."""

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        (kv,) = self.kv_cache_inputs or [()]
        return (self.tokens, self.input_row_offsets, *kv)


class MaxkvLlamaPipelineModel(PipelineModelWithKVCache):
    """A Llama checkpoint on maxkv's graph and cache, for MAX's text-generation pipeline.

    Reads the checkpoint at ``--model-path`` with maxkv's loader (a Hugging
    Face directory with safetensors, or a GGUF file in the directory), runs
    float32 on one device, and returns the last token's logits of each
    sequence (MAX samples from them).
    """

    #: MAX's Llama configuration drives the memory plan and ``kv_params``.
    model_config_cls = Llama3Config

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.return_logits != ReturnLogits.LAST_TOKEN:
            raise ValueError(
                "maxkv.pipelines returns the last token's logits only: --enable-echo and "
                "all-token logits are not supported"
            )
        if len(self.devices) != 1:
            raise ValueError(f"maxkv.pipelines runs on one device; {len(self.devices)} were given")
        if self.dtype != DType.float32:
            raise ValueError(
                f"maxkv.pipelines runs float32 (--quantization-encoding float32), not {self.dtype}"
            )
        path = checkpoint_path(self.pipeline_config)
        config, weights = load_llama(path)
        self.config = config
        params = cache_params(config)
        slots, max_seq_len = self.max_batch_size, self.max_seq_len
        check_cache_fits(
            ContinuousBatchingKVCacheManager.estimated_memory_size(
                params, slots, max_seq_len, config.num_hidden_layers, self.devices
            ),
            self.memory_plan.available_cache_memory,
            slots,
            max_seq_len,
        )
        session = self._session(args, kwargs)
        self.maxkv_manager = ContinuousBatchingKVCacheManager(
            params, slots, max_seq_len, config.num_hidden_layers, self.devices, session
        )
        source = model_file(path)
        quantized = read_gguf_quantized(source) if source.is_file() else None
        self.llama = LlamaModel(
            config, weights, self.maxkv_manager, session, output="logits", quantized=quantized
        )
        logger.info(
            "maxkv: %s, %d slots x %d tokens (%.1f MiB of cache)",
            path,
            slots,
            max_seq_len,
            self.maxkv_manager.estimated_memory_size(
                params, slots, max_seq_len, config.num_hidden_layers, self.devices
            )
            / 2**20,
        )

    @staticmethod
    def _session(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return kwargs["session"] if "session" in kwargs else args[1]

    def _prepare_initial_token_inputs(
        self,
        replica_batches: Sequence[Sequence[TextContext]],
        kv_cache_inputs: Any = None,
        return_n_logits: int = 1,
    ) -> MaxkvLlamaInputs:
        if return_n_logits != 1:
            raise ValueError("maxkv.pipelines returns one logit row per sequence")
        if len(replica_batches) != 1:
            raise ValueError("maxkv.pipelines does not support data parallelism")
        (batch,) = replica_batches
        device = self.devices[0]
        if batch:
            tokens = np.concatenate([np.asarray(c.tokens.active) for c in batch])
            lengths = [c.tokens.active_length for c in batch]
        else:
            tokens, lengths = np.zeros(0, np.int64), []
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
        return MaxkvLlamaInputs(
            tokens=Buffer.from_numpy(tokens.astype(np.int64)).to(device),
            input_row_offsets=Buffer.from_numpy(offsets).to(device),
            kv_cache_inputs=kv_cache_inputs,
        )

    def execute(self, model_inputs: ModelInputs) -> ModelOutputs:
        """One model step; the logits of each sequence's last token, float32 ``[batch, vocab]``."""
        assert isinstance(model_inputs, MaxkvLlamaInputs)
        if not model_inputs.kv_cache_inputs:  # an empty batch: nothing to run
            empty = Buffer.from_numpy(np.zeros((0, self.config.vocab_size), np.float32))
            return ModelOutputs(logits=empty, next_token_logits=empty)
        (kv,) = model_inputs.kv_cache_inputs
        logits = self.llama.execute(model_inputs.tokens, model_inputs.input_row_offsets, kv)
        return ModelOutputs(logits=logits, next_token_logits=logits)


def checkpoint_path(pipeline_config: Any) -> Path:
    """What maxkv loads for ``--model-path``: the directory, or its GGUF weight file."""
    model = pipeline_config.model
    weight_paths = [Path(p) for p in model.resolved_weight_paths()]
    ggufs = [p for p in weight_paths if p.suffix == ".gguf"]
    if len(ggufs) == 1 and ggufs[0].is_file():
        return ggufs[0]
    return Path(model.model_path)


def check_cache_fits(needed: int, available: int | None, slots: int, max_seq_len: int) -> None:
    """Raises :class:`CacheDoesNotFitError` when maxkv's cache exceeds the memory plan."""
    if available is not None and needed > available:
        raise CacheDoesNotFitError(
            f"maxkv's contiguous KV cache of {slots} slots x {max_seq_len} tokens "
            f"(--max-batch-size x --max-length) needs {needed / 2**30:.2f} GiB, but the "
            f"memory plan leaves {available / 2**30:.2f} GiB for the KV cache: lower "
            "--max-batch-size or --max-length"
        )
