"""Every ``MAXKV_*`` environment variable, declared once.

A :class:`Setting` holds a variable's name, default, the values it takes and a
line saying what it does; :data:`SETTINGS` lists them all (the table in
``docs/pipelines.md`` is checked against it).  The rest of maxkv reads the
environment through these objects only::

    from maxkv import settings

    kind = settings.CACHE.read()        # "paged" unless MAXKV_CACHE says otherwise
    tiers = settings.HOST_TIER_GB.read({"MAXKV_HOST_TIER_GB": "2"})  # 2.0

:meth:`Setting.read` strips the value, returns the default for an unset or
empty variable, and raises :class:`SettingError` (a ``ValueError``) naming the
variable and what it expects for any other value it cannot take.  Checks that
involve several variables (a window for the sinks, one secret source) stay
with the code that combines them.

This module imports nothing of maxkv: every layer may read its settings here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

#: The words a flag takes, lowercased: on, then off ("" is unset: the default).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A ``MAXKV_*`` variable holds a value it cannot take (the message names it)."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: its name, default, parser and meaning.

    Args:
        name: The variable, ``MAXKV_...``.
        default: The value when it is unset or empty.
        parse: Turns the stripped text into a value; raises ``ValueError`` for
            text it does not take.
        expected: What it takes, for the error (``"a positive integer"``).
        doc: One line: what it does (the settings table's).
        group: Where it acts: ``process``, ``cache``, ``tiers``, ``blend``,
            ``speculation``, ``api``.
        verbatim: The text is taken as it is, spaces and all, and set empty it
            is parsed (a separator); otherwise it is stripped and empty is unset.
    """

    name: str
    default: T
    parse: Callable[[str], T]
    expected: str
    doc: str
    group: str
    verbatim: bool = False

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text (stripped unless :attr:`verbatim`), ``None`` when unset
        (or empty, unless :attr:`verbatim`)."""
        value = (os.environ if environ is None else environ).get(self.name)
        if value is None or self.verbatim:
            return value
        return value.strip() or None

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable holds a non-empty value."""
        return self.raw(environ) is not None

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The variable's value (``environ``: instead of ``os.environ``).

        Raises:
            SettingError: If it holds a value :attr:`parse` refuses.
        """
        value = self.raw(environ)
        if value is None:
            return self.default
        try:
            return self.parse(value)
        except ValueError:
            raise SettingError(f"{self.name}={value!r}: expected {self.expected}") from None


# ------------------------------------------------------------------ parsers


def _count(text: str) -> int:
    """An integer >= 0 written in digits."""
    if not text.isdigit():
        raise ValueError(text)
    return int(text)


def _positive(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise ValueError(text)
    return value


def _flag(text: str) -> bool:
    word = text.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(text)


def _binary(text: str) -> bool:
    """Exactly ``0`` or ``1``."""
    if text not in ("0", "1"):
        raise ValueError(text)
    return text == "1"


def _number(text: str) -> float:
    return float(text)


def _gib(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses NaN
        raise ValueError(text)
    return value


def _text(text: str) -> str:
    return text


def _separator(text: str) -> str:
    if not text:
        raise ValueError(text)
    return text


def _optional_text(text: str) -> str | None:
    return text


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        word = text.lower()
        if word not in values:
            raise ValueError(text)
        return word

    return parse


def _layer_ids(text: str) -> tuple[int, ...]:
    layers = tuple(int(x) for x in text.split(","))
    if any(layer < 0 for layer in layers):
        raise ValueError(text)
    return layers


def _names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _endpoints(text: str) -> tuple[str, ...]:
    """Comma-separated ZMQ endpoints (``tcp://host:port``, ``ipc://path``)."""
    endpoints = _names(text)
    for endpoint in endpoints:
        scheme, _, where = endpoint.partition("://")
        if scheme not in ("tcp", "ipc", "inproc") or not where:
            raise ValueError(text)
        if scheme == "tcp" and not where.rpartition(":")[2].isdigit():
            raise ValueError(text)
    if not endpoints:
        raise ValueError(text)
    return endpoints


# ------------------------------------------------------------------ the settings

# process: where maxkv keeps files, what it logs, which kernels it picks
CACHE_DIR: Setting[str | None] = Setting(
    "MAXKV_CACHE_DIR", None, _optional_text, "a directory",
    "maxkv's cache folder (compiled kernels, models, tokenizers); else "
    "$XDG_CACHE_HOME/maxkv or ~/.cache/maxkv",
    "process",
)  # fmt: skip
EVENT_LOG: Setting[str | None] = Setting(
    "MAXKV_EVENT_LOG", None, _optional_text, "a file",
    "one JSON line per request started and released in MAX's pipelines, with the "
    "cache's free pages (or slots) and the request's tokens",
    "process",
)  # fmt: skip
GREEDY_HEAD: Setting[bool] = Setting(
    "MAXKV_GREEDY_HEAD", True, _flag, "1 or 0",
    "0: the CPU model computes every float32 logit for a greedy step instead of "
    "maxkv's exact integer greedy head",
    "process",
)  # fmt: skip
ACTIVATIONS: Setting[str] = Setting(
    "MAXKV_ACTIVATIONS", "float32", _choice("float32", "int8"), "float32 or int8",
    "how the CPU model multiplies matrices held as a GGUF's integer blocks: float32, "
    "the exact products of the dequantized weights; int8, each activation row "
    "quantized to int8 per block and multiplied in integers (faster, approximate; "
    "AVX-512 VNNI where the CPU has it, else AVX2)",
    "process",
)  # fmt: skip
PACKED_CACHE: Setting[bool] = Setting(
    "MAXKV_PACKED_CACHE", True, _flag, "1 or 0",
    "1: a GGUF's packed CPU tiles are kept under the cache folder's packed/ and "
    "mapped at the next load of the same file (checked against their digests); 0: "
    "packed at every load",
    "process",
)  # fmt: skip
MODEL_ID: Setting[str | None] = Setting(
    "MAXKV_MODEL_ID", None, _optional_text, "a name",
    "names the weights for the KV tiers instead of a digest of the checkpoint's files",
    "process",
)  # fmt: skip

# cache: the manager MAX's pipelines build
CACHE_KINDS = ("paged", "contiguous")
CACHE: Setting[str] = Setting(
    "MAXKV_CACHE", CACHE_KINDS[0], _choice(*CACHE_KINDS), "one of " + ", ".join(CACHE_KINDS),
    "the manager: pages (default), or one slot of --max-length tokens per --max-batch-size",
    "cache",
)  # fmt: skip
PAGE_SIZE: Setting[int | None] = Setting(
    "MAXKV_PAGE_SIZE", None, _positive, "a positive number of tokens",
    "tokens per page; else MAX's --kv-cache-page-size when it is not MAX's default "
    "of 128, else 16",
    "cache",
)  # fmt: skip
SLIDING_WINDOW: Setting[int | None] = Setting(
    "MAXKV_SLIDING_WINDOW", None, _positive, "a positive number of tokens",
    "attention sinks (StreamingLLM): every request's cache keeps its last this many "
    "tokens, and its first MAXKV_ATTENTION_SINKS",
    "cache",
)  # fmt: skip
ATTENTION_SINKS: Setting[int] = Setting(
    "MAXKV_ATTENTION_SINKS", 4, _count, "a number of tokens",
    "the first tokens every request keeps with MAXKV_SLIDING_WINDOW (default 4)",
    "cache",
)  # fmt: skip
KEEP_WINDOW_PAGES: Setting[bool] = Setting(
    "MAXKV_KEEP_WINDOW_PAGES", False, _binary, "0 or 1",
    "1: a model with sliding-window layers keeps every page until the request ends",
    "cache",
)  # fmt: skip

KV_CACHE_GB: Setting[float | None] = Setting(
    "MAXKV_KV_CACHE_GB", None, _gib, "a number of GiB >= 0",
    "most memory the KV cache takes (a replica's share of a machine); unset: what MAX's "
    "memory plan leaves",
    "cache",
)  # fmt: skip

# tiers: KV blocks beyond the device
HOST_TIER_GB: Setting[float] = Setting(
    "MAXKV_HOST_TIER_GB", 1.0, _gib, "a number of GiB >= 0",
    "the host-memory tier's budget (0 turns it off)",
    "tiers",
)  # fmt: skip
DISK_TIER_DIR: Setting[str | None] = Setting(
    "MAXKV_DISK_TIER_DIR", None, _optional_text, "a directory",
    "where the disk tier keeps its files (unset: no disk tier)",
    "tiers",
)  # fmt: skip
DISK_TIER_GB: Setting[float] = Setting(
    "MAXKV_DISK_TIER_GB", 16.0, _gib, "a number of GiB >= 0",
    "the disk tier's budget",
    "tiers",
)  # fmt: skip
REDIS_URL: Setting[str | None] = Setting(
    "MAXKV_REDIS_URL", None, _optional_text, "a redis:// or rediss:// URL",
    "the Redis the replicas share (unset: no Redis tier; needs MAXKV_TIER_SECRET)",
    "tiers",
)  # fmt: skip
REDIS_NAMESPACE: Setting[str] = Setting(
    "MAXKV_REDIS_NAMESPACE", "maxkv", _text, "a key prefix",
    "the prefix of maxkv's keys in Redis",
    "tiers",
)  # fmt: skip
SWAP_GB: Setting[float] = Setting(
    "MAXKV_SWAP_GB", 4.0, _gib, "a number of GiB >= 0",
    "host memory for the pages of requests swapped out under memory pressure",
    "tiers",
)  # fmt: skip
TIER_SECRET: Setting[str | None] = Setting(
    "MAXKV_TIER_SECRET", None, _optional_text, "a secret",
    "the secret that signs the blocks written to disk and Redis (per tenant)",
    "tiers",
)  # fmt: skip
TIER_SECRET_FILE: Setting[str | None] = Setting(
    "MAXKV_TIER_SECRET_FILE", None, _optional_text, "a file",
    "a file holding MAXKV_TIER_SECRET (set one of the two)",
    "tiers",
)  # fmt: skip
TIER_OLD_SECRETS: Setting[tuple[str, ...]] = Setting(
    "MAXKV_TIER_OLD_SECRETS", (), _names, "comma-separated secrets",
    "earlier secrets whose blocks are still accepted while a secret is rotated",
    "tiers",
)  # fmt: skip
TIER_INSECURE: Setting[bool] = Setting(
    "MAXKV_TIER_INSECURE", False, _flag, "1 or 0",
    "1: a Redis tier without a secret (blocks unsigned: one trusted tenant only)",
    "tiers",
)  # fmt: skip
TIER_ENCRYPT: Setting[bool] = Setting(
    "MAXKV_TIER_ENCRYPT", False, _flag, "1 or 0",
    "1: blocks are also encrypted (AES-GCM) under a key derived from the secret",
    "tiers",
)  # fmt: skip

# events: KV events for KV-aware routers
KV_EVENTS_ENDPOINT: Setting[tuple[str, ...]] = Setting(
    "MAXKV_KV_EVENTS_ENDPOINT", (), _endpoints, "ZMQ endpoints, as tcp://*:5557",
    "publishes the cache's blocks as vLLM KV events on these endpoints (bound; "
    "comma-separated; needs prefix caching)",
    "events",
)  # fmt: skip
KV_EVENTS_REPLAY_ENDPOINT: Setting[tuple[str, ...]] = Setting(
    "MAXKV_KV_EVENTS_REPLAY_ENDPOINT", (), _endpoints, "ZMQ endpoints, as tcp://*:5558",
    "where a subscriber that missed batches asks for them again (unset: no replay)",
    "events",
)  # fmt: skip
KV_EVENTS_TOPIC: Setting[str] = Setting(
    "MAXKV_KV_EVENTS_TOPIC", "", _text, "a topic",
    "the first frame of every event message (vLLM's topic; default empty)",
    "events",
)  # fmt: skip

# blend: CacheBlend in MAX's pipelines
BLEND: Setting[bool] = Setting(
    "MAXKV_BLEND", False, _flag, "1 or 0",
    "1: CacheBlend for RAG prompts (chunks between separators reused wherever they stand)",
    "blend",
)  # fmt: skip
BLEND_SEPARATOR: Setting[str] = Setting(
    "MAXKV_BLEND_SEPARATOR", " # # ", _separator, "the string that separates chunks (not empty)",
    "what separates a prompt's prefix, chunks and suffix (LMCache's blend_special_str)",
    "blend", verbatim=True,
)  # fmt: skip
BLEND_RECOMPUTE_RATIO: Setting[float] = Setting(
    "MAXKV_BLEND_RECOMPUTE_RATIO", 0.15, _number, "a number",
    "share of each found chunk's tokens recomputed after the check layer (0 to 1)",
    "blend",
)  # fmt: skip
BLEND_CHECK_LAYERS: Setting[tuple[int, ...]] = Setting(
    "MAXKV_BLEND_CHECK_LAYERS", (1,), _layer_ids, "layer ids >= 0, as 1,3",
    "the layers where the deviation is measured",
    "blend",
)  # fmt: skip
BLEND_MIN_TOKENS: Setting[int] = Setting(
    "MAXKV_BLEND_MIN_TOKENS", 64, _count, "a number of tokens",
    "fewest found tokens that make a request blend",
    "blend",
)  # fmt: skip
BLEND_MAX_PER_BATCH: Setting[int] = Setting(
    "MAXKV_BLEND_MAX_PER_BATCH", 1, _positive, "1 or more",
    "most requests blended while one batch is built",
    "blend",
)  # fmt: skip
BLEND_CHUNK_CONTEXTS = ("request", "none")
BLEND_CHUNK_CONTEXT: Setting[str] = Setting(
    "MAXKV_BLEND_CHUNK_CONTEXT", BLEND_CHUNK_CONTEXTS[0], _choice(*BLEND_CHUNK_CONTEXTS),
    "one of " + ", ".join(BLEND_CHUNK_CONTEXTS),
    "what a stored chunk's KV was computed after: the request that first used it, or nothing",
    "blend",
)  # fmt: skip

# speculation: prompt lookup in MAX's pipelines
SPECULATIVE_METHODS = ("ngram",)


def _speculative(text: str) -> str | None:
    if text.lower() in ("off", "none", "0"):
        return None
    return _choice(*SPECULATIVE_METHODS)(text)


SPECULATIVE: Setting[str | None] = Setting(
    "MAXKV_SPECULATIVE", None, _speculative,
    "a method maxkv speculates with (by prompt lookup: ngram), or off",
    "ngram: speculative decoding by prompt lookup for greedy requests",
    "speculation",
)  # fmt: skip
NUM_SPECULATIVE_TOKENS: Setting[int | None] = Setting(
    "MAXKV_NUM_SPECULATIVE_TOKENS", None, _count, "a positive integer",
    "most draft tokens per request per step, unless MAX passes --num-speculative-tokens "
    "(default 4)",
    "speculation",
)  # fmt: skip
PROMPT_LOOKUP_MIN: Setting[int | None] = Setting(
    "MAXKV_PROMPT_LOOKUP_MIN", None, _count, "a positive integer",
    "shortest n-gram matched (vLLM's prompt_lookup_min; default 2)",
    "speculation",
)  # fmt: skip
PROMPT_LOOKUP_MAX: Setting[int | None] = Setting(
    "MAXKV_PROMPT_LOOKUP_MAX", None, _count, "a positive integer",
    "longest n-gram matched (vLLM's prompt_lookup_max; default 4)",
    "speculation",
)  # fmt: skip
SPECULATIVE_ADAPTIVE: Setting[bool] = Setting(
    "MAXKV_SPECULATIVE_ADAPTIVE", True, _binary, "0 or 1",
    "0: every request drafts whenever a match is found (no cost model)",
    "speculation",
)  # fmt: skip
SPECULATIVE_ROW_COST: Setting[float] = Setting(
    "MAXKV_SPECULATIVE_ROW_COST", 0.1, _number, "a number",
    "what one more row adds to a decode step, relative to a one-row step (the cost model's)",
    "speculation",
)  # fmt: skip
SPECULATIVE_MAX_BATCH_TOKENS: Setting[int] = Setting(
    "MAXKV_SPECULATIVE_MAX_BATCH_TOKENS", 64, _count, "a positive integer",
    "most rows (pending tokens and drafts) of a decode step",
    "speculation",
)  # fmt: skip

# the OpenAI routes
MAX_CHOICES: Setting[int] = Setting(
    "MAXKV_MAX_CHOICES", 16, _positive, "a positive integer",
    "most choices one request may ask for (its n, its best_of); more is a 400",
    "api",
)  # fmt: skip

#: Every setting, by name.
SETTINGS: dict[str, Setting[object]] = {
    s.name: s  # type: ignore[misc]
    for s in (
        CACHE_DIR, EVENT_LOG, GREEDY_HEAD, ACTIVATIONS, PACKED_CACHE, MODEL_ID,
        CACHE, PAGE_SIZE, SLIDING_WINDOW, ATTENTION_SINKS, KEEP_WINDOW_PAGES, KV_CACHE_GB,
        HOST_TIER_GB, DISK_TIER_DIR, DISK_TIER_GB, REDIS_URL, REDIS_NAMESPACE, SWAP_GB,
        TIER_SECRET, TIER_SECRET_FILE, TIER_OLD_SECRETS, TIER_INSECURE, TIER_ENCRYPT,
        KV_EVENTS_ENDPOINT, KV_EVENTS_REPLAY_ENDPOINT, KV_EVENTS_TOPIC,
        BLEND, BLEND_SEPARATOR, BLEND_RECOMPUTE_RATIO, BLEND_CHECK_LAYERS, BLEND_MIN_TOKENS,
        BLEND_MAX_PER_BATCH, BLEND_CHUNK_CONTEXT,
        SPECULATIVE, NUM_SPECULATIVE_TOKENS, PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX,
        SPECULATIVE_ADAPTIVE, SPECULATIVE_ROW_COST, SPECULATIVE_MAX_BATCH_TOKENS,
        MAX_CHOICES,
    )
}  # fmt: skip


def unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """``MAXKV_*`` variables set in ``environ`` that maxkv does not read (typos)."""
    env = os.environ if environ is None else environ
    return sorted(name for name in env if name.startswith("MAXKV_") and name not in SETTINGS)
