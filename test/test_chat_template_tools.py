"""The tiny checkpoints' chat template renders Gemma 4's tool and thinking formats as the published template
does (the strings below are that format: declarations in the system turn, calls and responses in the model's
turn, keys sorted, strings between <|"|> tokens); and chat requests the template cannot serve are refused."""

from __future__ import annotations

import pytest

from srt.entrypoints.openai.chat_features import ChatFeatures
from srt.entrypoints.openai.protocol import ChatCompletionRequest
from srt.entrypoints.openai.response_parts import RequestError
from srt.server_args import ServerArgs
from srt.tools.tokenizer_builder import build_tokenizer

Q = '<|"|>'
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "opts": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]},
            },
            "required": ["city"],
        },
    },
}
DECLARATION = (
    f"<|tool>declaration:get_weather{{description:{Q}Weather now{Q},parameters:{{properties:{{"
    f"city:{{description:{Q}City{Q},type:{Q}STRING{Q}}},"
    f"opts:{{properties:{{x:{{type:{Q}BOOLEAN{Q}}}}},required:[{Q}x{Q}],type:{Q}OBJECT{Q}}},"
    f"tags:{{items:{{type:{Q}STRING{Q}}},type:{Q}ARRAY{Q}}},"
    f"unit:{{enum:[{Q}c{Q},{Q}f{Q}],type:{Q}STRING{Q}}}}},"
    f"required:[{Q}city{Q}],type:{Q}OBJECT{Q}}}}}<tool|>"
)
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "tags": ["a"], "opts": {"x": True}, "n": 2}},
}
CALL_TEXT = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},n:2,opts:{{x:true}},tags:[{Q}a{Q}]}}<tool_call|>"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(1024)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


def test_tools_are_declared_in_the_system_turn(tokenizer):
    prompt = render(tokenizer, [{"role": "user", "content": "Hi"}], tools=[TOOL])
    assert prompt == f"<bos><|turn>system\n{DECLARATION}<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = render(tokenizer, system, tools=[TOOL], enable_thinking=True)
    assert prompt.startswith(f"<bos><|turn>system\n<|think|>\nBe brief.{DECLARATION}<turn|>\n")


def test_calls_and_responses_continue_the_model_turn(tokenizer):
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "use the tool"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    head = "<bos><|turn>user\nWeather?<turn|>\n<|turn>model\n<|channel>thought\nuse the tool\n<channel|>"
    # a call awaiting its result ends with <|tool_response>, where the model stopped
    assert render(tokenizer, messages[:2]) == head + CALL_TEXT + "<|tool_response>"
    # with the result the turn goes on: no new generation prompt
    response = f"<|tool_response>response:get_weather{{value:{Q}sunny{Q}}}<tool_response|>"
    assert render(tokenizer, messages) == head + CALL_TEXT + response
    final = [*messages, {"role": "assistant", "content": "<|channel>thought\nok<channel|>It is sunny."}]
    final.append({"role": "user", "content": "Thanks"})
    # the answer continues the same turn; thoughts of turns before the last user message are dropped
    expected = (
        "<bos><|turn>user\nWeather?<turn|>\n<|turn>model\n" + CALL_TEXT + response + "It is sunny.<turn|>\n"
        "<|turn>user\nThanks<turn|>\n<|turn>model\n"
    )
    assert render(tokenizer, final) == expected


def test_enable_thinking_renders_think(tokenizer):
    prompt = render(tokenizer, [{"role": "user", "content": "Hi"}], enable_thinking=True)
    assert prompt == "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"


def request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def test_requests_the_template_or_tools_cannot_serve_are_refused(tokenizer):
    args = ServerArgs.__new__(ServerArgs)  # only the parser fields are read
    args.tool_call_parser = args.reasoning_parser = None
    template = tokenizer.chat_template
    features = ChatFeatures.of(request(tools=[TOOL]), args, template)
    assert features.parse_tools and features.grammar is None and features.known_names == {"get_weather"}
    assert ChatFeatures.of(request(tools=[TOOL], tool_choice="required"), args, template).grammar[0] == "ebnf"
    cases = [
        (request(tools=[TOOL]), "{{ messages }}", "tools", "cannot render tools"),
        (request(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), template,
         "tool_choice", "'nope', which is not in tools"),
        (request(tool_choice="required"), template, "tool_choice", "needs tools"),
        (request(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}),
         template, "response_format", "invalid"),
        (request(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), template,
         "response_format", "needs json_schema.schema"),
        (request(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}), template,
         "response_format", "cannot be combined"),
    ]  # fmt: skip
    for req, chat_template, param, words in cases:
        with pytest.raises(RequestError, match=words) as error:
            ChatFeatures.of(req, args, chat_template)
        assert error.value.param == param
