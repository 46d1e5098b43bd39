"""The fields routers add to requests: served, honoured, or refused by name
(:func:`maxkv.serving.pipelines.api.accept_router_fields`), before MAX's schema
validates the body."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

#: What vllm-router 0.1.17 adds to every chat request it forwards (its defaults; a
#: client's own values pass through).
ROUTER_CHAT_DEFAULTS = {
    "stream": False,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}


@pytest.fixture(scope="module")
def api():  # type: ignore[no-untyped-def]
    from maxkv.serving.pipelines import api

    return api


def chat_fields() -> set[str]:
    from max.serve.schemas.openai import CreateChatCompletionRequest

    return set(CreateChatCompletionRequest.model_fields)


def test_what_vllm_router_adds_is_served_and_taken_out(api) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **ROUTER_CHAT_DEFAULTS}
    out = api.accept_router_fields(body, chat_fields())
    kept = {"model", "messages", "stream", "logprobs", "ignore_eos", "chat_template_kwargs"}
    assert set(out) == kept
    assert out["chat_template_kwargs"] == {"continue_final_message": False}
    assert "no_stop_trim" in body  # the caller's body is left as it was


def test_continue_final_message_becomes_the_templates_options(api) -> None:  # type: ignore[no-untyped-def]
    body = {"messages": [], "continue_final_message": True, "chat_template_kwargs": {"x": 1}}
    out = api.accept_router_fields(body, chat_fields())
    assert out["chat_template_kwargs"] == {
        "continue_final_message": True,
        "add_generation_prompt": False,
        "x": 1,
    }
    both = {"messages": [], "continue_final_message": True, "add_generation_prompt": True}
    with pytest.raises(api.InputError, match="cannot both be true"):
        api.accept_router_fields(both, chat_fields())


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("skip_special_tokens", False),
        ("no_stop_trim", True),
        ("return_hidden_states", True),
        ("prompt_logprobs", 1),
        ("guided_json", {"type": "object"}),
        ("continue_final_message", "yes"),
        ("kv_transfer_params", {"do_remote_decode": True}),
    ],
)
def test_a_value_that_would_change_the_answer_is_refused_by_name(api, name, value) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(api.InputError, match=f"`{name}`"):
        api.accept_router_fields({"messages": [], name: value}, chat_fields())


def test_unknown_fields_are_left_for_max_to_refuse(api) -> None:  # type: ignore[no-untyped-def]
    body = {"messages": [], "no_such_field": 1, "priority": 3}
    assert api.accept_router_fields(body, chat_fields()) == {"messages": [], "no_such_field": 1}
