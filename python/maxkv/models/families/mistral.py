"""Mistral: a Llama whose layers may attend to a sliding window (``sliding_window``)."""

from typing import Any

from ..config import DecoderConfig
from ..family import Family, decoder_config, layer_windows


def read(hf: Any) -> DecoderConfig:
    return decoder_config(hf, "mistral", layer_windows=layer_windows(hf, "mistral"))


# No GGUF layout: llama.cpp writes Mistral checkpoints as "llama" files (without
# their sliding window), which llama.cpp and transformers then read as Llamas.
FAMILY = Family("mistral", ("MistralForCausalLM",), read)
