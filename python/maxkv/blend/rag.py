"""RAG prompts over a chunk store, run three ways on one model: full prefill,
prefix-cache reuse and CacheBlend, each followed by the same greedy decode.

Used by ``examples/cacheblend_rag.py`` and the tests.  A prompt is the chat
template's header, the retrieved chunks and the question with the template's
tail, concatenated as token segments: CacheBlend reuses every segment found
in the store; prefix caching can reuse only what a cached prompt shares with
this one's beginning (the header and the first chunk).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from max.driver import Buffer, Device
from max.engine import InferenceSession

from ..cache.contiguous import ContinuousBatchingKVCacheManager
from ..cache.protocol import KVCacheManagerBase
from ..models.decoder import DecoderModel, cache_params
from ..models.resolve import LoadedModel
from .prefill import BlendedPrefill
from .store import CacheBlendRetriever, ChunkKVStore

_MARK = "\ue000"


@dataclass
class RagPrompt:
    """A prompt as token segments: header, one per chunk, then the question."""

    segments: list[list[int]]

    @property
    def tokens(self) -> list[int]:
        return [t for segment in self.segments for t in segment]

    @property
    def starts(self) -> list[int]:
        """Where each segment starts in :attr:`tokens`."""
        starts, position = [], 0
        for segment in self.segments:
            starts.append(position)
            position += len(segment)
        return starts


def build_rag_prompt(model: LoadedModel, chunks: list[str], question: str) -> RagPrompt:
    """Header + ``chunk + "\\n\\n"`` per chunk + ``"Question: ..."`` + the template's tail."""
    if model.tokenizer is None:
        raise ValueError("RAG prompts need a model with a tokenizer")
    tok = model.tokenizer
    header, tail = tok.chat_prompt(_MARK).split(_MARK)
    segments = [tok.encode(header, add_special_tokens=False)]
    segments += [tok.encode(chunk + "\n\n", add_special_tokens=False) for chunk in chunks]
    segments.append(
        tok.encode(
            f"Answer the question using the text above.\nQuestion: {question}{tail}",
            add_special_tokens=False,
        )
    )
    return RagPrompt(segments)


@dataclass
class RunResult:
    """One way of answering one prompt."""

    ttft_s: float
    tokens: list[int]
    reused_tokens: int = 0


