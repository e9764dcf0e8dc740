"""Request models accept what OpenAI clients send and refuse, by name, what we do not support."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.worker.app import validation_error
from splitserve.worker.protocol import ChatCompletionRequest, CompletionRequest

EVERY_CHAT_FIELD = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
        {"role": "assistant", "content": None},
    ],
    "max_tokens": 5,
    "max_completion_tokens": 6,
    "temperature": 0.5,
    "top_p": 0.9,
    "n": 1,
    "stream": True,
    "stream_options": {"include_usage": True},
    "stop": ["\n"],
    "seed": 1,
    "user": "me",
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "logprobs": False,
    "response_format": {"type": "text"},
    "metadata": {"k": "v"},
    "store": False,
    "service_tier": "auto",
    "tool_choice": "none",
    "parallel_tool_calls": False,
    "top_k": 3,
    "min_tokens": 1,
    "ignore_eos": False,
    "stop_token_ids": [2],
    "include_stop_str_in_output": True,
    "kv_transfer_params": {"request_id": "r", "decode_kv_addr": "127.0.0.1:1"},
}


def test_every_supported_chat_field_is_accepted() -> None:
    request = ChatCompletionRequest.model_validate(EVERY_CHAT_FIELD)
    assert request.unsupported_reason() is None
    assert request.requested_max_tokens() == 6  # max_completion_tokens wins
    assert request.include_usage()
    assert request.message_dicts()[1] == {"role": "user", "content": "a\nb", "name": "u"}
    assert request.message_dicts()[2] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("prompt", ["text", ["text"], [1, 2, 3], [[1, 2, 3]]])
def test_completion_prompt_forms(prompt: object) -> None:
    request = CompletionRequest.model_validate({"prompt": prompt, "stop": "x"})
    assert request.unsupported_reason() is None
    assert request.stop_strings() == ("x",)


@pytest.mark.parametrize(
    ("field", "value"),
    [("suffix", "s"), ("response_format", {"type": "structural_tag"}), ("skip_special_tokens", False),
     ("stream_options", {"include_usage": True, "continuous_usage_stats": True})],
)  # fmt: skip
def test_unsupported_values_are_named(field: str, value: object) -> None:
    request = CompletionRequest.model_validate({"prompt": "p", field: value})
    reason = request.unsupported_reason()
    assert reason is not None and reason[0] == field


def test_chat_template_kwargs_are_refused_not_ignored() -> None:
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": True}}
    )
    assert request.unsupported_reason() == ("chat_template_kwargs", "chat_template_kwargs are not supported")


def test_unknown_field_error_names_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "p", "best": 1})
    error = validation_error(info.value.errors())
    assert (error.status, error.param) == (400, "best") and "'best'" in error.message


def test_nested_error_names_the_top_level_param_and_the_path() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 5}]})
    error = validation_error(info.value.errors())
    assert error.param == "messages" and "messages.0.content" in error.message
