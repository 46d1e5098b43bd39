"""Random-weight checkpoints of real model shapes, for the family benchmarks.

    python benchmarks/family_models.py DIR [--models qwen2.5-0.5b,qwen3-0.6b,...]

Writes ``DIR/<name>``: transformers' own ``from_config`` initialization of the
published configuration (shapes, RoPE, windows, tied embeddings) in float32
safetensors, with SmolLM2's tokenizer and chat template (fetched without a hub)
whose vocabulary is padded with unreachable tokens to the model's size, so that
every id the model emits decodes and every server tokenizes the same texts.
No hub is reached: the weights are random, the shapes and the work are real.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Published configurations (the fields that shape the work), by name.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": (
        "llama",
        dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=131072, tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            rope_theta=500000.0, rms_norm_eps=1e-5,
        ),
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        dict(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
            tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        ),
    ),
    "qwen3-0.6b": (
        "qwen3",
        dict(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1000000.0,
            rms_norm_eps=1e-6,
        ),
    ),
    "gemma-3-1b": (
        "gemma3_text",
        dict(
            vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256,
            max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
            rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6,
            rms_norm_eps=1e-6, tie_word_embeddings=True,
        ),
    ),
    # Mistral 7B v0.1's shape: every layer slides (4096 tokens).  For the cache's
    # byte counts only (benchmarks/sliding_window.py): 28 GB of float32 weights.
    "mistral-7b-v0.1": (
        "mistral",
        dict(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=32768, sliding_window=4096, rope_theta=10000.0,
            rms_norm_eps=1e-5,
        ),
    ),
    # A small Mistral-architecture model with a 512-token window, for max serve on
    # long chats on this CPU (benchmarks/sliding_window.py serve).
    "mistral-tiny-w512": (
        "mistral",
        dict(
            vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=32768, sliding_window=512, rope_theta=10000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=True,
        ),
    ),
}  # fmt: skip


def padded_tokenizer(source: Path, directory: Path, vocab_size: int) -> None:
    """SmolLM2's tokenizer files from ``source`` into ``directory``, the BPE
    vocabulary padded with ``<|unused_i|>``-like tokens (no merge reaches them)."""
    for name in (
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "chat_template.jinja",
    ):
        if (source / name).exists():
            (directory / name).write_text((source / name).read_text())
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    added = {t["id"] for t in tokenizer.get("added_tokens", [])}
    used = set(vocab.values()) | added
    for i in range(vocab_size):
        if i not in used:
            vocab[f"\u2400pad{i}"] = i
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))


def make(name: str, directory: Path, smollm2: Path, seed: int = 0) -> Path:
    """Writes the random checkpoint ``name`` of :data:`SHAPES` to ``directory``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = SHAPES[name]
    special = json.loads((smollm2 / "config.json").read_text())
    config = AutoConfig.for_model(
        model_type,
        **fields,
        bos_token_id=special.get("bos_token_id"),
        eos_token_id=special.get("eos_token_id"),
        pad_token_id=special.get("pad_token_id"),
        initializer_range=0.05,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(directory, safe_serialization=True)
    padded_tokenizer(smollm2, directory, int(fields["vocab_size"]))
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", default=",".join(SHAPES))
    args = parser.parse_args(argv)
    smollm2 = Path(tempfile.mkdtemp(prefix="smollm2_"))
    subprocess.run(
        [sys.executable, "-m", "maxkv.models", "export", "smollm2-135m", str(smollm2)], check=True
    )
    for name in args.models.split(","):
        print(make(name, args.out / name, smollm2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
