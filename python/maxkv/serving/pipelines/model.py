"""maxkv's Llama as a MAX ``PipelineModelWithKVCache``.

The model graph is :func:`maxkv.models.decoder.build_decoder_graph` (the same
code the demo runs) with ``output="logits"`` and ``head_rows="given"``: the
float32 logits of each sequence's last token, which MAX's sampler turns into
the next token (and MAX's log-probability graph into ``logprobs``); of every
prompt token of the requests that ask for the prompt's log probabilities
(:mod:`~maxkv.serving.pipelines.prompt_logprobs`); and of speculative drafts.
The cache is chosen by the environment variable :data:`CACHE_ENV` (``MAXKV_CACHE``):

- ``paged`` (default): a :class:`~maxkv.PagedKVCacheManager` with as many
  pages as MAX's memory plan gives the KV cache; prefix caching by page
  sharing follows MAX's ``--enable-prefix-caching`` (on by default).  Pages
  hold :func:`tokens_per_page` tokens: ``MAXKV_PAGE_SIZE`` if set, else MAX's
  ``--kv-cache-page-size`` if it is not MAX's default of 128, else 16.  A
  prefix is reused in whole pages, and MAX's 128 (sized for GPUs) would
  recompute up to 127 tokens of every shared system prompt.
  KV tiers beyond the device (:mod:`maxkv.tiers`, paged cache with prefix
  caching, CPU): configured by :meth:`maxkv.tiers.TierConfig.from_env`
  (``MAXKV_HOST_TIER_GB``, default 1; ``MAXKV_DISK_TIER_DIR`` /
  ``MAXKV_DISK_TIER_GB``; ``MAXKV_REDIS_URL``), blocks named by
  :func:`model_identity` of the checkpoint (or ``MAXKV_MODEL_ID``).
- ``contiguous``: a :class:`~maxkv.ContinuousBatchingKVCacheManager` with one
  slot of ``--max-length`` tokens per ``--max-batch-size``; with prefix
  caching, cached rows are copied into a request's slot.

Its inputs reach the graph through
:class:`~maxkv.serving.pipelines.kv_adapter.MaxkvKVManager`.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from max.driver import CPU, Buffer
from max.dtype import DType
from max.nn.transformer import ReturnLogits
from max.pipelines.architectures.llama3.model_config import Llama3Config
from max.pipelines.context import TextContext
from max.pipelines.kv_cache.memory_planner import PagedMemoryPlanner
from max.pipelines.lib.interfaces import ModelInputs, ModelOutputs, PipelineModelWithKVCache
from max.pipelines.lib.log_probabilities import LogProbabilitiesMixin

from ... import seams, settings
from ...cache.contiguous import ContinuousBatchingKVCacheManager
from ...cache.hybrid import HybridKVCacheManager, layer_groups
from ...cache.paged import PagedKVCacheManager
from ...cache.params import KVCacheParams
from ...cache.protocol import KVCacheManagerBase
from ...cache.rotation import KeyRotation
from ...cachedir import cache_dir
from ...events.wire import AllBlocksCleared
from ...models.decoder import DecoderModel, cache_params, graph_weight_bytes
from ...models.held import HeldWeights
from ...models.loading import hf_directory_config, load_model, model_file
from ...models.memory import check_fits
from ...tiers.store import TierConfig
from .blending import BLEND_ENV, BlendConfig, ServeBlender
from .context import wants_prompt_logprobs
from .prompt_logprobs import PromptLogProbabilities, PromptRows
from .speculation import speculative_config

if TYPE_CHECKING:
    from ...events.publisher import ZmqEventPublisher

#: A child of MAX's pipeline logger, so lines reach the log ``max serve`` prints.
logger = logging.getLogger("max.pipelines.maxkv")

#: The environment variable that chooses maxkv's cache in MAX's pipelines.
CACHE_ENV = settings.CACHE.name
#: Its values; the first is the default.
CACHE_KINDS = settings.CACHE_KINDS
#: The environment variable that sets the tokens per page of the paged cache.
PAGE_SIZE_ENV = settings.PAGE_SIZE.name
#: Tokens per page unless set (vLLM's default block size).
DEFAULT_PAGE_SIZE = 16
#: Attention sinks in ``max serve`` (StreamingLLM): every request's cache keeps
#: its first :data:`ATTENTION_SINKS_ENV` tokens and its last this many tokens.
SLIDING_WINDOW_ENV = settings.SLIDING_WINDOW.name
#: The sink tokens kept with :data:`SLIDING_WINDOW_ENV` (default 4, StreamingLLM's).
ATTENTION_SINKS_ENV = settings.ATTENTION_SINKS.name
DEFAULT_ATTENTION_SINKS = settings.ATTENTION_SINKS.default
#: Set to ``1``: a model whose layers all slide keeps every page of a request
#: until it ends, as maxkv did before it gave pages back (for comparisons).
KEEP_WINDOW_PAGES_ENV = settings.KEEP_WINDOW_PAGES.name
#: ``--kv-cache-format`` values maxkv implements and MAX 26.7's own cache does not.
MAXKV_ONLY_FORMATS = ("int8", "int4", "float16")
#: MAX 26.7's default ``--kv-cache-page-size``.
MAX_DEFAULT_PAGE_SIZE = 128
#: New tokens of one step a hybrid cache's sliding groups make room for, unless
#: MAX passes its ``--max-batch-input-tokens``.
DEFAULT_STEP_TOKENS = 8192


def accept_maxkv_formats() -> None:
    """Lets MAX 26.7 take :data:`MAXKV_ONLY_FORMATS` for ``--kv-cache-format``.

    MAX resolves the flag for its own cache in several places and refuses names
    it does not know.  For maxkv's it plans its memory budget as for float32;
    maxkv then counts its pages in the encoding's real bytes (more pages in the
    same budget), names the encoding on its startup line, and refuses the
    encodings it lacks (:func:`kv_cache_params`).  Called when MAX loads
    ``maxkv.pipelines`` as a custom architecture.
    """
    formats = seams.KV_CACHE_FORMATS.resolve()
    for name in MAXKV_ONLY_FORMATS:
        formats.setdefault(name, DType.float32)


class _ToMaxLog(logging.Handler):
    """Hands maxkv's own log records (``maxkv.*``: the tiers' warnings, refused
    blocks) to :data:`logger`, renamed below it: ``max serve`` prints only the
    records of its own loggers' names."""

    def emit(self, record: logging.LogRecord) -> None:
        record = copy.copy(record)
        record.name = f"{logger.name}.{record.name}"
        logger.handle(record)


