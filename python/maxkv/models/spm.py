"""A GGUF file's SentencePiece vocabulary as llama.cpp tokenizes it.

GGUF files of SentencePiece models (``tokenizer.ggml.model`` ``llama``: Llama 1
and 2, Mistral, Gemma) carry the vocabulary as pieces with scores and types,
which llama.cpp tokenizes as SentencePiece's BPE does:

1. user-defined pieces (Gemma's runs of spaces, tabs and newlines, HTML tags)
   and control tokens written in the text are taken whole, matched in the raw
   text;
2. in the rest, spaces become ``▁`` (and, with ``add_space_prefix``, one is
   put before each stretch of text);
3. starting from characters, the adjacent pair whose merged piece scores
   highest is merged first, until no pair merges;
4. a character no piece covers becomes its UTF-8 bytes as ``<0xNN>`` pieces.

transformers' GGUF converter misreads some of these files (Gemma 3 270M's
becomes a tokenizer of single characters, without BOS), so maxkv builds the
tokenizer itself (:func:`gguf_sentencepiece_tokenizer`): a ``tokenizers`` BPE
whose merges are ranked by the score of the piece they make (step 3 exactly:
the highest-scoring merge is the lowest rank), with byte fallback (4),
llama.cpp's user-defined and control pieces as added tokens (1), and a
``Metaspace`` pre-tokenizer (2).  The result is a ``transformers``
``PreTrainedTokenizerFast`` (``tokenizer.json``), so MAX's ``max serve`` and
anything else that reads Hugging Face tokenizers takes it as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ModelLoadError

#: GGUF token types (llama.cpp's ``llama_token_type``, SentencePiece's piece types).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(1, 7)
#: SentencePiece's escaped space.
SPACE = "\u2581"
#: Changes whenever the conversion below changes what a vocabulary tokenizes to
#: (cached conversions of another version are not reused).
CONVERTER_VERSION = 3


def bpe_merges(
    vocab: Mapping[str, int], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """Every split of a normal piece of ``vocab`` (piece -> id) into two of its pieces,
    as a BPE merge, ranked by the merged piece's score (highest first; ties by id).

    SentencePiece's BPE merges, among adjacent pairs whose concatenation is a
    piece, the one whose piece scores highest; a BPE that merges the lowest
    rank first does the same with these ranks.
    """
    mergeable = (NORMAL, BYTE)
    ranked: list[tuple[float, int, str, str]] = []
    for piece, i in vocab.items():
        if types[i] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = vocab.get(piece[:cut]), vocab.get(piece[cut:])
            if (
                left is not None
                and right is not None
                and types[left] in mergeable
                and types[right] in mergeable
            ):
                ranked.append((-float(scores[i]), i, piece[:cut], piece[cut:]))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def gguf_sentencepiece_tokenizer(fields: Mapping[str, Any]) -> Any:
    """The ``transformers`` fast tokenizer of a SentencePiece GGUF's metadata.

    BOS (and EOS) added as ``tokenizer.ggml.add_bos_token`` (``add_eos_token``)
    say, llama.cpp's defaults otherwise (BOS yes, EOS no); the file's chat
    template kept.

    Raises:
        ModelLoadError: If the metadata lacks the vocabulary or is inconsistent.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    def get(key: str, default: object = None) -> Any:
        field = fields.get(f"tokenizer.ggml.{key}")
        return default if field is None else field.contents()

    tokens, scores, types = get("tokens"), get("scores"), get("token_type")
    if tokens is None or scores is None or types is None:
        raise ModelLoadError("GGUF tokenizer: tokens, scores or token types are missing")
    if not len(tokens) == len(scores) == len(types):
        raise ModelLoadError(
            f"GGUF tokenizer: {len(tokens)} tokens, {len(scores)} scores, {len(types)} types"
        )
    bad = sorted({int(t) for t in types} - {NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE})
    if bad:
        raise ModelLoadError(f"GGUF tokenizer: unknown token types {bad}")

    def token(key: str) -> str | None:
        index = get(f"{key}_token_id")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise ModelLoadError(f"GGUF tokenizer: {key} token id {index} is not a token")
        return str(tokens[int(index)])

    vocab = {str(piece): i for i, piece in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError("GGUF tokenizer: a piece is listed twice")
    unk = token("unknown")
    model = models.BPE(
        vocab=vocab,
        merges=bpe_merges(vocab, scores, types),
        unk_token=unk,
        byte_fallback=BYTE in types,
        fuse_unk=False,
    )
    tokenizer = Tokenizer(model)
    prefix = bool(get("add_space_prefix", True))
    # llama.cpp puts the space before every stretch of text that starts the input or
    # follows a control or user-defined token: Metaspace's "always" (each stretch
    # between added tokens is one section).
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="always" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    # Matched in the raw text before anything else, as llama.cpp partitions its input.
    tokenizer.add_tokens(
        [
            AddedToken(str(piece), special=int(kind) == CONTROL, normalized=False)
            for piece, kind in zip(tokens, types, strict=True)
            if int(kind) in (CONTROL, USER_DEFINED)
        ]
    )
    bos, eos = token("bos"), token("eos")
    add_bos = bool(get("add_bos_token", True)) and bos is not None
    add_eos = bool(get("add_eos_token", False)) and eos is not None
    parts = [*([bos] if add_bos else []), "$A", *([eos] if add_eos else [])]
    specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(str(p) for p in parts),
        pair=" ".join([*(str(p) for p in parts), *(str(p).replace("$A", "$B") for p in parts)]),
        special_tokens=specials,
    )
    chat_template = fields.get("tokenizer.chat_template")
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=token("padding"),
        chat_template=None if chat_template is None else chat_template.contents(),
        clean_up_tokenization_spaces=False,
    )
