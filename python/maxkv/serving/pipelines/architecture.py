"""The custom architectures MAX loads with ``--custom-architectures``.

Every architecture of :func:`maxkv.models.registered_architectures`
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``) runs on
:class:`MaxkvPipelineModel` inside :class:`MaxkvTextGenerationPipeline`:
MAX's own text-generation pipeline, tokenizer, sampler and schedulers, with
maxkv's cache and graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from max.graph.weights import WeightsFormat
from max.pipelines.context import TextContext
from max.pipelines.kv_cache.memory_planner import PagedMemoryPlanner
from max.pipelines.lib import SupportedArchitecture
from max.pipelines.lib.pipeline_variants import text_generation
from max.pipelines.modeling.types import PipelineTask

from ...models.family import registered_architectures
from .api import MaxkvTextTokenizer
from .kv_adapter import MaxkvKVManager
from .model import MaxkvArchConfig, MaxkvPipelineModel, accept_maxkv_formats


@contextmanager
def _replaced(module: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


class MaxkvTextGenerationPipeline(text_generation.TextGenerationPipeline):
    """MAX's ``TextGenerationPipeline`` whose KV manager is maxkv's.

    MAX 26.7's pipeline always builds a paged manager with
    ``text_generation.load_kv_manager`` right after the model; while this
    pipeline is constructed that name hands back a :class:`MaxkvKVManager`
    over the model's maxkv manager instead (so no paged cache is allocated).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        def load_maxkv_manager(**load_kwargs: Any) -> MaxkvKVManager:
            model = self._pipeline_model
            if not isinstance(model, MaxkvPipelineModel):
                raise TypeError(f"expected a maxkv pipeline model, got {type(model).__name__}")
            return MaxkvKVManager(
                model.maxkv_manager, load_kwargs["params"], streaming=model.streaming
            )

        with _replaced(text_generation, "load_kv_manager", load_maxkv_manager):
            super().__init__(*args, **kwargs)


def maxkv_architecture(name: str) -> SupportedArchitecture:
    """MAX's registration of the Hugging Face architecture ``name`` on maxkv."""
    return SupportedArchitecture(
        name=name,
        example_repo_ids=[],
        default_encoding="float32",
        supported_encodings={"float32"},
        pipeline_model=MaxkvPipelineModel,
        tokenizer=MaxkvTextTokenizer,
        context_type=TextContext,
        default_weights_format=WeightsFormat.safetensors,
        task=PipelineTask.TEXT_GENERATION,
        config=MaxkvArchConfig,
        memory_planner=PagedMemoryPlanner,
        pipeline_cls=MaxkvTextGenerationPipeline,
        supports_overlap_scheduler=False,
        supports_device_graph_capture=False,
    )


#: What ``--custom-architectures`` registers (overriding MAX's own of the same names).
ARCHITECTURES = [maxkv_architecture(name) for name in registered_architectures()]
accept_maxkv_formats()
