"""What ``max serve``'s OpenAI routes accept when maxkv serves the model.

Every request a worker could not serve is answered with HTTP 400 and a
message that says why, in the API server, before it reaches the model
worker (where an exception takes the whole server down, and MAX 26.7 lets
several through):

- at parsing (:func:`refuse_unsupported_requests` wraps the routes' body
  parser, ``max.serve.router.openai_routes._parse_openai_request_body``;
  the routes turn its :class:`~max.pipelines.context.exceptions.InputError`
  into a 400): bodies nested too deeply for Python's JSON parser and uploads
  the client abandoned (MAX answers 500); ``n > 1`` / ``best_of > 1``
  (MAX's routes accept them and return one choice; maxkv's pipeline produces
  one sequence per request, so it refuses instead of silently answering
  once); a completion with no prompt (``"prompt": []``), or streamed with
  several prompts (MAX answers 500): :func:`check_request`;
- as a request becomes a context (:class:`MaxkvTextTokenizer`, the tokenizer
  of maxkv's architecture): prompts with no token, or with token ids that
  are not ids of the model's vocabulary (negative, or past its embedding
  table: the worker's gather fails and the server goes down);
  ``stop_token_ids`` outside the vocabulary and integers the worker queue
  cannot carry (outside int64: MAX answers 500); ``echo`` with ``logprobs``
  (log probabilities of the prompt's tokens, which maxkv's graph does not
  compute; MAX's worker raises and the server goes down):
  :func:`check_sampling`; with CacheBlend (``MAXKV_BLEND=1``), a prompt
  whose chunk between two separators is empty or that ends with the
  separator (:func:`~maxkv.serving.pipelines.blending.split_prompt`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from max.pipelines.context.exceptions import InputError
from max.pipelines.lib import TextTokenizer
from max.pipelines.lib.tokenizer import PromptTooLongError, run_with_default_executor
from starlette.requests import ClientDisconnect

from ... import seams
from .blending import (
    BlendConfig,
    blend_starts_var,
    piece_starts,
    split_prompt,
    with_blend_starts,
)

#: Request fields whose value must be at most 1.
SINGLE_CHOICE_FIELDS = ("n", "best_of")


#: What a request's integers must fit: the worker queue carries int64.
INT64 = (-(2**63), 2**63 - 1)


def check_request(request: Any) -> None:
    """Raises ``InputError`` for a parsed OpenAI request maxkv cannot serve: more than
    one choice, an empty prompt list, a stream of several prompts."""
    for name in SINGLE_CHOICE_FIELDS:
        value = getattr(request, name, None)
        if value is not None and value > 1:
            raise InputError(
                f"`{name}`={value}: maxkv serves one completion per request; send the "
                f"request {value} times (with different seeds to sample different ones)"
            )
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, list):
        if not prompt:
            raise InputError("`prompt` is an empty list: give a string or token ids")
        for i, item in enumerate(prompt):
            if isinstance(item, list) and not item:
                raise InputError(f"prompt {i} is an empty list of token ids")
        several = not all(isinstance(p, int) for p in prompt) and len(prompt) > 1
        if several and getattr(request, "stream", False):
            raise InputError(
                f"`stream` with {len(prompt)} prompts: streamed completions take one prompt"
            )


def check_sampling(params: Any, vocab_size: int) -> None:
    """Raises ``InputError`` unless every integer of ``params`` (MAX's
    ``SamplingParams``) fits int64 and every ``stop_token_ids`` entry is an id
    of the vocabulary."""
    for name, value in vars(params).items():
        values = value if isinstance(value, list | tuple) else [value]
        for item in values:
            if isinstance(item, int) and not isinstance(item, bool):
                if not INT64[0] <= item <= INT64[1]:
                    raise InputError(f"`{name}` holds {item}, outside the 64-bit integers")
    stop = getattr(params, "stop_token_ids", None) or []
    for token in stop:
        if not 0 <= token < vocab_size:
            raise InputError(
                f"`stop_token_ids` holds {token}, outside the model's vocabulary [0, {vocab_size})"
            )


def check_token_ids(ids: Sequence[Any] | np.ndarray, vocab_size: int) -> None:
    """Raises ``InputError`` unless every id is an ``int`` in ``[0, vocab_size)``.

    The model gathers its embedding row by row: an id outside the table
    would fail inside the worker (taking the server down) or read another
    row's memory.
    """
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            raise InputError(f"prompt token {position} is {token!r}, not a token id")
        if not 0 <= int(token) < vocab_size:
            raise InputError(
                f"prompt token {position} is {int(token)}, outside the model's vocabulary "
                f"[0, {vocab_size})"
            )


class MaxkvTextTokenizer(TextTokenizer):
    """MAX's ``TextTokenizer`` that refuses (``InputError``, HTTP 400) what the model
    cannot take: token ids outside the model's vocabulary, and prompt-token log
    probabilities (``echo`` with ``logprobs``)."""

    def __init__(self, model_path: str, pipeline_config: Any, **kwargs: Any) -> None:
        super().__init__(model_path, pipeline_config, **kwargs)
        #: CacheBlend's settings (``MAXKV_BLEND``), or ``None``: separators are text.
        self.blend = BlendConfig.from_env()
        sizes = [self.tokenizer_vocab_size]
        try:
            sizes.append(int(pipeline_config.model.huggingface_config.vocab_size))
        except (AttributeError, TypeError, ValueError):
            pass
        #: Ids at or past this are refused (the smaller of the tokenizer's and the model's).
        self.vocab_limit = min(sizes)

    async def encode(
        self, prompt: str | Sequence[int], add_special_tokens: bool = True
    ) -> np.ndarray:
        if not isinstance(prompt, str):
            check_token_ids(prompt, self.vocab_limit)  # before NumPy sees them
        return np.asarray(await super().encode(prompt, add_special_tokens))

    async def _generate_prompt_and_token_ids(
        self,
        prompt: Sequence[int] | str | None,
        messages: Any,
        tools: Any = None,
        **chat_template_options: Any,
    ) -> tuple[str | list[int], np.ndarray]:
        """MAX's prompt encoding; with blending, a prompt (or rendered chat) holding the
        separator is encoded piece by piece, without the separators, and where the
        pieces start is left in :data:`~maxkv.serving.pipelines.blending.blend_starts_var`."""
        plain = self.blend is None or not (isinstance(prompt, str) or prompt is None)
        chat = prompt is None
        if plain or (chat and not isinstance(messages, list)):
            result: tuple[
                str | list[int], np.ndarray
            ] = await super()._generate_prompt_and_token_ids(
                prompt, messages, tools, **chat_template_options
            )
            return result
        assert self.blend is not None
        if chat:
            text = await run_with_default_executor(
                self.apply_chat_template, messages, tools, **chat_template_options
            )
        else:
            assert isinstance(prompt, str)
            text = prompt
        pieces = split_prompt(text, self.blend.separator)
        if len(pieces) == 1:
            ids = await (self._encode_chat_prompt(text) if chat else self.encode(text, True))
            return text, ids
        encoded = [np.asarray(await self.encode(pieces[0], not chat), dtype=np.int64)]
        for piece in pieces[1:]:
            encoded.append(np.asarray(await self.encode(piece, False), dtype=np.int64))
        ids = np.concatenate(encoded)
        if self.max_length and len(ids) > self.max_length:
            raise PromptTooLongError(len(ids), self.max_length)
        blend_starts_var.set(piece_starts([len(e) for e in encoded]))
        return "".join(pieces), ids

    async def new_context(self, request: Any) -> Any:
        if getattr(request, "echo", False) and getattr(request, "logprobs", 0):
            raise InputError(
                "`echo` with `logprobs`: maxkv does not compute log probabilities of the "
                "prompt's tokens; leave out `echo` (logprobs of the generated tokens are served)"
            )
        if request.sampling_params is not None:
            check_sampling(request.sampling_params, self.vocab_limit)
        reset = blend_starts_var.set(None)
        try:
            context = await super().new_context(request)
            starts = blend_starts_var.get()
        finally:
            blend_starts_var.reset(reset)
        ids = np.asarray(context.tokens.all)
        if ids.size == 0:
            raise InputError("the prompt has no tokens")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_limit:
            # Whatever made them (a chat encoder, the tokenizer's own added tokens).
            check_token_ids(ids.tolist(), self.vocab_limit)
        if starts is not None:
            return with_blend_starts(context, starts)
        return context


def refuse_unsupported_requests() -> None:
    """Makes the OpenAI routes refuse requests maxkv cannot serve (once per process)."""
    parse = seams.PARSE_OPENAI_REQUEST.resolve()
    if getattr(parse, "_maxkv_checked", False):
        return

    @functools.wraps(parse)
    async def parse_and_check(*args: Any, **kwargs: Any) -> Any:
        try:
            request = await parse(*args, **kwargs)
        except RecursionError:  # json.loads of a deeply nested body
            raise InputError("the request body is nested too deeply to be a request") from None
        except ClientDisconnect:  # an upload cut short: nobody reads the answer
            raise InputError("the client left before sending the whole body") from None
        check_request(request)
        return request

    parse_and_check._maxkv_checked = True  # type: ignore[attr-defined]
    seams.PARSE_OPENAI_REQUEST.replace(parse_and_check)
