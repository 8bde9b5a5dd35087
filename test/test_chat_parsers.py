"""Gemma 4's tool-call and reasoning parsers on scripted outputs, whole and streamed.

Streams come from the real tiny tokenizer: each output is tokenized and decoded token by token through the
server's incremental detokenizer (special tokens kept, as the chat route asks), so deltas split where a real
stream splits them. Every split point of each output is checked too: whatever the chunking, the stream must
give what the whole-output parse gives.
"""

from __future__ import annotations

import json

import pytest

from srt.entrypoints.openai.chat_features import ChatDelta, ChatOutputParser, parse_reply
from srt.entrypoints.openai.gemma4_values import GemmaSyntaxError, parse_arguments
from srt.entrypoints.openai.reasoning_parser import Gemma4ReasoningParser, parse_reasoning
from srt.entrypoints.openai.tool_parser import Gemma4ToolParser, parse_tool_calls
from srt.managers.detokenizer import IncrementalDetokenizer
from srt.tools.tokenizer_builder import build_tokenizer

Q = '<|"|>'
NAMES = frozenset({"get_weather", "search", "noop"})


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(1024)


def token_deltas(tokenizer, text: str) -> list[str]:
    """`text` as a stream delivers it: one detokenized delta per token (empty while a character is held)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    deltas = [detok.add([token], finished=i == len(ids) - 1).text for i, token in enumerate(ids)]
    assert "".join(deltas) == text
    return deltas


def parser(reasoning: bool = True, tools: bool = True) -> ChatOutputParser:
    return ChatOutputParser(
        Gemma4ReasoningParser() if reasoning else None, Gemma4ToolParser(NAMES) if tools else None, ("<turn|>",)
    )


def streamed(pieces: list[str], **kwargs) -> tuple[ChatDelta, list[dict]]:
    """The whole reply from a stream of `pieces`, and the stream's tool-call deltas."""
    p = parser(**kwargs)
    total, deltas = ChatDelta(), []
    for piece in pieces:
        part = p.feed(piece)
        deltas += [call.to_delta() for call in part.calls]
        total = total.add(part)
    last = p.finish()
    deltas += [call.to_delta() for call in last.calls]
    return total.add(last), deltas


def summary(reply: ChatDelta) -> tuple:
    return reply.reasoning, reply.content, [(c.index, c.name, json.loads(c.arguments)) for c in reply.calls]


def check_every_split(text: str, **kwargs) -> tuple:
    """The whole-output parse, after checking that every two-piece split and the real token stream agree."""
    whole = summary(parse_reply(parser(**kwargs), text))
    for cut in range(len(text) + 1):
        assert summary(streamed([text[:cut], text[cut:]], **kwargs)[0]) == whole, f"split at {cut}"
    assert summary(streamed(list(text), **kwargs)[0]) == whole
    return whole


NESTED = (
    f"<|tool_call>call:get_weather{{city:{Q}Paris, {{FR}}: [x]{Q},days:3,temp:-1.5e2,ok:true,none:null,"
    f"opts:{{metric:false,levels:[1,2.5,{Q}hi{Q}],deep:{{a:{{b:[]}}}}}},tags:[{Q}a,b{Q},{Q}{Q}]}}<tool_call|>"
)
NESTED_ARGS = {
    "city": "Paris, {FR}: [x]",
    "days": 3,
    "temp": -150.0,
    "ok": True,
    "none": None,
    "opts": {"metric": False, "levels": [1, 2.5, "hi"], "deep": {"a": {"b": []}}},
    "tags": ["a,b", ""],
}


def test_values_convert_to_json_types():
    assert parse_arguments(NESTED[len("<|tool_call>call:get_weather") : -len("<tool_call|>")]) == NESTED_ARGS
    assert parse_arguments("{}") == {}
    assert parse_arguments(f"{{{Q}quoted key{Q}:1, spaced : {Q}x{Q} }}") == {"quoted key": 1, "spaced": "x"}
    for bad in ("{a:}", f"{{a:{Q}x}}", "{a:1", "{a:1}}", "[1]", "{a:hello}", "{:1}"):
        with pytest.raises(GemmaSyntaxError):
            parse_arguments(bad)