def forward_maxkv_logs() -> None:
    """Makes the ``maxkv`` logger's records reach MAX's log (once per process)."""
    root = logging.getLogger("maxkv")
    if not any(isinstance(h, _ToMaxLog) for h in root.handlers):
        root.addHandler(_ToMaxLog())
        root.propagate = False  # once, through MAX's handlers


class CacheDoesNotFitError(ValueError):
    """maxkv's cache does not fit the memory MAX's plan leaves for the KV cache."""


def cache_kind() -> str:
    """The cache :data:`CACHE_ENV` asks for (default ``paged``).

    Raises:
        ValueError: If it names no kind of :data:`CACHE_KINDS`.
    """
    return settings.CACHE.read()


@dataclass(kw_only=True)
class MaxkvInputs(ModelInputs):
    """One ragged step: token ids, row offsets, and maxkv's cache inputs."""

    tokens: Buffer
    """int64 ``[total_tokens]`` on the model's device."""
    input_row_offsets: Buffer
    """uint32 ``[batch + 1]`` on the model's device."""
    head_rows: Buffer | None = None
    """int64 ``[rows]``, the rows the head reads: each sequence's last pending
    token and its drafts after it (speculation,
    :data:`~maxkv.serving.pipelines.speculation.SPECULATIVE_ENV`), or every
    token of the step of a request that asked for its prompt's log
    probabilities."""
    first_rows: npt.NDArray[np.int64] | None = None
    """With :attr:`head_rows`: per sequence, its first head row, indices into the
    head's rows."""
    sample_rows: npt.NDArray[np.int64] | None = None
    """With :attr:`head_rows`: per sequence, the head row the sampler reads (its
    last pending token's)."""
    prompt_rows: list[PromptRows] = field(default_factory=list)
    """The requests whose prompt rows the head reads, and which tokens they predict."""

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        (kv,) = self.kv_cache_inputs or [()]
        return (self.tokens, self.input_row_offsets, *kv)


