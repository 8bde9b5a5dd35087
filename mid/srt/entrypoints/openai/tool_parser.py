"""Gemma 4 tool calls in a model's output (`--tool-call-parser gemma4`), whole or as a stream of text deltas.

The model writes calls between control tokens, before, between or after ordinary text:

    Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:...<tool_call|>

Each call becomes an OpenAI tool call whose `arguments` is JSON (gemma4_values). Text outside calls is content.
A call that does not parse (no `call:NAME{...}`, a broken value, a name the request did not declare, no closing
<tool_call|> by the end of the output) stays in the content as it was written.

Streaming feeds text deltas (special tokens kept in the text) and gets content deltas and whole calls. Content
that could be the start of `<|tool_call>` is held back until the next delta decides; a call is sent in one delta
once its <tool_call|> arrived and it parsed, so a client never sees half an argument value or a call that later
turns out to be text. The whole-output parse runs the same parser over one delta, so both agree exactly.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from srt.entrypoints.openai.gemma4_values import GemmaSyntaxError, arguments_json, parse_arguments

CALL_START, CALL_END = "<|tool_call>", "<tool_call|>"
_HEADER = re.compile(r"\s*call:([^\s{}<>]+)(\{.*\})\s*", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `index` counts calls of one output from 0."""

    index: int
    id: str
    name: str
    arguments: str  # JSON

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_delta(self) -> dict:
        return {"index": self.index, **self.to_openai()}


@dataclass
class ParsedDelta:
    """What one text delta adds: content text and the calls that completed."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str, known_names: frozenset[str] | None) -> tuple[str, str] | None:
    """(name, JSON arguments) of the text between <|tool_call> and <tool_call|>; None if it is not a call."""
    match = _HEADER.fullmatch(body)
    if match is None:
        return None
    name = match.group(1)
    if known_names is not None and name not in known_names:
        return None
    try:
        return name, arguments_json(parse_arguments(match.group(2)))
    except GemmaSyntaxError:
        return None


class Gemma4ToolParser:
    """One output's tool calls, fed text deltas in order (`feed`), then `finish()` once the output ended."""

    def __init__(self, known_names: frozenset[str] | None = None) -> None:
        self.known_names = known_names
        self.pending = ""  # text not yet handed out: a possible marker start, or a call still open
        self.in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self.pending += text
        while True:
            if self.in_call:
                end = self.pending.find(CALL_END)
                if end == -1:
                    return out
                body, self.pending = self.pending[:end], self.pending[end + len(CALL_END) :]
                self.in_call = False
                parsed = parse_call(body, self.known_names)
                if parsed is None:
                    out.content += CALL_START + body + CALL_END
                else:
                    out.calls.append(ToolCall(self.num_calls, new_call_id(), *parsed))
                    self.num_calls += 1
                continue
            start = self.pending.find(CALL_START)
            if start == -1:
                keep = partial_marker_len(self.pending, CALL_START)
                out.content += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                return out
            out.content += self.pending[:start]
            self.pending = self.pending[start + len(CALL_START) :]
            self.in_call = True

    def finish(self) -> ParsedDelta:
        """Whatever is held back: an unclosed call goes back to the content as written."""
        out = ParsedDelta(content=(CALL_START if self.in_call else "") + self.pending)
        self.pending, self.in_call = "", False
        return out


def parse_tool_calls(text: str, known_names: frozenset[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output."""
    parser = Gemma4ToolParser(known_names)
    first, last = parser.feed(text), parser.finish()
    return first.content + last.content, first.calls + last.calls


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that `marker` starts with (the marker may complete later)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
