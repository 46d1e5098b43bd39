"""LMCache's CacheBlend interfaces (seed 003) with NumPy arrays instead of torch tensors.

Same classes, fields, methods and meanings as ``lmcache.blend.interfaces``:
a :class:`BlendRetriever` starts a :class:`BlendRetrieverTask` for a batch of
prompts split into segments; the task hands out, layer by layer, the
retrieved K/V of every prompt token (:class:`BlendRetrieverResult`); a
:class:`BlendExecutor` blends them with the freshly computed K/V of a layer
and returns the short Q of the tokens still computed plus the long blended
K/V (:class:`BlendOutput`).

Shapes (``token_dim`` = 0): K/V are ``[tokens, n_kv_heads, head_dim]``, Q is
``[tokens, n_heads, head_dim]``, positions are int64 ``[tokens]``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np


@dataclass
class BlendOutput:
    """What :meth:`BlendExecutor.blend` returns.

    Attributes:
        q: The short Q with the selected tokens.
        k: The long K with the updated values.
        v: The long V with the updated values.
        positions: Positions in the input sequence of the selected Q tokens.
        local_indices: Positions of the selected Q tokens in ``fresh_q``.
        query_start_loc: The modified ``query_start_loc`` if token selection
            happened, else ``None``.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray
    local_indices: np.ndarray
    query_start_loc: np.ndarray | None


@dataclass
class BlendRetrieverResult:
    """One layer's retrieved K/V.

    Attributes:
        k: The K of a single layer; ``None`` if nothing was retrieved.
        v: The V of a single layer; ``None`` if nothing was retrieved.
        valid_mask: bool ``[tokens]`` (host): whether a token's K/V was retrieved.
        original_positions: int64 ``[tokens]``: each retrieved token's position
            when its K/V was computed (0 where not valid).
    """

    k: np.ndarray | None
    v: np.ndarray | None
    valid_mask: np.ndarray
    original_positions: np.ndarray


class BlendRetrieverTask(metaclass=abc.ABCMeta):
    """The KV retrieval task created by a :class:`BlendRetriever`."""

    @abc.abstractmethod
    def result(self, layer_id: int) -> BlendRetrieverResult:
        """Blocks until one layer's K and V are ready and returns them.

        K and V match the length of the tokens given to
        :meth:`BlendRetriever.new_request`; where a token's K/V is not
        available, ``valid_mask`` is False and its K/V rows are undefined.
        """


class BlendRetriever(metaclass=abc.ABCMeta):
    """Retrieves the KV caches of the segments of new prompts."""

    @abc.abstractmethod
    def new_request(
        self, full_prompts: list[np.ndarray], indices: list[list[int]]
    ) -> BlendRetrieverTask:
        """Starts retrieving the KV of each prompt's segments.

        Args:
            full_prompts: The token ids of each prompt in the batch.
            indices: Per prompt, where its segments start in it.
        """


class BlendExecutor(metaclass=abc.ABCMeta):
    """Blends retrieved KV with fresh KV, layer by layer."""

    @abc.abstractmethod
    def blend(
        self,
        layer_id: int,
        retrieved_k: np.ndarray | None,
        retrieved_v: np.ndarray | None,
        valid_mask: np.ndarray,
        original_positions: np.ndarray,
        fresh_q: np.ndarray,
        fresh_k: np.ndarray,
        fresh_v: np.ndarray,
        positions: np.ndarray,
        query_start_loc: np.ndarray,
        token_dim: int,
    ) -> BlendOutput:
        """Blends one layer: returns the short Q, the long blended K/V and positions.

        Args:
            layer_id: The layer.
            retrieved_k: Retrieved K of every prompt token (``None``: nothing).
            retrieved_v: Retrieved V.
            valid_mask: Which retrieved rows are valid (host).
            original_positions: Positions the retrieved K was rotated at.
            fresh_q: Q of the tokens computed at this layer.
            fresh_k: K of those tokens (rotated at ``positions``).
            fresh_v: V of those tokens.
            positions: Positions in the input of the tokens of ``fresh_q``.
            query_start_loc: Where each request's tokens start in ``fresh_q``
                (``[batch + 1]``).
            token_dim: The token axis of the tensors (0 here).
        """