class MaxkvArchConfig(Llama3Config):
    """MAX's per-architecture configuration for maxkv's families.

    MAX's memory plan and ``kv_params`` read the cache's shape from it (KV
    heads, ``head_dim``, layers), which every family's ``config.json`` names
    alike.  It is built as MAX's Llama 3 configuration of the checkpoint with
    the default RoPE: MAX's Llama reads only a flat ``rope_scaling`` (not
    Gemma 3's RoPE per layer type), and maxkv's graph reads the RoPE from the
    checkpoint itself (:func:`maxkv.models.load_model`).
    """

    @classmethod
    def initialize(cls, pipeline_config: Any, model_config: Any = None, *, max_seq_len: int) -> Any:
        model_config = model_config or pipeline_config.model
        hf = copy.deepcopy(model_config.huggingface_config)
        if hf is None:
            return super().initialize(pipeline_config, model_config, max_seq_len=max_seq_len)
        hf.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        hf.rope_theta = 10000.0
        if hasattr(hf, "rope_scaling"):
            hf.rope_scaling = None
        return cls.initialize_from_config(
            pipeline_config, hf, model_config, max_seq_len=max_seq_len
        )


class MaxkvPipelineModel(LogProbabilitiesMixin, PipelineModelWithKVCache):
    """A checkpoint of any registered family on maxkv's graph and cache, for MAX's
    text-generation pipeline.

    Reads the checkpoint at ``--model-path`` with maxkv's loader (a Hugging
    Face directory with safetensors, or a GGUF file in the directory), runs
    float32 on one device, and returns the last token's logits of each
    sequence (MAX samples from them; MAX's ``LogProbabilitiesMixin`` turns
    them into ``logprobs``), and the prompt rows' of requests with ``echo``
    and ``logprobs`` (:meth:`compute_log_probabilities`).
    """

    #: Drives MAX's memory plan and ``kv_params``.
    model_config_cls = MaxkvArchConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.return_logits != ReturnLogits.LAST_TOKEN:
            raise ValueError(
                "maxkv.pipelines computes the prompt's log probabilities of the requests "
                "that ask (echo with logprobs) without --enable-echo: leave it out"
            )
        if len(self.devices) != 1:
            raise ValueError(f"maxkv.pipelines runs on one device; {len(self.devices)} were given")
        if self.dtype != DType.float32:
            raise ValueError(
                f"maxkv.pipelines runs float32 (--quantization-encoding float32), not {self.dtype}"
            )
        forward_maxkv_logs()
        path = checkpoint_path(self.pipeline_config)
        config, weights = load_model(path)
        self.config = config
        params = kv_cache_params(config, self.kv_cache_config)
        session = self._session(args, kwargs)
        #: ``(window, sinks)`` every request's cache keeps (attention sinks), or ``None``.
        self.sinks = streaming_window()
        if self.sinks is not None and (config.sliding or cache_kind() != "paged"):
            raise ValueError(
                f"{SLIDING_WINDOW_ENV} gives attention sinks to a model whose layers attend "
                "to every token, on the paged cache"
                + (
                    f"; {config.family}'s layers have windows of their own"
                    if config.sliding
                    else ""
                )
            )
        budget = cache_budget(self.memory_plan.available_cache_memory)
        if self.devices[0].label == "cpu":  # both before anything large is allocated
            check_fits(path.name, graph_weight_bytes(config, weights, packed=True), budget or 0)
        self.maxkv_manager = build_manager(
            cache_kind(),
            params,
            config.num_hidden_layers,
            self.devices,
            session,
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            page_size=tokens_per_page(self.kv_cache_config.kv_cache_page_size),
            prefix_caching=self.kv_cache_config.enable_prefix_caching,
            available=budget,
            tiers=TierConfig.from_env(model_identity(path)),
            layer_windows=() if keep_window_pages() else config.layer_windows,
            step_tokens=getattr(self.pipeline_config.runtime, "max_batch_input_tokens", None),
            key_rotation=config.key_rotation() if self.sinks else None,
        )
        #: The KV event publisher (``MAXKV_KV_EVENTS_ENDPOINT``), or ``None``.
        self.kv_events = self._kv_events()
        quantized = weights.blocks if isinstance(weights, HeldWeights) else None
        #: Prompt-lookup speculative decoding (``MAXKV_SPECULATIVE``), or ``None``.
        self.speculative = speculative_config(self.pipeline_config)
        self.decoder = DecoderModel(
            config,
            weights,
            self.maxkv_manager,
            session,
            output="logits",
            quantized=quantized,
            head_rows="given",
        )
        #: Prompt log probabilities of requests in a chunked prefill, until its end.
        self.prompt_logprobs = PromptLogProbabilities()
        #: CacheBlend of prompts with chunks (``MAXKV_BLEND``), or ``None``.
        self.blender = self._blender(config, weights, session, path)
        logger.info("maxkv: %s, %s", path, self.maxkv_manager.describe())
        logger.info("maxkv: %s", self.decoder.describe_arithmetic())
        for name in settings.unknown():
            logger.warning("maxkv: %s is set but maxkv reads no such variable (a typo?)", name)
        if self.blender is not None:
            logger.info("maxkv: %s", self.blender.describe())
        if self.speculative is not None:
            logger.info(
                "maxkv: speculative decoding by prompt lookup: up to %d draft tokens per "
                "greedy request, n-grams of %d to %d tokens%s",
                self.speculative.num_speculative_tokens,
                self.speculative.prompt_lookup_min,
                self.speculative.prompt_lookup_max,
                "" if self.speculative.adaptive else " (not adaptive)",
            )
        if self.sinks is not None:
            logger.info(
                "maxkv: attention sinks: every request keeps its first %d tokens (in whole "
                "pages) and its last %d",
                self.sinks[1],
                self.sinks[0],
            )

    def _kv_events(self) -> ZmqEventPublisher | None:
        """Publishes the cache's blocks when ``MAXKV_KV_EVENTS_ENDPOINT`` is set.

        Raises:
            ValueError: If prefix caching is off (no block would ever be announced).
        """
        if not settings.KV_EVENTS_ENDPOINT.is_set():
            if settings.KV_EVENTS_REPLAY_ENDPOINT.is_set():
                raise settings.SettingError(
                    f"{settings.KV_EVENTS_REPLAY_ENDPOINT.name} needs "
                    f"{settings.KV_EVENTS_ENDPOINT.name}"
                )
            return None
        from ...events.publisher import ZmqEventPublisher

        manager = self.maxkv_manager
        if not manager.prefix_caching:
            raise ValueError(
                f"{settings.KV_EVENTS_ENDPOINT.name} announces the blocks of the prefix cache: "
                "start max serve with --enable-prefix-caching"
            )
        publisher = ZmqEventPublisher.from_env()
        assert publisher is not None
        # A restarted replica holds nothing: subscribers forget what they knew of it.
        publisher.publish([AllBlocksCleared()])
        manager.attach_kv_events(publisher.publish)
        logger.info("maxkv: %s", publisher.describe())
        return publisher

    def _blender(self, config: Any, weights: Any, session: Any, path: Path) -> ServeBlender | None:
        """The worker's :class:`ServeBlender` when ``MAXKV_BLEND`` is on.

        Raises:
            ValueError: Where blending cannot run: a cache other than the paged
                one in float32, a model CacheBlend does not compute (sliding
                windows, a RoPE per layer type), attention sinks.
        """
        settings = BlendConfig.from_env()
        if settings is None:
            return None
        if not self.maxkv_manager.capabilities.blending:
            raise ValueError(
                f"{BLEND_ENV}=1 needs maxkv's paged cache ({CACHE_ENV}=paged, the default) "
                "for one model whose layers all attend to every token, not "
                f"{type(self.maxkv_manager).__name__}"
            )
        if self.maxkv_manager.params.cache_dtype != DType.float32:
            raise ValueError(
                f"{BLEND_ENV}=1 blends float32 KV: leave --kv-cache-format unset "
                f"(not {self.maxkv_manager.params.encoding})"
            )
        if self.sinks is not None:
            raise ValueError(
                f"{BLEND_ENV}=1 and attention sinks ({SLIDING_WINDOW_ENV}) exclude each other"
            )
        if not all(_is_cpu(d) for d in self.devices):
            raise ValueError(f"{BLEND_ENV}=1 blends in host memory: run on --devices cpu")
        tiers = TierConfig.from_env(model_identity(path))
        return ServeBlender(
            settings, config, weights, session, self.devices[0], tiers, self.maxkv_manager
        )

    @staticmethod
    def _session(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return kwargs["session"] if "session" in kwargs else args[1]

    def _prepare_initial_token_inputs(
        self,
        replica_batches: Sequence[Sequence[TextContext]],
        kv_cache_inputs: Any = None,
        return_n_logits: int = 1,
    ) -> MaxkvInputs:
        if return_n_logits != 1:
            raise ValueError("maxkv.pipelines returns one logit row per sequence")
        if len(replica_batches) != 1:
            raise ValueError("maxkv.pipelines does not support data parallelism")
        (batch,) = replica_batches
        return self.prepare_speculative_inputs(batch, [[] for _ in batch], kv_cache_inputs)

    def prepare_speculative_inputs(
        self,
        batch: Sequence[TextContext],
        drafts: Sequence[Sequence[int]],
        kv_cache_inputs: Any,
    ) -> MaxkvInputs:
        """A step whose sequences append ``drafts`` after their pending tokens (a
        model built with speculation reads every drafted row; others take no
        drafts)."""
        device = self.devices[0]
        if batch:
            pieces = [np.asarray(c.tokens.active) for c in batch]
            if any(drafts):  # each sequence's drafts after its pending tokens
                pieces = [
                    np.concatenate([p, np.asarray(d, np.int64)])
                    for p, d in zip(pieces, drafts, strict=True)
                ]
            tokens = np.concatenate(pieces)
            lengths = [c.tokens.active_length + len(d) for c, d in zip(batch, drafts, strict=True)]
        else:
            tokens, lengths = np.zeros(0, np.int64), []
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
        inputs = MaxkvInputs(
            tokens=Buffer.from_numpy(tokens.astype(np.int64)).to(device),
            input_row_offsets=Buffer.from_numpy(offsets).to(device),
            kv_cache_inputs=kv_cache_inputs,
        )
        rows: list[np.ndarray] = []
        first, sample = [], []
        count = 0
        ends = offsets[1:].astype(np.int64)
        for item, (ctx, draft, end) in enumerate(zip(batch, drafts, ends, strict=True)):
            if wants_prompt_logprobs(ctx):  # every row of the step
                if draft:
                    raise ValueError("a request computing its prompt's log probabilities drafts")
                n = ctx.tokens.active_length
                start = ctx.tokens.processed_length
                prompt_length = ctx.tokens.prompt_length
                inputs.prompt_rows.append(
                    PromptRows(
                        request_id=ctx.request_id,
                        item=item,
                        start=count,
                        position=start,
                        rows=n,
                        targets=np.asarray(
                            ctx.tokens.all[start + 1 : min(start + n + 1, prompt_length)],
                            dtype=np.int64,
                        ),
                        top_n=int(ctx.log_probabilities),
                    )
                )
                first.append(count)
                sample.append(count + n - 1)
            else:  # the last pending token's, then its drafts'
                n = len(draft) + 1
                first.append(count)
                sample.append(count)
            rows.append(np.arange(end - n, end))
            count += n
        picked = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        inputs.head_rows = Buffer.from_numpy(picked.astype(np.int64)).to(device)
        inputs.first_rows = np.asarray(first, dtype=np.int64)
        inputs.sample_rows = np.asarray(sample, dtype=np.int64)
        return inputs

    def execute(self, model_inputs: ModelInputs) -> ModelOutputs:
        """One model step: the logits of each sequence's last token, float32
        ``[batch, vocab]``; with drafts, ``logits`` holds every head row
        (``[rows, vocab]``) and ``next_token_logits`` each sequence's first."""
        assert isinstance(model_inputs, MaxkvInputs)
        if not model_inputs.kv_cache_inputs:  # an empty batch: nothing to run
            empty = Buffer.from_numpy(np.zeros((0, self.config.vocab_size), np.float32))
            return ModelOutputs(logits=empty, next_token_logits=empty)
        (kv,) = model_inputs.kv_cache_inputs
        tokens, offsets = model_inputs.tokens, model_inputs.input_row_offsets
        assert model_inputs.head_rows is not None
        logits = self.decoder.execute(tokens, offsets, kv, model_inputs.head_rows)
        sample = model_inputs.sample_rows
        assert sample is not None
        if len(sample) == logits.shape[0]:  # one row per sequence
            return ModelOutputs(logits=logits, next_token_logits=logits)
        picked = np.ascontiguousarray(host_array(logits)[sample])
        next_token_logits = Buffer.from_numpy(picked).to(self.devices[0])
        return ModelOutputs(logits=logits, next_token_logits=next_token_logits)

    def compute_log_probabilities(
        self,
        session: Any,
        model_inputs: ModelInputs,
        model_outputs: ModelOutputs,
        next_tokens: Buffer,
        batch_top_n: list[int],
        batch_echo: list[bool],
    ) -> list[Any]:
        """MAX's log probabilities of the sampled tokens, where asked; for a request
        whose prompt rows the head read (``echo``), those of its prompt tokens
        (:class:`~maxkv.serving.pipelines.prompt_logprobs.PromptLogProbabilities`):
        ``None`` until its prompt's last chunk, then every prompt token after the
        first and the sampled token."""
        assert isinstance(model_inputs, MaxkvInputs)
        computed: list[Any] = super().compute_log_probabilities(
            session,
            model_inputs,
            model_outputs,
            next_tokens,
            batch_top_n,
            [False] * len(batch_echo),
        )
        if not model_inputs.prompt_rows:
            return computed
        rows = host_array(model_outputs.logits)
        sampled = next_tokens.to_numpy().reshape(-1)
        for prompt in model_inputs.prompt_rows:
            computed[prompt.item] = self.prompt_logprobs.add(
                prompt, rows[prompt.start : prompt.start + prompt.rows], int(sampled[prompt.item])
            )
        return computed


def host_array(buffer: Buffer) -> np.ndarray:
    """``buffer``'s values in host memory (copied from a device)."""
    array: np.ndarray = (buffer if buffer.device.is_host else buffer.to(CPU())).to_numpy()
    return array


class MaxkvMemoryPlanner(PagedMemoryPlanner):
    """MAX's memory plan with the bytes maxkv's graph holds for the weights.

    MAX's planner counts the weight files' size; maxkv holds a GGUF's blocks
    packed for its kernels (a few percent more bytes than the file for the
    K-quants, more for Q5_0 and Q8_0's float32 scales) and widens float16 and
    bfloat16 checkpoints to float32, so the KV cache MAX plans beside them is sized from
    :func:`~maxkv.models.decoder.graph_weight_bytes` instead (read from the
    GGUF's metadata or ``config.json``; no weight is read).
    """

    def estimate_weights_size(self, pipeline_config: Any) -> int:
        return planned_weight_bytes(checkpoint_path(pipeline_config))


def planned_weight_bytes(path: Path) -> int:
    """:func:`~maxkv.models.decoder.graph_weight_bytes` of the checkpoint at ``path``
    (a logits graph on the CPU), without reading its weights."""
    source = model_file(path)
    if source.is_file():
        config, weights = load_model(source)  # a GGUF: its matrices stay in the file
        return graph_weight_bytes(config, weights, packed=True)
    return graph_weight_bytes(hf_directory_config(source), {}, packed=True)


def checkpoint_path(pipeline_config: Any) -> Path:
    """What maxkv loads for ``--model-path``: the directory, or its GGUF weight file."""
    model = pipeline_config.model
    weight_paths = [Path(p) for p in model.resolved_weight_paths()]
    ggufs = [p for p in weight_paths if p.suffix == ".gguf"]
    if len(ggufs) == 1 and ggufs[0].is_file():
        return ggufs[0]
    return Path(model.model_path)


#: Names the weights for the KV tiers instead of :func:`model_identity`'s digest.
MODEL_ID_ENV = settings.MODEL_ID.name


def model_identity(path: Path) -> str:
    """Names a checkpoint for the KV tiers, so that blocks of other weights are never
    reused: :data:`MODEL_ID_ENV` if set, else the checkpoint's name and a digest of
    every file's contents (weights, configuration, tokenizer), each file hashed once
    per size and modification time (remembered in maxkv's cache directory)."""
    override = settings.MODEL_ID.read()
    if override:
        return override
    root = path if path.is_dir() else path.parent
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        digest.update(f"{file.relative_to(root)}\0".encode() + _file_digest(file))
    return f"{path.name}@{digest.hexdigest()}"


def _file_digest(file: Path) -> bytes:
    """blake2b of ``file``'s bytes, remembered per (path, size, modification time)."""
    stat = file.stat()
    name = f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    memo = cache_dir() / "digests" / hashlib.blake2b(name, digest_size=16).hexdigest()
    try:
        return bytes.fromhex(memo.read_text().strip())
    except (OSError, ValueError):
        pass
    digest = hashlib.blake2b(digest_size=16)
    with open(file, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(digest.hexdigest())
    except OSError:
        pass  # a read-only cache directory: hash again next time
    return digest.digest()


def tokens_per_page(kv_cache_page_size: int) -> int:
    """Tokens per page: :data:`PAGE_SIZE_ENV` if set, else ``--kv-cache-page-size``
    unless it is MAX's default (which cannot be told from a flag left unset),
    else :data:`DEFAULT_PAGE_SIZE`.

    Raises:
        ValueError: If :data:`PAGE_SIZE_ENV` is not a positive int.
    """
    page_size = settings.PAGE_SIZE.read()
    if page_size is not None:
        return page_size
    if kv_cache_page_size != MAX_DEFAULT_PAGE_SIZE:
        return kv_cache_page_size
    return DEFAULT_PAGE_SIZE


def streaming_window() -> tuple[int, int] | None:
    """``(window, sinks)`` from :data:`SLIDING_WINDOW_ENV` and
    :data:`ATTENTION_SINKS_ENV`; ``None`` when no window is set.

    Raises:
        ValueError: If either is not a number of tokens (the window positive),
            or sinks are set without a window.
    """
    window = settings.SLIDING_WINDOW.read()
    sinks = settings.ATTENTION_SINKS.read()
    if window is None:
        if settings.ATTENTION_SINKS.is_set():
            raise ValueError(f"{ATTENTION_SINKS_ENV} needs {SLIDING_WINDOW_ENV} (the window)")
        return None
    return window, sinks


def keep_window_pages() -> bool:
    """Whether :data:`KEEP_WINDOW_PAGES_ENV` asks to keep the pages a window passed.

    Raises:
        ValueError: If it is set to something other than ``0`` or ``1``.
    """
    return settings.KEEP_WINDOW_PAGES.read()


def cache_budget(available: int | None) -> int | None:
    """The KV cache's bytes: MAX's memory plan's ``available`` (``None``: enough for
    every sequence), at most ``MAXKV_KV_CACHE_GB``."""
    cap = settings.KV_CACHE_GB.read()
    if cap is None:
        return available
    limit = int(cap * 2**30)
    return limit if available is None else min(available, limit)


def build_manager(
    kind: str,
    params: KVCacheParams,
    num_layers: int,
    devices: list[Any],
    session: Any,
    *,
    max_batch_size: int,
    max_seq_len: int,
    page_size: int,
    prefix_caching: bool,
    available: int | None,
    tiers: TierConfig | None = None,
    layer_windows: Sequence[int | None] = (),
    step_tokens: int | None = None,
    key_rotation: KeyRotation | None = None,
) -> KVCacheManagerBase:
    """maxkv's manager of ``kind`` for MAX's settings.

    Paged: as many pages of ``page_size`` tokens as ``available`` bytes hold
    (MAX's memory plan for the KV cache; ``None``: enough for every
    sequence at ``max_seq_len``), and ``2 * max_batch_size`` sequence ids
    (ids cost nothing; pages bound the cache).  Contiguous: ``max_batch_size``
    slots of ``max_seq_len`` tokens.  ``tiers`` apply to a paged cache with
    prefix caching on CPU devices (and are left off, with a log line, elsewhere).
    ``layer_windows`` (paged; per layer its sliding window, or ``None``;
    empty: no layer slides): when every layer slides, the pages before the
    window are given back as requests run; when some do, the cache is a
    :class:`~maxkv.HybridKVCacheManager` whose sliding groups get the pages
    of ``max_batch_size`` windows and of one step of ``step_tokens`` new
    tokens (MAX's ``--max-batch-input-tokens``; default 8192), and whose
    full-attention group gets the rest of the memory.  ``key_rotation``
    (paged): the model's RoPE, for attention sinks.

    Raises:
        CacheDoesNotFitError: If the cache (paged: one ``max_seq_len``
            sequence) needs more than ``available`` bytes.
    """
    windows = tuple(layer_windows) or (None,) * num_layers
    if kind == "paged":
        per_page = PagedKVCacheManager.estimated_memory_size(
            params, page_size, 1, num_layers, devices
        )
        pages_per_seq = math.ceil(max_seq_len / page_size)
        num_pages = max_batch_size * pages_per_seq if available is None else available // per_page
        if tiers is not None and tiers.any_tier and not prefix_caching:
            logger.info("maxkv: KV tiers are off: they need prefix caching")
            tiers = None
        if None in windows and any(w is not None for w in windows):
            return _hybrid_manager(
                params,
                devices,
                session,
                windows,
                budget=num_pages * per_page if available is None else available,
                max_batch_size=max_batch_size,
                max_seq_len=max_seq_len,
                page_size=page_size,
                prefix_caching=prefix_caching,
                tiers=tiers,
                step_tokens=step_tokens or DEFAULT_STEP_TOKENS,
            )
        if num_pages < pages_per_seq:
            raise CacheDoesNotFitError(
                f"maxkv's paged KV cache needs at least {pages_per_seq} pages of {page_size} "
                f"tokens ({pages_per_seq * per_page / 2**30:.2f} GiB) for one --max-length "
                f"{max_seq_len} sequence, but the memory plan leaves "
                f"{(available or 0) / 2**30:.2f} GiB for the KV cache: lower --max-length or "
                "--kv-cache-page-size"
            )
        return PagedKVCacheManager(
            params,
            page_size,
            num_pages,
            2 * max_batch_size,
            max_seq_len,
            num_layers,
            devices,
            session,
            enable_prefix_caching=prefix_caching,
            tiers=tiers,
            sliding_window=None if None in windows else max(w for w in windows if w),
            key_rotation=key_rotation,
        )
    check_cache_fits(
        ContinuousBatchingKVCacheManager.estimated_memory_size(
            params, max_batch_size, max_seq_len, num_layers, devices
        ),
        available,
        max_batch_size,
        max_seq_len,
    )
    return ContinuousBatchingKVCacheManager(
        params,
        max_batch_size,
        max_seq_len,
        num_layers,
        devices,
        session,
        enable_prefix_caching=prefix_caching,
    )


def _hybrid_manager(
    params: KVCacheParams,
    devices: list[Any],
    session: Any,
    windows: tuple[int | None, ...],
    *,
    budget: int,
    max_batch_size: int,
    max_seq_len: int,
    page_size: int,
    prefix_caching: bool,
    tiers: TierConfig | None,
    step_tokens: int,
) -> HybridKVCacheManager:
    """:func:`build_manager`'s cache for a model with sliding and full-attention layers."""
    try:
        num_pages = HybridKVCacheManager.plan_pages(
            params, page_size, windows, devices, budget, max_batch_size, max_seq_len, step_tokens
        )
    except ValueError as error:
        raise CacheDoesNotFitError(f"maxkv's hybrid KV cache: {error}") from None
    groups, _ = layer_groups(windows)
    full = num_pages[groups.index(None)]
    if full < math.ceil(max_seq_len / page_size):
        raise CacheDoesNotFitError(
            f"maxkv's hybrid KV cache: the full-attention layers get {full} pages of "
            f"{page_size} tokens, fewer than one --max-length {max_seq_len} sequence needs: "
            "lower --max-length, --max-batch-size or --max-batch-input-tokens"
        )
    return HybridKVCacheManager(
        params,
        page_size,
        num_pages,
        2 * max_batch_size,
        max_seq_len,
        windows,
        devices,
        session,
        enable_prefix_caching=prefix_caching,
        tiers=tiers,
    )


def _is_cpu(device: Any) -> bool:
    return bool(getattr(device, "is_host", False)) or "cpu" in str(device).lower()


def kv_cache_params(config: Any, kv_cache_config: Any) -> KVCacheParams:
    """The cache's parameters for ``config`` (a float32 model), in the encoding
    MAX's ``--kv-cache-format`` names (unset: float32).

    Raises:
        ValueError: For an encoding maxkv does not implement (the message names
            the flag and the encodings maxkv has); never served from another.
    """
    encoding = getattr(kv_cache_config, "kv_cache_format", None)
    try:
        return cache_params(config, DType.float32, encoding)
    except ValueError as error:
        raise ValueError(f"--kv-cache-format {encoding}: {error}") from None


def check_cache_fits(needed: int, available: int | None, slots: int, max_seq_len: int) -> None:
    """Raises :class:`CacheDoesNotFitError` when the contiguous cache exceeds the memory plan."""
    if available is not None and needed > available:
        raise CacheDoesNotFitError(
            f"maxkv's contiguous KV cache of {slots} slots x {max_seq_len} tokens "
            f"(--max-batch-size x --max-length) needs {needed / 2**30:.2f} GiB, but the "
            f"memory plan leaves {available / 2**30:.2f} GiB for the KV cache: lower "
            "--max-batch-size or --max-length"
        )
