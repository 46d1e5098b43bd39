"""The chunk KV store and CacheBlend's retriever over it.

:class:`ChunkKVStore` keeps each text chunk's K/V, computed by prefilling
the chunk alone (positions 0 ..), keyed by a hash of the model and the
chunk's token ids, in the same tiers as the paged cache's pages
(:mod:`maxkv.tiers`): host memory, a directory that survives restarts, and a
Redis shared by every process of the same model, each block checked (model,
layout, CRC-32) when it comes back.  :class:`CacheBlendRetriever` answers LMCache's
:meth:`~maxkv.blend.BlendRetriever.new_request` from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from ..tiers.blocks import BlockLayout
from ..tiers.store import TierConfig, TieredBlockStore
from .interfaces import BlendRetriever, BlendRetrieverResult, BlendRetrieverTask
from .prefill import BlendedPrefill

#: A kept chunk: K and V ``[num_layers, tokens, kv_heads, head_dim]`` and the
#: position its first token had when they were computed.
StoredKV = tuple[np.ndarray, np.ndarray, int]


class ChunkKVStore:
    """Chunk token ids -> every layer's K and V (and the position the chunk started at).

    A chunk is prefilled alone (positions 0 ..), or, with ``context``, after a
    fixed context such as the chat template's header (positions
    ``len(context) ..``, attending to it): the chunk's KV then no longer
    carries the attention-sink role of a sequence's first tokens, which
    brings the blended KV much closer to a full prefill's (see the README).

    Args:
        prefill: Computes a chunk's K/V (the model).
        directory: Where to keep chunks across restarts (the disk tier;
            optional, the same as ``tiers=TierConfig(disk_dir=directory)``).
        tiers: Host, disk and Redis tiers and their budgets (default: a 1 GiB
            host tier, plus ``directory``); chunks a tier drops are recomputed.
    """

    def __init__(
        self,
        prefill: BlendedPrefill,
        directory: str | Path | None = None,
        *,
        tiers: TierConfig | None = None,
    ) -> None:
        self.prefill = prefill
        c = prefill.config
        self._model_tag = hashlib.sha256(repr(c).encode()).hexdigest()[:16]
        config = tiers or TierConfig()
        model_id = config.model_id or f"config-{self._model_tag}"
        disk_dir = str(directory) if directory is not None else config.disk_dir
        config = dataclasses.replace(config, model_id=model_id, disk_dir=disk_dir)
        layout = BlockLayout(
            model_id=config.model_id,
            kind="chunk",
            num_layers=int(c.num_hidden_layers),
            n_kv_heads=int(getattr(c, "num_key_value_heads", 0) or 0),
            head_dim=int(getattr(c, "head_dim", 0) or 0),
            dtype="float32",
        )
        self.tiers = TieredBlockStore(layout, config)
        self.directory = (
            Path(config.disk_dir) / layout.fingerprint if config.disk_dir is not None else None
        )

    def key(
        self,
        tokens: np.ndarray | list[int],
        context: np.ndarray | list[int] | None = None,
        *,
        salt: str | None = None,
    ) -> str:
        """The store key of a chunk: a hash of the model, the tenant ``salt`` (a
        request's ``cache_salt``), the context and the token ids."""
        ids = np.asarray(tokens, dtype=np.int64)
        before = np.asarray(context if context is not None else [], dtype=np.int64)
        digest = hashlib.sha256(self._model_tag.encode())
        if salt is not None:
            digest.update(b"salt\0" + salt.encode() + b"\0")
        digest.update(len(before).to_bytes(8, "little") + before.tobytes() + ids.tobytes())
        return digest.hexdigest()

    def store(
        self,
        chunk_tokens: np.ndarray | list[int],
        context: np.ndarray | list[int] | None = None,
    ) -> str:
        """Prefills the chunk (alone, or after ``context``) and keeps its K/V.

        A no-op when the chunk is already kept.

        Returns:
            The chunk's key.
        """
        tokens = np.asarray(chunk_tokens, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError("chunk_tokens must be a non-empty 1-D list of token ids")
        before = np.asarray(context if context is not None else [], dtype=np.int64)
        key = self.key(tokens, before)
        if self.get(key) is not None:
            return key
        k, v = self.prefill.kv(np.concatenate([before, tokens]))
        start = len(before)
        self.put(key, k[:, start:], v[:, start:], start)
        self.tiers.flush()  # on disk (and Redis) before this returns: a restart finds it
        return key

    def put(
        self, key: str, k: np.ndarray, v: np.ndarray, start: int, *, tenant: str | None = None
    ) -> None:
        """Keeps a chunk's K and V ``[num_layers, tokens, kv_heads, head_dim]``, computed
        with its first token at position ``start``, under ``key`` (signed for
        ``tenant`` where it leaves the process); the disk and Redis copies are
        written in the background."""
        kv = np.stack([k, v]).astype(np.float32)
        self.tiers.put(bytes.fromhex(key), kv, {"start": int(start)}, tenant=tenant)

    def get(
        self, key: str, *, tenant: str | None = None, tokens: int | None = None
    ) -> StoredKV | None:
        """A chunk's ``(k, v, start)``: K and V ``[num_layers, tokens, kv_heads,
        head_dim]`` and the position its first token had; ``None`` if no tier has
        it (or a copy from disk or Redis failed its check for ``tenant``, or it
        does not hold ``tokens`` tokens when given)."""
        found = self.tiers.get(bytes.fromhex(key), tenant=tenant)
        if found is None:
            return None
        kv, extra = found
        start = extra.get("start")
        valid = isinstance(start, int) and not isinstance(start, bool) and start >= 0
        # Re-rotating it must not read past the model's RoPE table.
        wrong_length = tokens is not None and kv.shape[2] != tokens
        if not valid or wrong_length or start + kv.shape[2] > self.positions:
            self.tiers.host.drop(bytes.fromhex(key))  # recomputed and put again
            return None
        assert isinstance(start, int)
        return kv[0], kv[1], start

    @property
    def positions(self) -> int:
        """Positions the model's RoPE table holds (a chunk's must lie below)."""
        return int(self.prefill.graphs.shapes["rope.freqs_cis"][0])

    def __len__(self) -> int:
        """Chunks in host memory."""
        return len(self.tiers.host)

    def close(self) -> None:
        """Finishes queued writes and stops the tiers' thread."""
        self.tiers.close()


class CacheBlendRetrieverTask(BlendRetrieverTask):
    """Per layer, the retrieved K/V of a batch of prompts (concatenated)."""

    def __init__(self, segments: list[tuple[int, int, StoredKV | None]], total: int):
        self._segments = segments
        self._total = total
        self.valid_mask = np.zeros(total, dtype=bool)
        self.original_positions = np.zeros(total, dtype=np.int64)
        for start, length, kv in segments:
            if kv is not None:
                self.valid_mask[start : start + length] = True
                self.original_positions[start : start + length] = kv[2] + np.arange(length)

    def result(self, layer_id: int) -> BlendRetrieverResult:
        found = [(s, n, kv) for s, n, kv in self._segments if kv is not None]
        if not found:
            return BlendRetrieverResult(None, None, self.valid_mask, self.original_positions)
        shape = found[0][2][0].shape[2:]
        k = np.zeros((self._total, *shape), dtype=np.float32)
        v = np.zeros_like(k)
        for start, length, (ks, vs, _) in found:
            k[start : start + length] = ks[layer_id]
            v[start : start + length] = vs[layer_id]
        return BlendRetrieverResult(k, v, self.valid_mask, self.original_positions)


class CacheBlendRetriever(BlendRetriever):
    """Finds each segment of a prompt in a :class:`ChunkKVStore` by its token ids.

    Segments are looked up as stored alone and, with ``context``, as stored
    after that context (the first found wins).
    """

    def __init__(self, store: ChunkKVStore, context: list[int] | None = None) -> None:
        self.store = store
        self.context = list(context) if context is not None else None

    def new_request(
        self, full_prompts: list[np.ndarray], indices: list[list[int]]
    ) -> CacheBlendRetrieverTask:
        """Segments of prompt *i* start at ``indices[i]`` (the first at 0); each segment
        found in the store is valid.  Prompts are concatenated in batch order."""
        if len(full_prompts) != len(indices):
            raise ValueError("full_prompts and indices differ in length")
        segments: list[tuple[int, int, StoredKV | None]] = []
        offset = 0
        for prompt, starts in zip(full_prompts, indices, strict=True):
            tokens = np.asarray(prompt, dtype=np.int64)
            bounds = sorted(set([0, *starts]))
            if bounds[-1] >= len(tokens) or bounds[0] < 0:
                raise ValueError(f"segment starts {starts} are outside a prompt of {len(tokens)}")
            for start, end in zip(bounds, [*bounds[1:], len(tokens)], strict=True):
                kv = None
                if self.context is not None:
                    kv = self.store.get(self.store.key(tokens[start:end], self.context))
                if kv is None:
                    kv = self.store.get(self.store.key(tokens[start:end]))
                segments.append((offset + start, end - start, kv))
            offset += len(tokens)
        return CacheBlendRetrieverTask(segments, offset)
