"""Hugging Face ``transformers`` as an independent reference (needs torch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .config import DecoderConfig


def transformers_available() -> bool:
    """Whether ``torch`` and ``transformers`` import."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_llama(config: DecoderConfig, weights: Mapping[str, np.ndarray]) -> object:
    """A ``transformers.LlamaForCausalLM`` holding ``weights`` (float32, CPU, eval)."""
    import torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    fields: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        eos_token_id=list(config.eos_token_ids) or None,
    )
    hf_config = HFLlamaConfig(**fields)
    model = LlamaForCausalLM(hf_config)  # type: ignore[no-untyped-call]
    state = {
        name: torch.from_numpy(np.asarray(array, np.float32)) for name, array in weights.items()
    }
    model.load_state_dict(state, strict=False)
    return model.eval()  # type: ignore[no-untyped-call]


def hf_generate(
    model: object,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    """Greedy ``generate(do_sample=False)``, one prompt at a time (no padding).

    Generation stops after one of ``eos_token_ids`` (kept in the output, as
    maxkv's scheduler keeps it) or after ``max_new_tokens``; with no EOS ids
    it always runs ``max_new_tokens``.
    """
    import torch

    outputs = []
    eos = list(eos_token_ids)
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            out = model.generate(  # type: ignore[attr-defined]
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=eos[0] if eos else 0,
                eos_token_id=eos or None,
            )
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def hf_from_pretrained(path: str | Path) -> object:
    """transformers' own loader, float32 on the CPU: a Hugging Face directory or a GGUF file.

    For a GGUF file (or a directory holding one) this is transformers' GGUF
    loader (``from_pretrained(dir, gguf_file=name)``), which dequantizes and
    un-permutes on its own: an independent reference for maxkv's loader.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from .loading import model_file

    source = model_file(path)
    if source.is_file():
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    return model.eval()  # type: ignore[no-untyped-call]
