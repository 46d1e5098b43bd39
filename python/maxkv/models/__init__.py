"""Models that run on maxkv: the decoder of every registered family, its loaders
and references.

- :func:`load_model` reads a Hugging Face directory (any family of
  :func:`registered_architectures`: Llama, Mistral, Qwen 2/2.5, Qwen 3,
  Gemma 3) or a Llama GGUF file; :func:`fetch` gets a known model
  (``"smollm2-135m"``) without a hub.
- :class:`DecoderModel` is the compiled decoder over maxkv's cache.
- :class:`Family` and :func:`register_family` add a family (one module).
- :func:`load_tokenizer` gives the model's tokenizer and chat template.

``LlamaConfig``, ``LlamaModel`` and ``load_llama`` are the older names of
:class:`DecoderConfig`, :class:`DecoderModel` and :func:`load_model`.
"""

from . import families  # noqa: F401 (registers the families maxkv ships)
from .config import DecoderConfig, LlamaConfig, ModelLoadError, default_llama
from .decoder import DecoderModel, LlamaModel
from .family import Family
from .fetch import KNOWN_MODELS, ModelFetchError, fetch
from .loading import load_llama, load_model
from .registry import family_for, register_family, registered_architectures
from .rope import ROPE_TYPES, RopeScaling
from .tokenizer import ChatTokenizer, load_tokenizer

__all__ = [
    "KNOWN_MODELS",
    "ROPE_TYPES",
    "ChatTokenizer",
    "DecoderConfig",
    "DecoderModel",
    "Family",
    "LlamaConfig",
    "LlamaModel",
    "ModelFetchError",
    "ModelLoadError",
    "RopeScaling",
    "default_llama",
    "family_for",
    "fetch",
    "load_llama",
    "load_model",
    "load_tokenizer",
    "register_family",
    "registered_architectures",
]
