"""What ``max serve``'s OpenAI routes accept when maxkv serves the model.

Every request a worker could not serve is answered with HTTP 400 and a
message that says why, in the API server, before it reaches the model
worker (where an exception takes the whole server down, and MAX 26.7 lets
several through):

- at parsing (:func:`refuse_unsupported_requests` wraps the routes' body
  parser, ``max.serve.router.openai_routes._parse_openai_request_body``;
  the routes turn its :class:`~max.pipelines.context.exceptions.InputError`
  into a 400): bodies nested too deeply for Python's JSON parser and uploads
  the client abandoned (MAX answers 500); a completion with no prompt
  (``"prompt": []``), or streamed with several prompts (MAX answers 500):
  :func:`check_request`.  (``n``, ``best_of`` and ``echo``, which MAX's
  routes accept and answer with one choice, are served by
  :mod:`~maxkv.serving.pipelines.choices` in front of the routes.);
- the fields of vLLM's and SGLang's servers that routers (vllm-router, for
  one) add to every request they forward are not MAX's, whose schema refuses
  any field it does not know: :func:`accept_router_fields` takes them out
  before MAX validates the body.  Where maxkv does what the field asks
  (``skip_special_tokens: true``, ``continue_final_message``), or the field
  changes nothing here (the reasoning options: maxkv's models have no
  reasoning parser), the request is served; a value that would change the
  answer in a way maxkv cannot (``skip_special_tokens: false``,
  ``no_stop_trim: true``, ...) is a 400 that names it;
- as a request becomes a context (:class:`MaxkvTextTokenizer`, the tokenizer
  of maxkv's architecture): prompts with no token, or with token ids that
  are not ids of the model's vocabulary (negative, or past its embedding
  table: the worker's gather fails and the server goes down);
  ``stop_token_ids`` outside the vocabulary and integers the worker queue
  cannot carry (outside int64: MAX answers 500): :func:`check_sampling`,
  which also reads a ``top_k`` past the vocabulary as the vocabulary (what it
  means; MAX's sampler sizes its buffers by the batch's largest ``top_k``,
  and ``2**31`` took 23 GB before the worker was killed); with CacheBlend
  (``MAXKV_BLEND=1``), a prompt whose chunk between two separators is empty
  or that ends with the separator (:func:`~maxkv.serving.pipelines.blending.split_prompt`).
"""

from __future__ import annotations

import functools
import json
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
from .cancels import track_prompt
from .choices import choice_order, fork_source
from .context import maxkv_context
from .render import Rendered, render_var

#: vLLM's and SGLang's request fields that MAX's schema lacks, with the values maxkv
#: serves as asked (``None``, the field left out, always is): what its server does
#: anyway.  Another value is a 400 that says why.
ROUTER_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "skip_special_tokens": ((True,), "the text never holds special tokens"),
    "no_stop_trim": ((False,), "a stop string is trimmed from the text"),
    "include_stop_str_in_output": ((False,), "a stop string is trimmed from the text"),
    "return_hidden_states": ((False,), "hidden states are not returned"),
    "use_beam_search": ((False,), "there is no beam search"),
    "echo": ((False,), "a chat answer does not repeat the messages"),
    "truncate_prompt_tokens": ((), "prompts are not truncated: a long one is refused"),
    "prompt_logprobs": ((), "ask for the prompt's log probabilities with `echo` and `logprobs`"),
    "guided_json": ((), "guided decoding: use `response_format`"),
    "guided_regex": ((), "guided decoding: use `response_format`"),
    "guided_choice": ((), "guided decoding: use `response_format`"),
    "guided_grammar": ((), "guided decoding: use `response_format`"),
    "structured_outputs": ((), "guided decoding: use `response_format`"),
    "chat_template": ((), "the server's chat template is the one it was started with"),
    "lora_path": ((), "no LoRA adapter"),
    "kv_transfer_params": ((), "no KV transfer between servers (prefill/decode split)"),
}
#: Fields that change nothing maxkv serves, whatever their value: the reasoning
#: parser's (maxkv's model families have none), scheduling hints, ids.
IGNORED_FIELDS = frozenset(
    {
        "separate_reasoning",
        "stream_reasoning",
        "include_reasoning",
        "spaces_between_special_tokens",
        "priority",
        "request_id",
        "rid",
        "vllm_xargs",
    }
)
#: Chat fields maxkv honours through the chat template's options.
TEMPLATE_FIELDS = ("continue_final_message", "add_generation_prompt")


