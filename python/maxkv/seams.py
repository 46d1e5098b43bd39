"""Every name of MAX's that maxkv replaces, wraps, overrides, reads or imports privately.

``maxkv.pipelines`` runs inside MAX's pipeline and server; where MAX offers no
hook it changes a MAX name (replaced for a while, wrapped for the process,
overridden in a subclass), and the graph side builds on MAX's opaque value
types, which MAX names privately.  Each such name is a :class:`Seam` here, with
what maxkv does there; the code that patches one reaches it through its seam,
so a MAX upgrade starts with ``pytest tests/test_seams.py``: a seam MAX moved
or renamed fails there by name instead of deep in a request.
(:mod:`maxkv.serving.pipelines._compat` pins the MAX versions these were read from.)

This module imports nothing of maxkv (or of MAX until a seam is resolved).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

#: How maxkv touches a seam: replaced for a while, wrapped for the process,
#: overridden in a subclass, extended (a collection maxkv adds to), private (a
#: name imported from MAX), read (an attribute of MAX's objects maxkv reads or
#: calls: a method, or an attribute MAX's ``__init__`` sets).
SeamUse = Literal["replaced", "wrapped", "overridden", "extended", "private", "read"]


class SeamMovedError(RuntimeError):
    """A MAX name maxkv depends on is not where maxkv expects it."""


@dataclass(frozen=True)
class Seam:
    """One MAX name maxkv depends on beyond MAX's public API.

    Args:
        module: The MAX module that holds it.
        name: The attribute, dotted for a class's (``Class.method``).
        use: How maxkv touches it (:data:`SeamUse`).
        why: What maxkv does there, and where.
    """

    module: str
    name: str
    use: SeamUse
    why: str

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def attribute(self) -> str:
        """The last part of :attr:`name`: what the owner holds."""
        return self.name.rsplit(".", 1)[-1]

    def owner(self) -> Any:
        """The module or class that holds the name.

        Raises:
            SeamMovedError: If the module or class is gone.
        """
        try:
            owner: Any = importlib.import_module(self.module)
            for part in self.name.split(".")[:-1]:
                owner = getattr(owner, part)
        except (ImportError, AttributeError) as error:
            raise SeamMovedError(self._moved(str(error))) from None
        return owner

    def resolve(self) -> Any:
        """MAX's object behind the name; for an attribute each instance holds
        (``read``, declared or set as ``self.<name>`` in the class or a base),
        the class.

        Raises:
            SeamMovedError: If MAX no longer has it there.
        """
        owner = self.owner()
        if hasattr(owner, self.attribute):
            return getattr(owner, self.attribute)
        if self.use == "read" and inspect.isclass(owner) and _instances_hold(owner, self.attribute):
            return owner
        raise SeamMovedError(self._moved(f"no attribute {self.attribute!r}"))

    @contextmanager
    def replaced(self, value: Any) -> Iterator[None]:
        """The name holds ``value`` inside the block, MAX's object again after it."""
        original = self.resolve()
        owner = self.owner()
        setattr(owner, self.attribute, value)
        try:
            yield
        finally:
            setattr(owner, self.attribute, original)

    def replace(self, value: Any) -> None:
        """The name holds ``value`` for the rest of the process."""
        self.resolve()
        setattr(self.owner(), self.attribute, value)

    def _moved(self, detail: str) -> str:
        return (
            f"MAX moved {self.path}, which maxkv {self.use} ({self.why}): {detail}; "
            "maxkv.pipelines supports the MAX versions in maxkv.serving.pipelines._compat"
        )


