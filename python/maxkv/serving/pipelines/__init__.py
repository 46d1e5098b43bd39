"""maxkv inside MAX's pipelines: ``max generate`` and ``max serve`` on maxkv's cache.

A MAX *custom architecture*: pass :data:`CUSTOM_ARCHITECTURES` to
``--custom-architectures`` and checkpoints of every family maxkv registers
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``) run on maxkv's graph and cache
inside MAX's own pipeline, tokenizer, sampler and schedulers (chunked prefill
and preemption included).  The cache is paged with prefix caching by page
sharing unless ``MAXKV_CACHE=contiguous`` (:data:`CACHE_ENV`, see
:mod:`maxkv.serving.pipelines.model`)::

    MAXKV_ARCH=$(python -c "import maxkv.pipelines as p; print(p.CUSTOM_ARCHITECTURES)")
    max generate --custom-architectures "$MAXKV_ARCH" --model-path DIR --devices cpu \\
        --quantization-encoding float32 --max-length 512 --max-batch-size 4 --top-k 1 \\
        --prompt "Hello" --max-new-tokens 16

Importing this package changes nothing of MAX's; :func:`install` makes the
changes a serving process needs (:mod:`maxkv.serving.pipelines.hooks`), and the
entry point :mod:`maxkv.pipelines` calls it.

Tested with MAX 26.7 only (:data:`SUPPORTED_MAX`); importing this module
under another MAX raises :class:`UnsupportedMaxVersionError`.
"""

from __future__ import annotations

from pathlib import Path

from ._compat import SUPPORTED_MAX, UnsupportedMaxVersionError, check_max_version

check_max_version()

from .api import refuse_unsupported_requests  # noqa: E402
from .architecture import ARCHITECTURES, MaxkvTextGenerationPipeline  # noqa: E402
from .hooks import install  # noqa: E402
from .kv_adapter import MaxkvKVManager  # noqa: E402
from .model import (  # noqa: E402
    CACHE_ENV,
    CACHE_KINDS,
    CacheDoesNotFitError,
    MaxkvPipelineModel,
    cache_kind,
)

#: The value of ``--custom-architectures`` for this installation of maxkv:
#: ``<folder holding the maxkv package>:maxkv.pipelines`` (the entry point that
#: re-exports this package).
CUSTOM_ARCHITECTURES = f"{Path(__file__).resolve().parents[3]}:maxkv.pipelines"

__all__ = [
    "ARCHITECTURES",
    "CACHE_ENV",
    "CACHE_KINDS",
    "CUSTOM_ARCHITECTURES",
    "SUPPORTED_MAX",
    "CacheDoesNotFitError",
    "MaxkvKVManager",
    "MaxkvPipelineModel",
    "MaxkvTextGenerationPipeline",
    "UnsupportedMaxVersionError",
    "cache_kind",
    "check_max_version",
    "install",
    "refuse_unsupported_requests",
]
