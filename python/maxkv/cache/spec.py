"""A KV cache described without a manager: what a model graph needs to know of it.

:class:`CacheSpec` (parameters, layers, kind, page size) gives a graph its
cache inputs (:meth:`CacheSpec.input_symbols`); the graph side turns them into
the opaque collection (:func:`maxkv.graph.types.collection_fetcher`).  This
module and :mod:`~maxkv.cache.params` sit below the managers and the graph
side: they import neither.  Models and
graphs are built from a spec; a manager of the same spec feeds them at run
time (``manager.spec``).  The cache's sizes (slots, pages, ``max_seq_len``)
are symbolic dims of the inputs, so one compiled graph serves every manager
of a spec.

Per device a step's inputs are :class:`KVCacheInputs`, a ``NamedTuple``
that is still MAX 24.x's 4-tuple ``(blocks, cache_lengths, lookup_table,
max_lengths)``.

:class:`HybridCacheSpec` is a cache of layer groups (vLLM v1's hybrid
cache, MAX's ``KVCacheGroupId``): each group a paged cache of its own, so
that the pages of sliding-window layers go back to their pool while the
full-attention layers keep every token.  Per device its inputs are the
groups' 4-tuples one after the other, and the graph builds one collection
per group (:func:`maxkv.graph.types.layer_collections`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeVar, overload

from max.driver import Buffer, Device
from max.dtype import DType
from max.graph import DeviceRef, TensorType

from ..errors import ArgumentTypeError
from ..validation import require_int
from .params import KVCacheParams

#: How a cache stores sequences: one slot of ``max_seq_len`` tokens each, or pages.
CacheKind = Literal["contiguous", "paged"]
CACHE_KINDS: tuple[str, ...] = ("contiguous", "paged")

#: Symbolic dim of ``cache_lengths`` and the lookup table's first axis.
BATCH_DIM = "batch_size"
#: Symbolic dim of ``max_lengths``' first axis.
STEPS_DIM = "num_steps"
#: Symbolic dims of the contiguous blocks' slot and token axes.
SLOTS_DIM = "kv_cache_slots"
SEQ_LEN_DIM = "kv_max_seq_len"
#: Symbolic dims of the paged cache's page count and page-table width.
PAGES_DIM = "kv_num_pages"
PAGE_TABLE_WIDTH_DIM = "kv_max_pages_per_seq"


@overload
def kv_block_shape(
    num_layers: int, tokens: int, heads: int, head_width: int
) -> tuple[int, ...]: ...
@overload
def kv_block_shape(
    num_layers: int, tokens: int | str, heads: int, head_width: int
) -> tuple[int | str, ...]: ...
def kv_block_shape(
    num_layers: int, tokens: int | str, heads: int, head_width: int
) -> tuple[int | str, ...]:
    """The block layout, defined here once: the keys and values of ``tokens``
    tokens of every layer, ``[2, num_layers, tokens, heads, head_width]`` (axis
    0: 0 keys, 1 values; ``head_width``: :attr:`KVCacheParams.head_width`).

    A contiguous slot (``tokens`` = ``max_seq_len``), a page (``page_size``),
    a host-tier, disk or Redis block (a page per device) and a CacheBlend chunk
    all have it; a cache's ``blocks`` stack them on a first axis.
    """
    return (2, num_layers, tokens, heads, head_width)


class KVCacheInputs(NamedTuple):
    """One device's graph inputs for a step: MAX 24.x's 4-tuple, with names.

    - ``blocks``: the whole cache, of ``params.cache_dtype``; contiguous
      ``[slots, 2, num_layers, max_seq_len, n_kv_heads_per_device,
      head_width]``, paged ``[num_pages, 2, num_layers, page_size,
      n_kv_heads_per_device, head_width]`` (axis 1: 0 keys, 1 values;
      ``head_width`` is :attr:`KVCacheParams.head_width`: ``head_dim``, or a
      quantized row's storage elements, scales included).
    - ``cache_lengths``: uint32 ``[batch]``, tokens already cached per sequence.
    - ``lookup_table``: uint32; contiguous ``[batch]``, the slot of each
      sequence; paged ``[batch, max_pages_per_seq]``, its page table.
    - ``max_lengths``: uint32 ``[num_steps, 2]`` on the host; row *i* holds
      (max new tokens, max cache length) of step *i*.
    """

    blocks: Buffer
    cache_lengths: Buffer
    lookup_table: Buffer
    max_lengths: Buffer


#: One device's graph inputs for a step, as managers return them: a
#: :class:`KVCacheInputs`, or a hybrid cache's 4-tuples one after the other.
CacheInputs = tuple[Buffer, ...]

#: How many graph inputs one cache (or one layer group) takes per device: the
#: fields of :class:`KVCacheInputs`, written nowhere else.
INPUTS_PER_CACHE = len(KVCacheInputs._fields)

_T = TypeVar("_T")


def split_inputs(
    values: Sequence[_T], caches: int, what: str = "cache inputs"
) -> list[tuple[_T, ...]]:
    """One device's inputs of ``caches`` caches one after the other (a hybrid cache's
    groups; devices' inputs in a graph) -> each cache's :data:`INPUTS_PER_CACHE`.

    Raises:
        ValueError: If ``values`` does not hold exactly that many (naming ``what``).
    """
    if len(values) != INPUTS_PER_CACHE * caches:
        raise ValueError(
            f"{what}: expected {caches} x {INPUTS_PER_CACHE} values (KVCacheInputs), "
            f"got {len(values)}"
        )
    n = INPUTS_PER_CACHE
    return [tuple(values[n * i : n * i + n]) for i in range(caches)]


class KVCacheInputSymbols(NamedTuple):
    """The graph input types of one device's :class:`KVCacheInputs`."""

    blocks: TensorType
    cache_lengths: TensorType
    lookup_table: TensorType
    max_lengths: TensorType


@dataclass(frozen=True)
class CacheSpec:
    """What a graph needs to know of a KV cache, with no cache allocated.

    Args:
        params: Dtype and head layout of the cached keys and values.
        num_layers: Transformer layers cached.
        kind: ``"contiguous"`` (a slot per sequence) or ``"paged"``.
        page_size: Tokens per page; required for ``"paged"``, ``None`` for
            ``"contiguous"``.
        group: The layer group of a :class:`HybridCacheSpec` it is (its page
            count is a symbolic dim of its own); 0 otherwise.

    Raises:
        ArgumentTypeError: If an argument has the wrong type.
        ValueError: On an unknown kind, a non-positive size, or a page size
            given to a contiguous cache (or missing for a paged one).
    """

    params: KVCacheParams
    num_layers: int
    kind: CacheKind = "contiguous"
    page_size: int | None = None
    group: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.params, KVCacheParams):
            raise ArgumentTypeError(
                f"params must be a KVCacheParams, got {type(self.params).__name__}"
            )
        object.__setattr__(self, "num_layers", require_int("num_layers", self.num_layers, 1))
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"kind must be one of {CACHE_KINDS}, got {self.kind!r}")
        if self.kind == "paged":
            if self.page_size is None:
                raise ValueError("a paged cache needs a page_size")
            object.__setattr__(self, "page_size", require_int("page_size", self.page_size, 1))
        elif self.page_size is not None:
            raise ValueError(f"a contiguous cache has no page_size, got {self.page_size}")
        object.__setattr__(self, "group", require_int("group", self.group, 0))

    def blocks_shape(self) -> list[int | str]:
        """The ``blocks`` input's shape, with symbolic sizes."""
        p = self.params
        heads, dim = p.n_kv_heads_per_device, p.head_width
        if self.kind == "paged":
            assert self.page_size is not None
            pages = PAGES_DIM if self.group == 0 else f"{PAGES_DIM}_{self.group}"
            return [pages, *kv_block_shape(self.num_layers, self.page_size, heads, dim)]
        return [SLOTS_DIM, *kv_block_shape(self.num_layers, SEQ_LEN_DIM, heads, dim)]

    def allocated_shape(self, count: int, max_seq_len: int | None = None) -> list[int]:
        """:meth:`blocks_shape` of an allocated cache: ``count`` pages (paged) or
        slots of ``max_seq_len`` tokens (contiguous); the one definition of the
        block layout the managers allocate."""
        shape = self.blocks_shape()
        shape[0] = count
        if self.kind == "contiguous":
            if max_seq_len is None:
                raise ValueError("a contiguous cache's shape needs max_seq_len")
            shape[3] = max_seq_len
        return [int(n) for n in shape]

    def input_symbols(self, devices: Sequence[Device | DeviceRef]) -> list[KVCacheInputSymbols]:
        """The graph input types of one step, one :class:`KVCacheInputSymbols` per device.

        ``blocks`` as :meth:`blocks_shape`, ``cache_lengths`` ``["batch_size"]``,
        the lookup table ``["batch_size"]`` (contiguous) or ``["batch_size",
        "kv_max_pages_per_seq"]`` (paged), and ``max_lengths`` ``["num_steps",
        2]`` on the host.

        Raises:
            ValueError: If the number of devices differs from ``params.n_devices``.
        """
        if len(devices) != self.params.n_devices:
            raise ValueError(
                f"params.n_devices is {self.params.n_devices} but {len(devices)} devices were given"
            )
        table: list[int | str] = [BATCH_DIM]
        if self.kind == "paged":
            table.append(PAGE_TABLE_WIDTH_DIM)
        symbols = []
        for device in devices:
            ref = device if isinstance(device, DeviceRef) else DeviceRef.from_device(device)
            symbols.append(
                KVCacheInputSymbols(
                    TensorType(self.params.cache_dtype, self.blocks_shape(), ref),
                    TensorType(DType.uint32, [BATCH_DIM], ref),
                    TensorType(DType.uint32, table, ref),
                    TensorType(DType.uint32, [STEPS_DIM, 2], DeviceRef.CPU()),
                )
            )
        return symbols


