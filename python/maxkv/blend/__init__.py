"""CacheBlend on maxkv (LMCache's design, seed 003): reuse the KV of retrieved
chunks anywhere in a prompt and recompute only the tokens whose KV deviates most.

- :mod:`~maxkv.blend.interfaces`: LMCache's ``BlendRetriever``,
  ``BlendRetrieverTask``, ``BlendRetrieverResult``, ``BlendExecutor`` and
  ``BlendOutput``, with NumPy arrays.
- :class:`ChunkKVStore` / :class:`CacheBlendRetriever`: chunk KV computed
  alone, kept in memory and optionally on disk, retrieved by token ids.
- :class:`CacheBlendExecutor`: selective recompute (``recompute_ratio``,
  ``check_layers``) with RoPE re-rotation of the retrieved K.
- :class:`BlendedPrefill`: runs the model layer by layer in MAX graphs and
  writes the blended KV into a maxkv cache, from which decoding continues.
"""

from .executor import CacheBlendExecutor, rerotate_numpy
from .interfaces import (
    BlendExecutor,
    BlendOutput,
    BlendRetriever,
    BlendRetrieverResult,
    BlendRetrieverTask,
)
from .metrics import rouge_l, token_f1
from .prefill import BlendedPrefill
from .store import CacheBlendRetriever, CacheBlendRetrieverTask, ChunkKVStore

__all__ = [
    "BlendExecutor",
    "BlendOutput",
    "BlendRetriever",
    "BlendRetrieverResult",
    "BlendRetrieverTask",
    "BlendedPrefill",
    "CacheBlendExecutor",
    "CacheBlendRetriever",
    "CacheBlendRetrieverTask",
    "ChunkKVStore",
    "rerotate_numpy",
    "rouge_l",
    "token_f1",
]
