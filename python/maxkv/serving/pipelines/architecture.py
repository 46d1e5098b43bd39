"""The custom architectures MAX loads with ``--custom-architectures``.

Every architecture of :func:`maxkv.models.registered_architectures`
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``) runs on
:class:`MaxkvPipelineModel` inside :class:`MaxkvTextGenerationPipeline`:
MAX's own text-generation pipeline, tokenizer, sampler and schedulers, with
maxkv's cache and graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from max.driver import Buffer
from max.graph.weights import WeightsFormat
from max.pipelines.context import GenerationStatus
from max.pipelines.lib import SupportedArchitecture
from max.pipelines.lib.log_probabilities import compute_log_probabilities_ragged
from max.pipelines.lib.pipeline_variants import text_generation
from max.pipelines.lib.pipeline_variants.utils import update_context_and_prepare_responses
from max.pipelines.modeling.types import PipelineTask

from ... import seams
from ...models.registry import registered_architectures
from .api import MaxkvTextTokenizer
from .context import MaxkvTextContext
from .hooks import install
from .kv_adapter import MaxkvKVManager
from .model import (
    MaxkvArchConfig,
    MaxkvMemoryPlanner,
    MaxkvPipelineModel,
    host_array,
)
from .speculation import ServeSpeculation, SpeculationMetrics, completes_stop_string


class MaxkvTextGenerationPipeline(text_generation.TextGenerationPipeline):
    """MAX's ``TextGenerationPipeline`` whose KV manager is maxkv's.

    MAX 26.7's pipeline always builds a paged manager with
    ``text_generation.load_kv_manager`` right after the model; while this
    pipeline is constructed that name hands back a :class:`MaxkvKVManager`
    over the model's maxkv manager instead (so no paged cache is allocated).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        install()  # the model worker unpickles this class without the entry point

        def load_maxkv_manager(**load_kwargs: Any) -> MaxkvKVManager:
            model = self._pipeline_model
            if not isinstance(model, MaxkvPipelineModel):
                raise TypeError(f"expected a maxkv pipeline model, got {type(model).__name__}")
            return MaxkvKVManager(
                model.maxkv_manager,
                load_kwargs["params"],
                sinks=model.sinks,
                blender=model.blender,
                events=model.kv_events,
            )

        with seams.LOAD_KV_MANAGER.replaced(load_maxkv_manager):
            super().__init__(*args, **kwargs)
        model = self._pipeline_model
        assert isinstance(model, MaxkvPipelineModel)
        #: Prompt-lookup speculative decoding (``MAXKV_SPECULATIVE``), or ``None``.
        self.speculation = (
            ServeSpeculation(model.speculative, self.vocab_size) if model.speculative else None
        )
        self._drafting: _DraftStep | None = None
        self._emitted = 0

    # ------------------------------------------------- speculative decoding
    # A step with drafts runs MAX's own ``_execute`` (sampler, structured
    # output, log probabilities, the KV manager's commits) with three changes:
    # ``prepare_batch`` appends the drafts (their pages reserved, or none),
    # ``_launch_forward_pass`` keeps the head's rows, and the contexts' update
    # appends the tokens the rows confirm after MAX's sampled one, before
    # MAX commits each request's processed tokens to the cache.

    def _execute(self, inputs: Any) -> Any:
        spec = self.speculation
        if spec is None or len(inputs.batches) != 1:
            return super()._execute(inputs)
        (batch,) = inputs.batches
        self._drafting = _DraftStep(spec.propose(batch, self._maxkv_adapter.room))
        try:
            with seams.UPDATE_CONTEXTS.replaced(self._update_contexts):
                result = super()._execute(inputs)
        finally:
            self._drafting = None
        self._emitted = sum(len(output.tokens) for output in result.values())
        return result

    @property
    def _maxkv_adapter(self) -> MaxkvKVManager:
        adapter = self._kv_manager
        assert isinstance(adapter, MaxkvKVManager)
        return adapter

    def prepare_batch(self, batches: list[list[Any]]) -> Any:
        step = self._drafting
        if step is None or not any(step.drafts):
            return super().prepare_batch(batches)
        (batch,) = batches
        flat_batch = list(batch)
        bitmask = self.initialize_bitmask(flat_batch)
        if bitmask is not None:
            for i, context in enumerate(flat_batch):
                self.update_for_structured_output(context, bitmask, i)
        kv, fit = self._maxkv_adapter.runtime_inputs_with_drafts(flat_batch, step.drafts)
        if not fit:
            step.drafts = [[] for _ in flat_batch]
        if self.batch_info_output_fname is not None:
            self._record_batch_info(flat_batch)
        model = self._pipeline_model
        assert isinstance(model, MaxkvPipelineModel)
        return model.prepare_speculative_inputs(flat_batch, step.drafts, kv), bitmask, flat_batch

    def _launch_forward_pass(self, curr_step_inputs: Any, flat_batch: Any, step: int) -> Any:
        outputs = super()._launch_forward_pass(curr_step_inputs, flat_batch, step)
        if self._drafting is not None:
            self._drafting.logits = outputs.logits
            self._drafting.first_rows = curr_step_inputs.first_rows
        return outputs

    def _update_contexts(
        self,
        generated_tokens_host: Any,
        flat_batch: list[Any],
        batch_log_probabilities: Any = None,
        enable_log_probs: bool = False,
        overwrite_future: bool = False,
    ) -> Any:
        """MAX's update of the contexts with the sampled tokens, then the tokens
        each request's drafts earned, one by one until the request ends (EOS,
        ``max_tokens``, or a token that completes a stop string)."""
        result = update_context_and_prepare_responses(
            generated_tokens_host,
            flat_batch,
            batch_log_probabilities=batch_log_probabilities,
            enable_log_probs=enable_log_probs,
            overwrite_future=overwrite_future,
        )
        step, spec = self._drafting, self.speculation
        assert step is not None and spec is not None
        earned: list[list[int]] = [[] for _ in flat_batch]
        log_probs: list[list[Any]] = [[] for _ in flat_batch]
        if any(step.drafts) and step.logits is not None and step.first_rows is not None:
            rows = host_array(step.logits)
            for i, (ctx, drafts) in enumerate(zip(flat_batch, step.drafts, strict=True)):
                start = int(step.first_rows[i])
                first = int(generated_tokens_host[i, 0])
                earned[i] = spec.accept(ctx, drafts, first, rows[start : start + len(drafts) + 1])
            log_probs = self._earned_log_probabilities(
                flat_batch, earned, step, rows, enable_log_probs
            )
        for i, ctx in enumerate(flat_batch):
            stops = list(ctx.eos_tracker.eos_stop_strings)
            if not earned[i] and not stops:
                continue
            if ctx.tokens.generated_length and not ctx.is_done:
                self._end_at_stop_string(ctx, stops)  # MAX's sampled token
            for j, token in enumerate(earned[i]):
                if ctx.is_done:
                    break
                ctx.update(token, log_probs[i][j] if log_probs[i] else None)
                self._end_at_stop_string(ctx, stops)
            output = result.get(ctx.request_id)
            more = ctx.to_generation_output()
            if output is None:
                if more.tokens:
                    result[ctx.request_id] = more
                continue
            output.tokens.extend(more.tokens)
            if more.log_probabilities:
                earlier = output.log_probabilities or []
                output.log_probabilities = [*earlier, *more.log_probabilities]
            output.final_status = more.final_status
        return result

    def _end_at_stop_string(self, ctx: Any, stops: list[str]) -> None:
        """Ends ``ctx`` when its last token completed one of its stop strings: no
        token follows it (MAX's API server, which finds stop strings in the
        decoded text, cancels a request a step or more later, and a step with
        drafts may hold several tokens after the stop)."""
        if not stops:
            return
        delegate = self.tokenizer.delegate
        if completes_stop_string(
            lambda ids: str(delegate.decode(ids, skip_special_tokens=True)),
            ctx.tokens.generated,
            stops,
        ):
            ctx.status = GenerationStatus.END_OF_SEQUENCE

    def _earned_log_probabilities(
        self,
        batch: list[Any],
        earned: list[list[int]],
        step: _DraftStep,
        rows: np.ndarray,
        enable_log_probs: bool,
    ) -> list[list[Any]]:
        """Per request, the log probabilities of its earned tokens (MAX's graph, on
        the rows that chose them), where it asked for them."""
        out: list[list[Any]] = [[] for _ in batch]
        if not enable_log_probs:
            return out
        picked, tokens, top_n, owners = [], [], [], []
        for i, (ctx, earned_tokens) in enumerate(zip(batch, earned, strict=True)):
            if not ctx.log_probabilities or not earned_tokens:
                continue
            assert step.first_rows is not None
            start = int(step.first_rows[i])
            for j, token in enumerate(earned_tokens):
                picked.append(rows[start + 1 + j])  # the row of the token before it
                tokens.append(token)
                top_n.append(ctx.log_probabilities)
                owners.append(i)
        if not picked:
            return out
        model = self._pipeline_model
        device = model.devices[0]
        n = len(picked)
        computed = compute_log_probabilities_ragged(
            device,
            model._logprobs_model,
            input_row_offsets=np.arange(n + 1, dtype=np.uint32),
            logits=None,
            next_token_logits=Buffer.from_numpy(np.ascontiguousarray(picked)).to(device),
            tokens=np.asarray(tokens, dtype=np.uint32),
            sampled_tokens=np.asarray(tokens, dtype=np.uint32),
            batch_top_n=top_n,
            batch_echo=[False] * n,
        )
        for owner, value in zip(owners, computed, strict=True):
            out[owner].append(value)
        return out

    def batch_spec_decode_metrics(self) -> SpeculationMetrics | None:
        """The last batch's drafts and acceptance, for the line MAX's scheduler logs."""
        if self.speculation is None:
            return None
        return self.speculation.take_metrics(self._emitted)

    def release(self, request_id: Any) -> None:
        super().release(request_id)
        model = self._pipeline_model
        if isinstance(model, MaxkvPipelineModel):
            model.prompt_logprobs.forget(request_id)
        if self.speculation is not None:
            self.speculation.forget(request_id)


@dataclass
class _DraftStep:
    """One step with drafts, from their proposal to the contexts' update."""

    drafts: list[list[int]]
    logits: Any = None
    """The head's rows of the step (MAX's ``ModelOutputs.logits``)."""
    first_rows: np.ndarray | None = None
    """Per request, the index of its first head row."""


def maxkv_architecture(name: str) -> SupportedArchitecture:
    """MAX's registration of the Hugging Face architecture ``name`` on maxkv."""
    return SupportedArchitecture(
        name=name,
        example_repo_ids=[],
        default_encoding="float32",
        supported_encodings={"float32"},
        pipeline_model=MaxkvPipelineModel,
        tokenizer=MaxkvTextTokenizer,
        context_type=MaxkvTextContext,
        default_weights_format=WeightsFormat.safetensors,
        task=PipelineTask.TEXT_GENERATION,
        config=MaxkvArchConfig,
        memory_planner=MaxkvMemoryPlanner,
        pipeline_cls=MaxkvTextGenerationPipeline,
        supports_overlap_scheduler=False,
        supports_device_graph_capture=False,
    )


#: What ``--custom-architectures`` registers (overriding MAX's own of the same names).
ARCHITECTURES = [maxkv_architecture(name) for name in registered_architectures()]