def test_nested_call_at_every_split_point(tokenizer):
    text = f"Checking.{NESTED}<turn|>"
    reasoning, content, calls = check_every_split(text)
    assert (reasoning, content) == ("", "Checking.") and calls == [(0, "get_weather", NESTED_ARGS)]
    reply, deltas = streamed(token_deltas(tokenizer, text))
    assert summary(reply) == (reasoning, content, calls)
    assert [d["index"] for d in deltas] == [0] and json.loads(deltas[0]["function"]["arguments"]) == NESTED_ARGS


def test_two_calls_get_indices_0_and_1(tokenizer):
    text = (
        f"<|tool_call>call:search{{q:{Q}a}}b{Q}}}<tool_call|>"
        f"<|tool_call>call:get_weather{{city:{Q}Oslo{Q}}}<tool_call|>Done."
    )
    _, content, calls = check_every_split(text)
    assert content == "Done."
    assert calls == [(0, "search", {"q": "a}b"}), (1, "get_weather", {"city": "Oslo"})]
    reply, deltas = streamed(token_deltas(tokenizer, text))
    assert [d["index"] for d in deltas] == [0, 1] and len({d["id"] for d in deltas}) == 2
    assert all(d["type"] == "function" for d in deltas)


def test_reasoning_then_a_call(tokenizer):
    text = "<|channel>thought\nThe user wants rain {data}.<channel|><|tool_call>call:noop{}<tool_call|>"
    assert check_every_split(text) == ("The user wants rain {data}.", "", [(0, "noop", {})])
    assert summary(streamed(token_deltas(tokenizer, text))[0])[2] == [(0, "noop", {})]


@pytest.mark.parametrize(
    "call",
    [
        f"<|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|>",  # unterminated string
        "<|tool_call>get_weather{}<tool_call|>",  # no call: header
        "<|tool_call>call:unknown_tool{a:1}<tool_call|>",  # not a declared tool
        "<|tool_call>call:search{q:1,}<tool_call|>",  # trailing comma
        f"<|tool_call>call:search{{q:{Q}cut off",  # the output ended inside the call
    ],
)
def test_malformed_call_is_kept_as_text(call):
    text = f"Before {call} after"
    reasoning, content, calls = check_every_split(text)
    assert calls == [] and content == text and reasoning == ""


def test_reasoning_parser_alone():
    assert parse_reasoning("<|channel>thought\nhmm<channel|>4") == ("hmm", "4")
    assert parse_reasoning("just an answer") == (None, "just an answer")
    assert parse_reasoning("<|channel>thought\nout of tokens") == ("out of tokens", "")
    assert parse_reasoning("<|channel>thought<channel|>answer") == ("", "answer")
    text = "<|channel>thought\nstep 1\nstep 2<channel|>The answer<turn|>"
    assert check_every_split(text, tools=False) == ("step 1\nstep 2", "The answer", [])


def test_tool_parser_alone_holds_back_only_a_possible_marker():
    p = Gemma4ToolParser(NAMES)
    assert p.feed("a <|tool").content == "a "  # could become <|tool_call>
    assert p.feed("> b").content == "<|tool> b"  # it did not
    assert parse_tool_calls("no calls at all <|tool_response>") == ("no calls at all <|tool_response>", [])


def test_special_tokens_are_dropped_from_content_only_when_asked():
    kept = ChatOutputParser(None, Gemma4ToolParser(NAMES), None)
    assert parse_reply(kept, "hi<turn|>").content == "hi<turn|>"
    assert parse_reply(parser(), "hi<turn|>").content == "hi"
