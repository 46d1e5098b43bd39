"""The model families maxkv ships, one module each, registered by Hugging Face
architecture name (:func:`maxkv.models.registry.register_family`).

A new family is a module here and one line below.
"""

from ..registry import register_family
from . import gemma3, llama, mistral, qwen2, qwen3

for _module in (llama, mistral, qwen2, qwen3, gemma3):
    register_family(_module.FAMILY)
