"""A tiny Llama directory for MAX's pipelines, built offline.

``config.json`` + ``model.safetensors`` (transformers' own random
``LlamaForCausalLM``, saved by ``save_pretrained``) and a real ``tokenizers``
byte-level BPE tokenizer over printable ASCII, so every generated token
decodes to exact, comparable text.  Token 0 is ``</s>`` (EOS), 1 is ``<s>``.
"""

from __future__ import annotations

from pathlib import Path


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what ``tokenizers``' ByteLevel uses)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def make_tiny_llama_dir(directory: Path, *, seed: int = 0, layers: int = 2) -> dict[str, int]:
    """Writes the directory; returns its vocabulary size and EOS/BOS ids.

    Needs torch and transformers (the weights are transformers' own init).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    b2u = _byte_to_unicode()
    vocab = {"</s>": 0, "<s>": 1}
    for byte in range(32, 127):  # printable ASCII, space included
        vocab[b2u[byte]] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", bos_token="<s>")
    fast.save_pretrained(str(directory))

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).eval().save_pretrained(directory, safe_serialization=True)
    return {"vocab_size": len(vocab), "eos": 0, "bos": 1}
