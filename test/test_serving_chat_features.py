"""Tools, structured outputs and reasoning through the real `openai` client against a server on a tiny
checkpoint. Its weights are random, so what is checked is what constrained decoding guarantees whatever the
model: a forced call is a valid call of the right tool, a json_schema reply parses and validates."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from serving_fixtures import PRESET, openai_client, wait_idle
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 12},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["answer", "score", "tags"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint(PRESET)


@pytest.fixture(scope="module")
def server(shared_server):
    """The session's server (conftest.py); this module leaves it idle with no slot leaked."""
    yield shared_server
    wait_idle(shared_server.url)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def name(model) -> str:
    return str(model)


def calls_of(client, name, stream: bool, **kwargs) -> tuple[list[tuple[int, str, dict]], str]:
    """(index, name, arguments) of the reply's calls, and its finish reason; a stream is put together from
    its deltas, each call's fields as they arrive."""
    args = {"model": name, "messages": USER, "tools": TOOLS, "max_tokens": 120, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = choice.message.tool_calls or []
        assert all(call.id.startswith("call_") for call in calls)
        found_calls = [(i, c.function.name, json.loads(c.function.arguments)) for i, c in enumerate(calls)]
        return found_calls, choice.finish_reason
    found: dict[int, dict] = {}
    reason = None
    for chunk in client.chat.completions.create(**args, stream=True):
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            call = found.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return [(i, c["name"], json.loads(c["arguments"])) for i, c in sorted(found.items())], reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_calls_validate_streamed_or_not(client, name, temperature):
    for choice, names in [(WEATHER, {"get_weather"}), ("required", {"get_weather", "get_time"})]:
        sampling = {"temperature": temperature, "seed": 7, "tool_choice": choice}
        whole, reason = calls_of(client, name, False, **sampling)
        assert reason == "tool_calls" and whole
        assert [index for index, _, _ in whole] == list(range(len(whole)))
        for _, function, arguments in whole:
            assert function in names
            jsonschema.validate(arguments, SCHEMA if function == "get_weather" else {"const": {}})
        assert choice != WEATHER or len(whole) == 1
        streamed, reason = calls_of(client, name, True, **sampling)
        assert reason == "tool_calls" and streamed == whole


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_replies_parse_and_validate(client, name, temperature):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}

    def ask(i: int) -> str:
        messages = [{"role": "user", "content": f"Question {i}: rate the city number {i * 13}."}]
        reply = client.chat.completions.create(
            model=name, messages=messages, response_format=response_format, temperature=temperature, max_tokens=120
        )
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        contents = list(pool.map(ask, range(20)))
    for content in contents:
        jsonschema.validate(json.loads(content), ANSWER)


def test_json_object_and_native_grammars(server, client, name):
    reply = client.chat.completions.create(
        model=name, messages=USER, response_format={"type": "json_object"}, temperature=0.0, max_tokens=200,
        extra_body={"top_k": 1},
    )  # fmt: skip
    if reply.choices[0].finish_reason == "stop":  # any object may be long: only a finished one must parse
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    for kind, source, check in [
        ("regex", "(yes|no), [0-9]{3}", lambda text: text[:2] in ("ye", "no") and text[-3:].isdigit()),
        ("ebnf", 'root ::= "pick " ("red" | "blue")', lambda text: text in ("pick red", "pick blue")),
        ("json_schema", json.dumps(ANSWER), lambda text: jsonschema.validate(json.loads(text), ANSWER) is None),
    ]:
        # seeded: the shared server's earlier requests must not decide which sample this test checks
        params = {"max_new_tokens": 60, "temperature": 1.0, "seed": 0, kind: source}
        body = {"text": "Choose:", "sampling_params": params}
        result = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
        assert result["meta_info"]["finish_reason"]["type"] == "stop" and check(result["text"]), result


def test_bad_structured_requests_get_400(server, client, name):
    bad = [
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
        {"messages": [*USER, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
    ]  # fmt: skip
    for fields in bad:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(**{"model": name, "messages": USER, **fields})
        assert error.value.body["message"]
    for params in [{"json_schema": "{"}, {"regex": "(a"}, {"regex": "a", "ebnf": 'root ::= "a"'}]:
        answer = httpx.post(f"{server.url}/generate", json={"text": "x", "sampling_params": params}, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tool_conversation_and_thinking_prompts(client, name, model):
    """Calls, tool results and enable_thinking reach the model as the template renders them."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
    for kwargs in [{}, {"enable_thinking": True}]:
        reply = client.chat.completions.create(
            model=name, messages=messages, tools=TOOLS, max_tokens=4, temperature=0.0,
            extra_body={"chat_template_kwargs": kwargs},
        )  # fmt: skip
        rendered = json.loads(json.dumps(messages))
        rendered[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}
        prompt = tokenizer.apply_chat_template(
            rendered, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs
        )
        assert ("<|think|>" in prompt) == bool(kwargs)
        assert 'call:get_weather{city:<|"|>Oslo<|"|>}' in prompt and "response:get_weather{value:" in prompt
        assert reply.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