@dataclass(frozen=True)
class HybridCacheSpec:
    """A paged cache of layer groups, each with its own pages and page tables.

    Args:
        groups: Each group's :class:`CacheSpec` (paged, same parameters and
            page size; ``group`` its index here).
        layers: Per model layer, ``(group, layer index within the group)``.

    Raises:
        ValueError: If the groups differ in parameters or page size, are not
            paged, or ``layers`` does not map onto every group's layers once.
    """

    groups: tuple[CacheSpec, ...]
    layers: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a hybrid cache needs at least one layer group")
        first = self.groups[0]
        for index, group in enumerate(self.groups):
            if group.kind != "paged" or group.group != index:
                raise ValueError(f"group {index} must be a paged CacheSpec with group={index}")
            if (group.params, group.page_size) != (first.params, first.page_size):
                raise ValueError("the layer groups must share their parameters and page size")
        expected = sorted(
            (g, i) for g, group in enumerate(self.groups) for i in range(group.num_layers)
        )
        if sorted(self.layers) != expected:
            raise ValueError(f"layers {self.layers} do not cover each group's layers once")

    @property
    def params(self) -> KVCacheParams:
        return self.groups[0].params

    @property
    def num_layers(self) -> int:
        """Model layers cached (all groups together)."""
        return len(self.layers)

    @property
    def page_size(self) -> int | None:
        return self.groups[0].page_size

    def input_symbols(self, devices: Sequence[Device | DeviceRef]) -> list[tuple[TensorType, ...]]:
        """Per device, the groups' :class:`KVCacheInputSymbols` one after the other."""
        per_group = [group.input_symbols(devices) for group in self.groups]
        return [
            tuple(t for symbols in device for t in symbols)
            for device in zip(*per_group, strict=True)
        ]