def _instances_hold(cls: type, name: str) -> bool:
    """Whether ``cls`` or a base declares ``name`` or sets ``self.<name>``."""
    for base in cls.__mro__:
        if name in getattr(base, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{re.escape(name)}\s*[:=]", source):
            return True
    return False


_TEXT_GENERATION = "max.pipelines.lib.pipeline_variants.text_generation"
_TOKENIZER = "max.pipelines.lib.tokenizer"

#: MAX's pipeline builds a paged manager right after the model; while
#: ``MaxkvTextGenerationPipeline`` is constructed it builds maxkv's adapter instead.
LOAD_KV_MANAGER = Seam(
    _TEXT_GENERATION, "load_kv_manager", "replaced",
    "MaxkvTextGenerationPipeline.__init__ hands back maxkv's KV manager",
)  # fmt: skip
#: During a step with drafts, the contexts' update appends the tokens the drafts confirm.
UPDATE_CONTEXTS = Seam(
    _TEXT_GENERATION, "update_context_and_prepare_responses", "replaced",
    "MaxkvTextGenerationPipeline._execute confirms speculative drafts",
)  # fmt: skip
EXECUTE = Seam(
    _TEXT_GENERATION, "TextGenerationPipeline._execute", "overridden",
    "a step with prompt-lookup drafts runs MAX's step with the two seams above",
)  # fmt: skip
PREPARE_BATCH = Seam(
    _TEXT_GENERATION, "TextGenerationPipeline.prepare_batch", "overridden",
    "a step with drafts appends them to the batch's inputs",
)  # fmt: skip
LAUNCH_FORWARD_PASS = Seam(
    _TEXT_GENERATION, "TextGenerationPipeline._launch_forward_pass", "overridden",
    "keeps the head's rows of a step with drafts",
)  # fmt: skip
#: The server's request parser: maxkv checks each request before any work.
PARSE_OPENAI_REQUEST = Seam(
    "max.serve.router.openai_routes", "_parse_openai_request_body", "wrapped",
    "api.refuse_unsupported_requests answers requests maxkv cannot serve with a 400",
)  # fmt: skip
#: The OpenAI routes: maxkv adds the render routes KV-aware routers ask for tokens.
OPENAI_ROUTER = Seam(
    "max.serve.router.openai_routes", "router", "extended",
    "render.add_render_routes answers /v1/completions/render and /v1/chat/completions/render",
)  # fmt: skip
#: The routes the render routes run (to the point where the prompt is tokenized).
COMPLETION_ROUTE = Seam(
    "max.serve.router.openai_routes", "openai_create_completion", "wrapped",
    "render.add_render_routes runs it up to the prompt's tokens",
)  # fmt: skip
CHAT_ROUTE = Seam(
    "max.serve.router.openai_routes", "openai_create_chat_completion", "wrapped",
    "render.add_render_routes runs it up to the prompt's tokens",
)  # fmt: skip
#: The model worker's scheduler drains its cancels after each batch with this name,
#: and its request queue (before each batch) with the next.
CANCELLED_REQUESTS = Seam(
    "max.serve.scheduler.text_generation_scheduler", "get_cancelled_reqs", "wrapped",
    "cancels.remember_cancels remembers each cancel",
)  # fmt: skip
PENDING_REQUESTS = Seam(
    "max.serve.scheduler.text_generation_scheduler", "drain_queue", "wrapped",
    "cancels.remember_cancels drops a request whose cancel came before it",
)  # fmt: skip
#: ``--kv-cache-format`` values MAX's config accepts: maxkv adds its own encodings.
KV_CACHE_FORMATS = Seam(
    "max.pipelines.kv_cache.config", "_KV_CACHE_FORMAT_TO_DTYPE", "extended",
    "model.accept_maxkv_formats adds int8, int4 and float16",
)  # fmt: skip
PREFIX_CACHE_HITS = Seam(
    "max.pipelines.kv_cache.paged_kv_cache._common", "PrefixCacheHits", "private",
    "the KV adapter reports prefix-cache hits in MAX's type",
)  # fmt: skip
OPAQUE_TYPE = Seam(
    "max.graph.type", "_OpaqueType", "private",
    "graph.types: the collections' graph type (MAX's type of a custom opaque value)",
)  # fmt: skip
OPAQUE_VALUE = Seam(
    "max.graph.value", "_OpaqueValue", "private",
    "graph.types: KVCacheCollection, the graph value maxkv's ops take",
)  # fmt: skip
SPECULATIVE_METRICS = Seam(
    "max.pipelines.speculative.utils", "_SpeculativeDecodingMetrics", "private",
    "speculation reports acceptance in MAX's metrics type",
)  # fmt: skip
#: What maxkv's pipeline reads of MAX's: its model, its KV manager (maxkv's
#: adapter), the batch record MAX's ``prepare_batch`` writes.
PIPELINE_MODEL = Seam(
    _TEXT_GENERATION, "TextGenerationPipeline._pipeline_model", "read",
    "MaxkvTextGenerationPipeline asks maxkv's model for a step's inputs and log probabilities",
)  # fmt: skip
KV_MANAGER = Seam(
    _TEXT_GENERATION, "TextGenerationPipeline._kv_manager", "read",
    "MaxkvTextGenerationPipeline reserves a step's drafts through maxkv's adapter",
)  # fmt: skip
RECORD_BATCH_INFO = Seam(
    _TEXT_GENERATION, "TextGenerationPipeline._record_batch_info", "read",
    "MaxkvTextGenerationPipeline.prepare_batch records a step with drafts as MAX's does",
)  # fmt: skip
LOGPROBS_MODEL = Seam(
    "max.pipelines.lib.log_probabilities", "LogProbabilitiesMixin._logprobs_model", "read",
    "MaxkvTextGenerationPipeline computes drafts' log probabilities with MAX's graph",
)  # fmt: skip
#: MAX's model asks its subclass for a step's inputs by this name.
PREPARE_TOKEN_INPUTS = Seam(
    "max.pipelines.lib.interfaces.pipeline_model", "PipelineModel._prepare_initial_token_inputs",
    "overridden", "MaxkvPipelineModel builds a step's inputs over maxkv's cache",
)  # fmt: skip
#: The tokenizer's encoding of a request's prompt.
GENERATE_PROMPT = Seam(
    _TOKENIZER, "TextTokenizer._generate_prompt_and_token_ids", "overridden",
    "MaxkvTextTokenizer encodes a blended prompt piece by piece, without its separators",
)  # fmt: skip
ENCODE_CHAT_PROMPT = Seam(
    _TOKENIZER, "TextTokenizer._encode_chat_prompt", "read",
    "MaxkvTextTokenizer encodes a rendered chat prompt with no separator as MAX does",
)  # fmt: skip
#: A graph value's MLIR value: what identifies it within its graph.
MLIR_VALUE = Seam(
    "max.graph.value", "Value._mlir_value", "read",
    "graph.ops checks a graph's row offsets once per value, keyed by it",
)  # fmt: skip

#: Every seam.
SEAMS: tuple[Seam, ...] = (
    LOAD_KV_MANAGER,
    UPDATE_CONTEXTS,
    EXECUTE,
    PREPARE_BATCH,
    LAUNCH_FORWARD_PASS,
    PARSE_OPENAI_REQUEST,
    OPENAI_ROUTER,
    COMPLETION_ROUTE,
    CHAT_ROUTE,
    CANCELLED_REQUESTS,
    PENDING_REQUESTS,
    KV_CACHE_FORMATS,
    PREFIX_CACHE_HITS,
    OPAQUE_TYPE,
    OPAQUE_VALUE,
    SPECULATIVE_METRICS,
    PIPELINE_MODEL,
    KV_MANAGER,
    RECORD_BATCH_INFO,
    LOGPROBS_MODEL,
    PREPARE_TOKEN_INPUTS,
    GENERATE_PROMPT,
    ENCODE_CHAT_PROMPT,
    MLIR_VALUE,
)
