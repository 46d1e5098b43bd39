"""maxkv's graph functions, in one namespace: ``maxkv.ops``.

- The KV-cache ops (:mod:`maxkv.graph.ops`): they take a collection built by
  ``FetchContinuousBatchingKVCacheCollection`` or ``FetchPagedKVCacheCollection``
  and the :class:`~maxkv.KVCacheParams` it was built for.
- The CPU kernels of the model graph (:mod:`maxkv.cpu`): packed matmuls,
  SwiGLU and the greedy head.

A graph that uses them must load :func:`maxkv.kernels_path` as a custom
extension.  Shapes, dtypes and errors are in each function's docstring.
"""

from .cpu.greedy_head import (
    GREEDY_HEAD_LAYOUTS,
    GreedyHeadLayout,
    greedy_head,
    greedy_head_layout,
    greedy_head_supported,
    greedy_q_shape,
    pack_greedy_head,
)
from .cpu.linear import (
    BLOCK_COLS,
    PACKED_TILE,
    activations,
    gather_quantized,
    linear_packed,
    pack_linear_weight,
    packed_block_cols,
    swiglu,
)
from .graph.ops import (
    MaskVariant,
    cache_lengths,
    check_row_offsets,
    copy_tokens,
    flash_attention_ragged,
    fused_qk_ragged_rope,
    fused_qkv_ragged_matmul,
    rope_freqs_cis,
    store_kv_ragged,
    write_kv_ragged,
)

__all__ = [
    "BLOCK_COLS",
    "GREEDY_HEAD_LAYOUTS",
    "PACKED_TILE",
    "GreedyHeadLayout",
    "MaskVariant",
    "activations",
    "cache_lengths",
    "check_row_offsets",
    "copy_tokens",
    "flash_attention_ragged",
    "fused_qk_ragged_rope",
    "fused_qkv_ragged_matmul",
    "gather_quantized",
    "greedy_head",
    "greedy_head_layout",
    "greedy_head_supported",
    "greedy_q_shape",
    "linear_packed",
    "pack_greedy_head",
    "pack_linear_weight",
    "packed_block_cols",
    "rope_freqs_cis",
    "store_kv_ragged",
    "swiglu",
    "write_kv_ragged",
]