class RagRunner:
    """Full prefill, prefix reuse and CacheBlend over one model and session.

    Args:
        model: The model (SmolLM2 in the example).
        session: The CPU session.
        device: The CPU device.
        max_seq_len: Longest prompt plus answer.
        prefix_slots: Slots of the prefix-caching manager (released prompts
            are kept there until their slot is reused).
        store_dir: Where the chunk store keeps chunks across runs (optional).
        chunk_context: Store each chunk's KV computed after the prompt header
            (the chat template's system part) instead of alone.
    """

    def __init__(
        self,
        model: LoadedModel,
        session: InferenceSession,
        device: Device,
        *,
        max_seq_len: int = 2048,
        prefix_slots: int = 16,
        store_dir: str | None = None,
        chunk_context: bool = True,
    ) -> None:
        c = model.config
        self.model = model
        self.device = device
        params = cache_params(c)
        self.manager = ContinuousBatchingKVCacheManager(
            params, 2, max_seq_len, c.num_hidden_layers, [device], session
        )
        self.prefix_manager = ContinuousBatchingKVCacheManager(
            params,
            prefix_slots,
            max_seq_len,
            c.num_hidden_layers,
            [device],
            session,
            enable_prefix_caching=True,
            prefix_block_size=16,
        )
        self.prefix_manager.warm_up()
        self.decoder = DecoderModel(
            c, model.weights, self.manager, session, quantized=model.quantized
        )
        self.prefill = BlendedPrefill(c, model.weights, session, device)
        self.store = ChunkKVStore(self.prefill, store_dir)
        self.chunk_context = chunk_context
        self.retriever = CacheBlendRetriever(self.store)
        self.eos = set(c.eos_token_ids)

    # ------------------------------------------------------------ set-up

    def store_segments(self, prompt: RagPrompt) -> None:
        """Keeps the KV of every segment but the question (header and chunks)."""
        header = prompt.segments[0]
        self.store.store(header)
        for segment in prompt.segments[1:-1]:
            self.store.store(segment, header if self.chunk_context else None)
        if self.chunk_context:
            self.retriever.context = list(header)

    def seed_prefix_cache(self, prompt: RagPrompt) -> None:
        """Runs header + first chunk through the prefix-caching manager, as an
        earlier request starting with that chunk would have."""
        tokens = [t for segment in prompt.segments[:2] for t in segment]
        seq, cached = self.prefix_manager.claim_prefix(tokens)
        self._prefill(self.prefix_manager, seq, tokens[cached:], record=True)
        self.prefix_manager.release(seq)

    # ------------------------------------------------------------ the three ways

    def full(self, prompt: RagPrompt, max_new_tokens: int) -> RunResult:
        """Prefill every token, then decode."""
        (seq,) = self.manager.claim(1)
        try:
            start = time.perf_counter()
            first = self._prefill(self.manager, seq, prompt.tokens)
            ttft = time.perf_counter() - start
            return RunResult(ttft, self._decode(self.manager, seq, first, max_new_tokens))
        finally:
            self.manager.release(seq)

    def prefix(self, prompt: RagPrompt, max_new_tokens: int) -> RunResult:
        """Reuse the longest cached prefix (prefix caching), prefill the rest, decode."""
        tokens = prompt.tokens
        start = time.perf_counter()
        seq, cached = self.prefix_manager.claim_prefix(tokens)
        try:
            first = self._prefill(self.prefix_manager, seq, tokens[cached:], record=True)
            ttft = time.perf_counter() - start
            out = self._decode(self.prefix_manager, seq, first, max_new_tokens, record=True)
            return RunResult(ttft, out, cached)
        finally:
            self.prefix_manager.release(seq)

    def blend(
        self,
        prompt: RagPrompt,
        max_new_tokens: int,
        recompute_ratio: float = 0.15,
        check_layers: tuple[int, ...] = (1,),
    ) -> RunResult:
        """CacheBlend: retrieve every stored segment, recompute the selected tokens, decode."""
        tokens = np.array(prompt.tokens, dtype=np.int64)
        executor = self.prefill.executor(recompute_ratio, check_layers)
        (seq,) = self.manager.claim(1)
        try:
            start = time.perf_counter()
            task = self.retriever.new_request([tokens], [prompt.starts])
            logits = self.prefill.prefill(tokens, task, executor, self.manager, seq)
            first = int(np.argmax(logits))
            ttft = time.perf_counter() - start
            reused = int(task.valid_mask.sum())
            out = self._decode(self.manager, seq, first, max_new_tokens)
            return RunResult(ttft, out, reused)
        finally:
            self.manager.release(seq)

    # ------------------------------------------------------------ helpers

    def _prefill(
        self, manager: KVCacheManagerBase, seq: int, tokens: list[int], *, record: bool = False
    ) -> int:
        """Runs ``tokens`` through the model into ``seq``; returns the greedy next token."""
        (inputs,) = manager.fetch([seq], active_lengths=[len(tokens)])
        ids = np.array(tokens, dtype=np.int64)
        offsets = np.array([0, len(tokens)], dtype=np.uint32)
        out = self.decoder.execute(Buffer.from_numpy(ids), Buffer.from_numpy(offsets), inputs)
        first = int(out.to_numpy()[0])
        manager.step({seq: len(tokens)}, tokens={seq: list(tokens)} if record else None)
        return first

    def _decode(
        self,
        manager: KVCacheManagerBase,
        seq: int,
        first: int,
        max_new_tokens: int,
        *,
        record: bool = False,
    ) -> list[int]:
        out = [first]
        while len(out) < max_new_tokens and out[-1] not in self.eos:
            out.append(self._prefill(manager, seq, [out[-1]], record=record))
        return out