def accept_router_fields(body: dict[str, Any], known: Any) -> dict[str, Any]:
    """``body`` without the vLLM/SGLang fields MAX's schema ``known`` (its field
    names) lacks: honoured (the chat template's ``continue_final_message`` and
    ``add_generation_prompt``), served as asked (:data:`ROUTER_FIELDS`) or
    ignored (:data:`IGNORED_FIELDS`); a field no one knows is left for MAX to
    refuse.

    Raises:
        InputError: For a value maxkv cannot serve as asked.
    """
    extra = [k for k in body if k not in known]
    if not extra:
        return body
    body = dict(body)
    template: dict[str, Any] = {}
    for name in extra:
        if name in IGNORED_FIELDS:
            del body[name]
        elif name in ROUTER_FIELDS:
            value = body.pop(name)
            served, why = ROUTER_FIELDS[name]
            if value is not None and value not in served:
                raise InputError(f"`{name}`={json.dumps(value)} is not served by maxkv: {why}")
        elif name in TEMPLATE_FIELDS and "messages" in body:
            value = body.pop(name)
            if value is not None:
                if not isinstance(value, bool):
                    raise InputError(f"`{name}` must be true or false, got {json.dumps(value)}")
                template[name] = value
    if template:
        given = body.get("chat_template_kwargs")
        if given is not None and not isinstance(given, dict):
            raise InputError("`chat_template_kwargs` must be an object")
        if template.get("continue_final_message"):
            template.setdefault("add_generation_prompt", False)
        options = {**template, **(given or {})}
        if options.get("continue_final_message") and options.get("add_generation_prompt"):
            raise InputError(
                "`continue_final_message` and `add_generation_prompt` cannot both be true"
            )
        body["chat_template_kwargs"] = options
    return body


class _RouterTolerant:
    """A MAX request model whose validation first takes out the router fields
    (:func:`accept_router_fields`); what the body parser reads of a model."""

    def __init__(self, model_cls: Any) -> None:
        self.model_cls = model_cls
        #: MAX's fields and the router's: what MAX's parser keeps when it drops unknown
        #: fields (``allow_extra_request_fields``), so they still reach the check.
        self.model_fields = {
            **dict.fromkeys([*ROUTER_FIELDS, *IGNORED_FIELDS, *TEMPLATE_FIELDS]),
            **model_cls.model_fields,
        }

    def model_validate(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(obj, dict):
            obj = accept_router_fields(obj, self.model_cls.model_fields)
        return self.model_cls.model_validate(obj, *args, **kwargs)


#: What a request's integers must fit: the worker queue carries int64.
INT64 = (-(2**63), 2**63 - 1)


def check_request(request: Any) -> None:
    """Raises ``InputError`` for a parsed OpenAI request maxkv cannot serve: an empty
    prompt list, a stream of several prompts.  (Several choices, ``n`` and
    ``best_of``, are run by :mod:`~maxkv.serving.pipelines.choices` before.)"""
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
    of the vocabulary; a ``top_k`` past the vocabulary becomes ``vocab_size``
    (the same draw: MAX's sampler would size its buffers by it)."""
    for name, value in vars(params).items():
        values = value if isinstance(value, list | tuple) else [value]
        for item in values:
            if isinstance(item, int) and not isinstance(item, bool):
                if not INT64[0] <= item <= INT64[1]:
                    raise InputError(f"`{name}` holds {item}, outside the 64-bit integers")
    top_k = getattr(params, "top_k", None)
    if isinstance(top_k, int) and top_k > vocab_size:
        params.top_k = vocab_size
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

    #: It answers the render routes (:mod:`~maxkv.serving.pipelines.render`).
    renders_tokens = True

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
        track_prompt()  # (cancelled if its HTTP request ends first: module cancels)
        if request.sampling_params is not None:
            check_sampling(request.sampling_params, self.vocab_limit)
        reset = blend_starts_var.set(None)
        try:
            async with choice_order(str(request.request_id)):
                context = await self._checked_context(request)
            starts = blend_starts_var.get()
        finally:
            blend_starts_var.reset(reset)
        fields: dict[str, Any] = {}
        fork_of = fork_source(str(request.request_id))
        if fork_of is not None:
            fields["fork_of"] = fork_of
        if getattr(request, "echo", False) and getattr(request, "logprobs", 0):
            fields["echo_prompt_length"] = int(context.tokens.prompt_length)
        if fields:
            context = maxkv_context(context, **fields)
        if starts is not None:
            return with_blend_starts(context, starts)
        return context

    async def _checked_context(self, request: Any) -> Any:
        """MAX's context of ``request``, its prompt's ids checked (a render's answered).

        Raises:
            InputError: For a prompt with no token or an id outside the vocabulary.
            Rendered: In a render route, with the prompt's ids.
        """
        context = await super().new_context(request)
        ids = np.asarray(context.tokens.all)
        if ids.size == 0:
            raise InputError("the prompt has no tokens")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_limit:
            # Whatever made them (a chat encoder, the tokenizer's own added tokens).
            check_token_ids(ids.tolist(), self.vocab_limit)
        if render_var.get():  # a render route: the tokens are the answer
            raise Rendered([int(t) for t in ids])
        return context


def refuse_unsupported_requests() -> None:
    """Makes the OpenAI routes refuse requests maxkv cannot serve (once per process)."""
    parse = seams.PARSE_OPENAI_REQUEST.resolve()
    if getattr(parse, "_maxkv_checked", False):
        return

    @functools.wraps(parse)
    async def parse_and_check(request: Any, request_id: Any, model_cls: Any) -> Any:
        try:
            parsed = await parse(request, request_id, _RouterTolerant(model_cls))
        except RecursionError:  # json.loads of a deeply nested body
            raise InputError("the request body is nested too deeply to be a request") from None
        except ClientDisconnect:  # an upload cut short: nobody reads the answer
            raise InputError("the client left before sending the whole body") from None
        check_request(parsed)
        return parsed

    parse_and_check._maxkv_checked = True  # type: ignore[attr-defined]
    seams.PARSE_OPENAI_REQUEST.replace(parse_and_check)
