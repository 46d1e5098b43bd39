"""Models that run on maxkv: a Llama-style decoder, its loaders and references.

- :func:`load_llama` reads a Hugging Face directory or a GGUF file;
  :func:`fetch` gets a known model (``"smollm2-135m"``) without a hub.
- :class:`LlamaModel` is the compiled decoder over maxkv's cache.
- :func:`load_tokenizer` gives the model's tokenizer and chat template.
"""

from .config import LlamaConfig, ModelLoadError, default_llama
from .fetch import KNOWN_MODELS, ModelFetchError, fetch
from .llama import LlamaModel
from .loading import load_llama
from .tokenizer import ChatTokenizer, load_tokenizer

__all__ = [
    "KNOWN_MODELS",
    "ChatTokenizer",
    "LlamaConfig",
    "LlamaModel",
    "ModelFetchError",
    "ModelLoadError",
    "default_llama",
    "fetch",
    "load_llama",
    "load_tokenizer",
]
