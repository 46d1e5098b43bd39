"""Small random-weight checkpoints of every family maxkv serves, made by transformers.

Each is ``AutoModelForCausalLM.from_config(config)`` with a large
``initializer_range`` (peaked logits: greedy decoding has no near-ties) and
``save_pretrained``, so the checkpoint is exactly what transformers writes for
the family (its ``config.json`` keys, weight names, tied embeddings).
Sliding-window families get windows of 128 tokens (maxkv's smallest) and the
tests prompts longer than that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Shared shapes: 2 layers, hidden 64, 4 query heads over 2 KV heads.
BASE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.15,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
)

WINDOW = 128

#: Family -> (transformers model_type, config fields over BASE).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral": ("mistral", dict(head_dim=16, sliding_window=WINDOW)),
    "gemma3": (
        "gemma3_text",
        dict(
            head_dim=32,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            hidden_activation="gelu_pytorch_tanh",
            initializer_range=0.3,
        ),
    ),
}

#: Families with a sliding window somewhere.
SLIDING = ("mistral", "gemma3")
#: Families whose every layer slides (the paged cache gives pages back).
ALL_SLIDING = ("mistral",)
#: Families with sliding and full-attention layers (a hybrid cache).
HYBRID = ("gemma3",)


def hf_family_config(family: str, **overrides: Any) -> Any:
    """transformers' config of ``family``'s small checkpoint."""
    from transformers import AutoConfig

    model_type, fields = FAMILIES[family]
    return AutoConfig.for_model(model_type, **(BASE | fields | overrides))


def save_family_checkpoint(directory: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """Writes ``family``'s random checkpoint (float32 safetensors) to ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_family_config(family, **overrides))
    model.to(torch.float32).eval().save_pretrained(directory, safe_serialization=True)
    return directory
