"""An independent NumPy reference for maxkv's Llama: greedy decoding by full recompute."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .config import DecoderConfig


def greedy_reference(
    config: DecoderConfig,
    weights: Mapping[str, np.ndarray],
    prompt: Sequence[int],
    max_new_tokens: int,
) -> list[int]:
    """Greedy generation by a NumPy forward pass over the whole sequence, no cache.

    Independent of maxkv's graph and kernels: written from the Llama
    definition, in float64, recomputing every position for every token.
    """
    _check_plain_llama(config)
    w = {name: np.asarray(array, dtype=np.float64) for name, array in weights.items()}
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(np.argmax(_last_logits(config, w, tokens)))
        out.append(token)
        tokens.append(token)
        if token in config.eos_token_ids:
            break
    return out


def _check_plain_llama(config: DecoderConfig) -> None:
    """Refuses configurations this Llama-only reference does not compute."""
    if not config.is_plain_llama():
        raise ValueError(
            f"the NumPy reference computes a plain Llama; this {config.family} model needs "
            "transformers (maxkv.models.hf)"
        )


def logits_reference(
    config: DecoderConfig, weights: Mapping[str, np.ndarray], tokens: Sequence[int]
) -> np.ndarray:
    """float64 logits ``[vocab]`` of the last of ``tokens`` (the forward pass of
    :func:`greedy_reference`)."""
    _check_plain_llama(config)
    w = {name: np.asarray(array, dtype=np.float64) for name, array in weights.items()}
    return _last_logits(config, w, list(tokens))


def _last_logits(
    config: DecoderConfig, w: Mapping[str, np.ndarray], tokens: list[int]
) -> np.ndarray:
    d, n_heads, n_kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    inv_freq = config.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)

    def norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        normed: np.ndarray = x / np.sqrt((x * x).mean(-1, keepdims=True) + config.rms_norm_eps)
        scaled: np.ndarray = normed * weight
        return scaled

    def rope(x: np.ndarray) -> np.ndarray:  # [seq, heads, d], half-split (HF Llama)
        angles = np.arange(x.shape[0])[:, None] * inv_freq[None, :]
        cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]
        sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]
        rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        rotated_x: np.ndarray = x * cos + rotated * sin
        return rotated_x

    seq = len(tokens)
    h = w["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((seq, seq), -np.inf), 1)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).reshape(seq, n_heads, d))
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).reshape(seq, n_kv, d))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(seq, n_kv, d)
        k = np.repeat(k, n_heads // n_kv, axis=1)
        v = np.repeat(v, n_heads // n_kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(seq, n_heads * d)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        act = gate / (1.0 + np.exp(-gate)) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = h + act @ w[p + "mlp.down_proj.weight"].T
    last = norm(h[-1], w["model.norm.weight"])
    head = w["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    logits: np.ndarray = head @ last
    return logits
