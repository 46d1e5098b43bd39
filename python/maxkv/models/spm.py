"""A GGUF file's SentencePiece vocabulary as llama.cpp tokenizes it.

GGUF files of SentencePiece models (``tokenizer.ggml.model`` ``llama``: Llama 1
and 2, Mistral, Gemma) carry the vocabulary as pieces with scores and types,
which llama.cpp tokenizes as SentencePiece's BPE does: spaces escaped to
``▁`` (a leading one only with ``add_space_prefix``), user-defined pieces
matched whole, then the adjacent pair whose merged piece scores highest merged
first, bytes of what no piece covers as ``<0xNN>`` pieces.  transformers' GGUF
converter misreads some of these files (Gemma 3 270M's becomes a tokenizer of
single characters, without BOS), so maxkv writes the vocabulary back as a
SentencePiece model (:func:`sentencepiece_model`) and tokenizes with
``sentencepiece`` itself (:class:`SentencePieceTokenizer`).
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

#: GGUF token types (llama.cpp's ``llama_token_type``) are SentencePiece's piece
#: types: 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte.
_PIECE_TYPES = range(1, 7)
_USER_DEFINED = 4
#: Changes whenever the conversion below changes what a vocabulary tokenizes to
#: (cached conversions of another version are not reused).
CONVERTER_VERSION = 2
#: SentencePiece's escaped space (``escape_whitespaces``).
_SPACE = "\u2581"
_BPE = 2  # TrainerSpec.ModelType


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32s take ten bytes, as protobuf writes them
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _int(field: int, value: int) -> bytes:
    return _key(field, 0) + _varint(int(value))


def _bytes(field: int, value: bytes) -> bytes:
    return _key(field, 2) + _varint(len(value)) + value


def sentencepiece_model(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    unk_id: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    add_space_prefix: bool,
) -> bytes:
    """A serialized SentencePiece ``ModelProto`` (BPE) of a GGUF vocabulary.

    Written field by field in protobuf's wire format (``sentencepiece_model.proto``:
    ``pieces`` 1 {``piece`` 1, ``score`` 2, ``type`` 3}, ``trainer_spec`` 2,
    ``normalizer_spec`` 3), so no protobuf runtime is needed.

    Raises:
        ModelLoadError: If the lists differ in length or a token type is unknown.
    """
    if not len(tokens) == len(scores) == len(types):
        raise ModelLoadError(
            f"GGUF tokenizer: {len(tokens)} tokens, {len(scores)} scores, {len(types)} types"
        )
    bad = sorted({int(t) for t in types} - set(_PIECE_TYPES))
    if bad:
        raise ModelLoadError(f"GGUF tokenizer: unknown token types {bad}")
    out = bytearray()
    for piece, score, kind in zip(tokens, scores, types, strict=True):
        if kind == _USER_DEFINED:
            # llama.cpp matches user-defined pieces (Gemma's runs of spaces) in the raw
            # text; SentencePiece matches them after escaping spaces, so store them so.
            piece = piece.replace(" ", _SPACE)
        body = (
            _bytes(1, piece.encode())
            + _key(2, 5)
            + struct.pack("<f", float(score))
            + _int(3, int(kind))
        )
        out += _bytes(1, body)
    trainer = (
        _int(3, _BPE)
        + _int(4, len(tokens))
        + _int(35, 6 in types)  # byte_fallback: <0xNN> pieces for what no piece covers
        + _int(40, unk_id)
        + _int(41, bos_id)
        + _int(42, eos_id)
        + _int(43, pad_id)
    )
    out += _bytes(2, trainer)
    normalizer = (
        _bytes(1, b"identity")
        + _int(3, add_space_prefix)
        + _int(4, False)  # remove_extra_whitespaces
        + _int(5, True)  # escape_whitespaces: " " -> "▁"
    )
    out += _bytes(3, normalizer)
    return bytes(out)


#: The file :class:`SentencePieceTokenizer` keeps its settings in.
SETTINGS = "maxkv_spm.json"
MODEL = "tokenizer.model"


def write_gguf_sentencepiece(fields: Mapping[str, Any], directory: Path) -> None:
    """Writes a SentencePiece GGUF's tokenizer to ``directory`` (``tokenizer.model``,
    its settings, and a ``tokenizer_config.json``).

    Raises:
        ModelLoadError: If the metadata lacks the vocabulary or is inconsistent.
    """

    def get(key: str, default: object = None) -> Any:
        field = fields.get(f"tokenizer.ggml.{key}")
        return default if field is None else field.contents()

    tokens, scores, types = get("tokens"), get("scores"), get("token_type")
    if tokens is None or scores is None or types is None:
        raise ModelLoadError("GGUF tokenizer: tokens, scores or token types are missing")
    settings = {
        "bos_token_id": get("bos_token_id"),
        "eos_token_id": get("eos_token_id"),
        # llama.cpp's defaults for a SentencePiece vocabulary
        "add_bos_token": bool(get("add_bos_token", True)),
        "add_eos_token": bool(get("add_eos_token", False)),
        "chat_template": fields["tokenizer.chat_template"].contents()
        if "tokenizer.chat_template" in fields
        else None,
    }
    ids = {name: get(f"{name}_token_id") for name in ("unknown", "bos", "eos", "padding")}
    model = sentencepiece_model(
        tokens,
        scores,
        types,
        unk_id=-1 if ids["unknown"] is None else int(ids["unknown"]),
        bos_id=-1 if ids["bos"] is None else int(ids["bos"]),
        eos_id=-1 if ids["eos"] is None else int(ids["eos"]),
        pad_id=-1 if ids["padding"] is None else int(ids["padding"]),
        add_space_prefix=bool(get("add_space_prefix", True)),
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MODEL).write_bytes(model)
    (directory / SETTINGS).write_text(json.dumps(settings))


class SentencePieceTokenizer:
    """The part of a transformers tokenizer maxkv uses, over ``sentencepiece``.

    Args:
        directory: Where :func:`write_gguf_sentencepiece` wrote the tokenizer.
    """

    def __init__(self, directory: Path) -> None:
        import sentencepiece

        self.directory = Path(directory)
        self.processor = sentencepiece.SentencePieceProcessor(
            model_file=str(self.directory / MODEL)
        )
        settings = json.loads((self.directory / SETTINGS).read_text())
        # Control tokens written in the text (a chat template's turn markers) are
        # those tokens, as llama.cpp parses special tokens and transformers splits them.
        controls = sorted(
            (
                self.processor.id_to_piece(i)
                for i in range(self.processor.get_piece_size())
                if self.processor.is_control(i)
            ),
            key=len,
            reverse=True,
        )
        self._control_ids = {piece: self.processor.piece_to_id(piece) for piece in controls}
        self._controls = re.compile("|".join(re.escape(p) for p in controls)) if controls else None
        self.bos_token_id: int | None = settings["bos_token_id"]
        self.eos_token_id: int | None = settings["eos_token_id"]
        self.add_bos_token: bool = settings["add_bos_token"]
        self.add_eos_token: bool = settings["add_eos_token"]
        self.chat_template: str | None = settings["chat_template"]

    def __len__(self) -> int:
        return int(self.processor.get_piece_size())

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids: list[int] = []
        start = 0
        for match in self._controls.finditer(text) if self._controls else ():
            ids += self.processor.encode(text[start : match.start()])
            ids.append(self._control_ids[match.group()])
            start = match.end()
        ids += self.processor.encode(text[start:])
        ids = [int(i) for i in ids]
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return {"input_ids": ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; control tokens (BOS, EOS, turn markers) shown unless skipped."""
        pieces: list[str] = []
        run: list[int] = []
        for i in ids:
            if self.processor.is_control(int(i)):
                if run:
                    pieces.append(self.processor.decode(run))
                    run = []
                if not skip_special_tokens:
                    pieces.append(self.processor.id_to_piece(int(i)))
            else:
                run.append(int(i))
        if run:
            pieces.append(self.processor.decode(run))
        return "".join(pieces)

    def convert_ids_to_tokens(self, i: int) -> str:
        return str(self.processor.id_to_piece(int(i)))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool = False
    ) -> str:
        """The chat template (from the GGUF file) rendered as transformers renders it."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if tokenize:
            raise ValueError("render, then encode")
        from transformers.utils.chat_template_utils import render_jinja_template

        result: Any = render_jinja_template(
            conversations=[messages],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.convert_ids_to_tokens(self.bos_token_id or 0),
            eos_token=self.convert_ids_to_tokens(self.eos_token_id or 0),
        )
        rendered, _ = result
        return str(rendered[0])

    def save_pretrained(self, directory: str) -> None:
        """Writes ``tokenizer.model`` and a ``tokenizer_config.json`` (a Hugging Face
        SentencePiece tokenizer directory)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.directory / MODEL, out / MODEL)
        shutil.copy(self.directory / SETTINGS, out / SETTINGS)
        config = {
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "bos_token": self.convert_ids_to_tokens(self.bos_token_id or 0),
            "eos_token": self.convert_ids_to_tokens(self.eos_token_id or 0),
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
