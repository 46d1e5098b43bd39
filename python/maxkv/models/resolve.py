"""One way to open a model from what a user types: a known name, ``tiny``, or a path."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..cpu.quantized import HeldMatrix
from .config import DecoderConfig, default_llama
from .fetch import KNOWN_MODELS, fetch
from .held import HeldWeights
from .loading import load_model, model_file
from .tokenizer import ChatTokenizer, load_tokenizer

#: The built-in random model: no download, no tokenizer (token-id prompts only).
TINY = "tiny"
#: What the demo runs when no model is named.
DEFAULT_MODEL = "smollm2-135m"


@dataclass
class LoadedModel:
    """A model ready for :class:`~maxkv.models.DecoderModel`."""

    #: What the user asked for: a known name, ``"tiny"`` or a path.
    spec: str
    config: DecoderConfig
    #: Float32 arrays under Hugging Face names; a GGUF file's are a
    #: :class:`~maxkv.models.held.HeldWeights` (its matrices as the file stores them).
    weights: Mapping[str, np.ndarray]
    #: ``None`` for ``tiny``.
    tokenizer: ChatTokenizer | None
    #: The file or directory loaded (``None`` for ``tiny``).
    path: Path | None
    #: The matrices a GGUF file holds as blocks (``weights.blocks``; empty
    #: otherwise), read when asked for.
    quantized: Mapping[str, HeldMatrix] = field(default_factory=dict)

    @property
    def description(self) -> str:
        c = self.config
        what = "built-in random Llama" if self.path is None else str(self.path)
        return (
            f"{self.spec} ({what}; {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_attention_heads}/{c.num_key_value_heads} heads of {c.head_dim}, "
            f"vocabulary {c.vocab_size})"
        )


def model_path(spec: str | Path, *, progress: bool = True) -> Path | None:
    """The file or directory behind ``spec``, fetching a known model first.

    ``None`` for ``tiny``.

    Raises:
        ModelFetchError: If a known model cannot be fetched.
        ModelLoadError: If a path holds no model.
    """
    text = str(spec)
    if text == TINY:
        return None
    if text in KNOWN_MODELS:
        return fetch(text, progress=progress)
    return model_file(spec)


def open_model(
    spec: str | Path,
    *,
    progress: bool = True,
    on_tensor: Callable[[int, int], None] | None = None,
) -> LoadedModel:
    """Loads weights, configuration and tokenizer of ``spec``.

    Args:
        spec: A name from :data:`~maxkv.models.fetch.KNOWN_MODELS` (fetched
            on first use), ``"tiny"``, a Hugging Face directory, a ``.gguf``
            file or a directory holding one.
        progress: Show fetch progress.
        on_tensor: Passed to :func:`~maxkv.models.load_model` (GGUF progress).

    Raises:
        ModelFetchError: If a known model cannot be fetched.
        ModelLoadError: If the model or its tokenizer cannot be loaded.
    """
    path = model_path(spec, progress=progress)
    if path is None:
        config, tiny = default_llama()
        return LoadedModel(TINY, config, tiny, None, None)
    config, weights = load_model(path, on_tensor)
    tokenizer = load_tokenizer(path, config) if has_tokenizer(path) else None
    quantized = weights.blocks if isinstance(weights, HeldWeights) else {}
    return LoadedModel(str(spec), config, weights, tokenizer, path, quantized)


def has_tokenizer(path: Path) -> bool:
    """Whether the model at ``path`` carries a tokenizer.

    A GGUF file always does (its metadata); a Hugging Face directory does
    when it holds tokenizer files.  Without one, prompts must be token ids.
    """
    if path.is_file():
        return True
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return any((path / name).is_file() for name in names)
