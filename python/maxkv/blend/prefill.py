"""A prefill that runs layer by layer: full (for storing chunk KV) or blended.

:class:`BlendedPrefill` drives :class:`~maxkv.blend.graphs.LayerGraphs` over a
prompt.  Without an executor it computes every token (what
:meth:`~maxkv.blend.ChunkKVStore.store` keeps); with a retriever task and a
:class:`~maxkv.blend.BlendExecutor` it runs CacheBlend: each layer's
:meth:`~maxkv.blend.BlendExecutor.blend` decides which tokens the next
layers compute, and the blended K/V of every layer land in a maxkv cache,
from which decoding continues as usual.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
from max.driver import Device
from max.engine import InferenceSession

from ..cache.protocol import KVCacheManagerBase
from ..cache.spec import KVCacheInputs
from ..models.config import DecoderConfig
from ..models.decoder import graph_weights
from .executor import CacheBlendExecutor
from .graphs import LayerGraphs, weight_buffers
from .interfaces import BlendExecutor, BlendOutput, BlendRetrieverTask


class BlendedPrefill:
    """The model's layers as separately run graphs, for CacheBlend.

    Args:
        config: The model's configuration (a Llama).
        weights: Its weights (Hugging Face names, as ``load_model`` returns).
        session: The session (CPU) that compiles and runs the graphs.
        device: The CPU device.
    """

    def __init__(
        self,
        config: DecoderConfig,
        weights: Mapping[str, np.ndarray],
        session: InferenceSession,
        device: Device,
    ) -> None:
        self.config = config
        # The layer graphs read float32 matrices: held blocks are dequantized here.
        dense = {name: weights[name] for name in weights}
        packed = graph_weights(config, dense, packed=True)
        self._arrays = packed
        self.weights = weight_buffers(packed)
        self.graphs = LayerGraphs(config, session, device)
        #: Tokens computed per layer in the last run (for reports).
        self.tokens_per_layer: list[int] = []

    def rerotate(
        self, k: np.ndarray, from_positions: np.ndarray, to_positions: np.ndarray
    ) -> np.ndarray:
        """RoPE re-rotation in a MAX graph (what :class:`CacheBlendExecutor` takes)."""
        return self.graphs.rerotate(self.weights, k, from_positions, to_positions)

    def executor(
        self, recompute_ratio: float = 0.15, check_layers: tuple[int, ...] = (1,)
    ) -> CacheBlendExecutor:
        """A :class:`CacheBlendExecutor` that re-rotates with this model's graph."""
        return CacheBlendExecutor(self.rerotate, recompute_ratio, check_layers)

    def kv(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every layer's K (rotated at positions 0 ..) and V of ``tokens`` computed alone.

        Returns:
            ``(k, v)``, each float32 ``[num_layers, tokens, kv_heads, head_dim]``.
        """
        ks, vs = [], []
        for k, v in self._layers(np.asarray(tokens, dtype=np.int64), None, None):
            ks.append(k)
            vs.append(v)
        return np.stack(ks), np.stack(vs)

    def prefill(
        self,
        tokens: np.ndarray,
        task: BlendRetrieverTask | None,
        executor: BlendExecutor | None,
        manager: KVCacheManagerBase,
        seq_id: int,
        *,
        start: int = 0,
    ) -> np.ndarray:
        """Blended prefill of ``tokens[start:]`` into ``seq_id``; commits them.

        ``seq_id`` holds ``tokens[:start]`` already (exact KV: a prefix reused
        from the prefix cache; ``start`` > 0 needs a
        :class:`~maxkv.PagedKVCacheManager` in host memory) and nothing else;
        the new tokens attend to it at every layer.  ``task`` covers
        ``tokens[start:]`` only.  The commit passes no token ids: callers
        with prefix caching mark the blended KV with
        :meth:`~maxkv.PagedKVCacheManager.mark_blended` and commit
        through their own protocol instead (see :meth:`write`).

        Returns:
            float32 logits ``[vocab]`` of the last token.
        """
        self.write(tokens, task, executor, manager, seq_id, start=start)
        manager.step({seq_id: len(tokens) - start})
        assert self._last_hidden is not None
        logits: np.ndarray = self.graphs.head(self.weights, self._last_hidden)[0]
        return logits

    def write(
        self,
        tokens: np.ndarray,
        task: BlendRetrieverTask | None,
        executor: BlendExecutor | None,
        manager: KVCacheManagerBase,
        seq_id: int,
        *,
        start: int = 0,
    ) -> None:
        """:meth:`prefill` without the commit and the head: the blended K/V of
        ``tokens[start:]`` are written at ``seq_id``'s cache length, for the
        caller to commit (``manager.step``)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if not 0 <= start < len(tokens):
            raise ValueError(f"start {start} must be in [0, {len(tokens)})")
        if manager.cache_lengths[seq_id] != start:
            raise ValueError(
                f"seq_id {seq_id} holds {manager.cache_lengths[seq_id]} tokens, not the "
                f"{start} a blended prefill from {start} continues"
            )
        context = None
        if start:
            if not manager.capabilities.blending:
                raise ValueError(
                    "a blended prefill after cached tokens reads them back: it needs a cache "
                    f"with the 'blending' capability, which {type(manager).__name__} has not"
                )
            context = manager.read_tokens(seq_id, 0, start).astype(np.float32)
        (inputs,) = manager.fetch([seq_id], active_lengths=[len(tokens) - start])
        kv = KVCacheInputs(*inputs)  # one cache of every layer (not a hybrid one)
        layers = self._layers(tokens, task, executor, start, context)
        for layer, (k, v) in enumerate(layers):
            self.graphs.write(manager, kv, layer, k, v)

    def _layers(
        self,
        tokens: np.ndarray,
        task: BlendRetrieverTask | None,
        executor: BlendExecutor | None,
        start: int = 0,
        context: np.ndarray | None = None,
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yields each layer's long ``(k, v)`` of ``tokens[start:]``, which attend to
        ``context`` (``[2, layers, start, kv_heads, dim]``, the K/V of
        ``tokens[:start]``) too; leaves the last token's hidden row."""
        c = self.config
        h = self._arrays["embed_tokens"][tokens[start:]]
        if c.embed_scale is not None:
            h = h * np.float32(c.embed_scale)
        positions = np.arange(start, len(tokens), dtype=np.int64)
        starts = np.array([0, len(tokens) - start], dtype=np.int64)
        self.tokens_per_layer = []
        for layer in range(c.num_hidden_layers):
            q, k, v = self.graphs.qkv(self.weights, layer, h, positions)
            out = BlendOutput(q, k, v, positions, np.arange(len(positions)), None)
            if executor is not None and task is not None:
                r = task.result(layer)
                out = executor.blend(
                    layer,
                    r.k,
                    r.v,
                    r.valid_mask,
                    r.original_positions,
                    q,
                    k,
                    v,
                    positions,
                    starts,
                    0,
                )
                if out.query_start_loc is not None:
                    h = h[out.local_indices]
                    starts = out.query_start_loc
                positions = out.positions
            self.tokens_per_layer.append(len(positions))
            yield out.k, out.v
            keys, values = out.k, out.v
            if context is not None:
                keys = np.concatenate([context[0, layer], keys])
                values = np.concatenate([context[1, layer], values])
            h = self.graphs.attention_mlp(self.weights, layer, h, out.q, positions, keys, values)
        self._last_hidden = h[-1:]

    _last_hidden: np.ndarray | None = None
