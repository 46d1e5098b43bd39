"""The model's tokenizer and chat template, through Hugging Face ``transformers``.

A Hugging Face directory's tokenizer files are loaded as they are; a GGUF
file's tokenizer (``tokenizer.ggml.*`` metadata and its chat template) is
converted by transformers' GGUF converter, or for a SentencePiece vocabulary
tokenized as llama.cpp does (:mod:`maxkv.models.spm`), and the result is kept in the
cache (keyed by the file's path, size and modification time), so later
loads skip the conversion (about 6 s for a 49k vocabulary on two cores).

End-of-sequence ids come from the model's configuration (for GGUF, its
``tokenizer.ggml.eos_token_id``), not from the converted tokenizer, whose
special tokens may differ.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..cachedir import cache_dir
from .config import DecoderConfig, ModelLoadError
from .loading import model_file
from .spm import CONVERTER_VERSION, gguf_sentencepiece_tokenizer

_lock = threading.Lock()


class ChatTokenizer:
    """Text to token ids and back, with the model's chat template.

    Args:
        tokenizer: A ``transformers`` tokenizer.
        config: The model's configuration (vocabulary size, EOS ids).
    """

    def __init__(self, tokenizer: Any, config: DecoderConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_prompt(self, message: str, system: str | None = None) -> str:
        """The prompt text for one user ``message`` (and an optional system message).

        With a chat template: the template applied, ending with the
        assistant's turn (``add_generation_prompt``).  Without one: the
        message itself (a system message is refused).
        """
        if not self.has_chat_template:
            if system is not None:
                raise ValueError("this tokenizer has no chat template for a system message")
            return message
        messages = [{"role": "user", "content": message}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return str(text)

    def encode_chat(self, message: str, system: str | None = None) -> list[int]:
        """Token ids of :meth:`chat_prompt` (the template supplies special tokens)."""
        if self.has_chat_template:
            return self.encode(self.chat_prompt(message, system), add_special_tokens=False)
        return self.encode(self.chat_prompt(message, system))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; a trailing EOS and other special tokens are dropped."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def load_tokenizer(path: str | Path, config: DecoderConfig) -> ChatTokenizer:
    """The tokenizer of the model at ``path`` (as :func:`~maxkv.models.load_model` takes it).

    Raises:
        ModelLoadError: If transformers is not installed, or the model has no
            tokenizer (tokenizer files or GGUF tokenizer metadata).
    """
    try:
        from transformers import AutoTokenizer
    except ImportError:  # pragma: no cover - transformers is a dependency
        raise ModelLoadError("loading a tokenizer needs transformers") from None
    source = model_file(path)
    try:
        if source.is_dir():
            tokenizer = AutoTokenizer.from_pretrained(str(source))
        else:
            tokenizer = _gguf_tokenizer(AutoTokenizer, source)
    except ModelLoadError:
        raise
    except Exception as error:  # transformers raises many kinds
        raise ModelLoadError(f"cannot load a tokenizer for {source}: {error}") from None
    return ChatTokenizer(tokenizer, config)


def _gguf_tokenizer(auto: Any, gguf: Path) -> Any:
    """A GGUF file's tokenizer: a SentencePiece vocabulary (``tokenizer.ggml.model``
    ``llama``) as llama.cpp tokenizes it (:mod:`maxkv.models.spm`), any other as
    transformers converts it; cached either way."""
    stat = gguf.stat()
    # The converter's version is part of the key: a fixed converter is not read
    # from an older cache.
    key = hashlib.sha256(
        f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}".encode()
    )
    cached = cache_dir() / "tokenizers" / key.hexdigest()[:24]
    if (cached / "tokenizer_config.json").is_file():
        return auto.from_pretrained(str(cached))
    from .gguf_file import open_gguf

    fields = open_gguf(gguf).fields
    model = fields.get("tokenizer.ggml.model")
    sentencepiece = model is not None and model.contents() == "llama"
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cached.parent))
    try:
        if sentencepiece:
            tokenizer = gguf_sentencepiece_tokenizer(fields)
        else:
            tokenizer = _from_gguf_without_torch(auto, gguf)
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, cached)
    except OSError:  # another process published it first
        pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def _from_gguf_without_torch(auto: Any, gguf: Path) -> Any:
    """transformers' GGUF tokenizer conversion, also where torch is not installed.

    For a tokenizer transformers reads only the GGUF's metadata (no tensors),
    but ``load_gguf_checkpoint`` refuses to start without torch; maxkv itself
    does not need torch, so the check is lifted for this call only.
    """
    import importlib

    gguf_utils: Any = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    original = gguf_utils.is_torch_available
    with _lock:
        if not original():
            gguf_utils.is_torch_available = lambda: True
        try:
            return auto.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        finally:
            gguf_utils.is_torch_available = original
