"""What a chat request asks beyond plain text: tools, tool_choice, response_format, reasoning; and the parser
that turns the model's reply back into OpenAI's fields.

    request ──► ChatFeatures.of ──► tools for the chat template, a grammar (xgrammar) for the sampler
    reply text deltas ──► ChatOutputParser ──► reasoning_content, content, tool_calls

The reply is decoded with its special tokens kept whenever something must be parsed out of it (the thought
channel, tool calls); the parser then drops the special tokens left in the content unless the request asked
to keep them (`skip_special_tokens: false`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache

from srt.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from srt.entrypoints.openai.reasoning_parser import Gemma4ReasoningParser
from srt.entrypoints.openai.response_parts import RequestError
from srt.entrypoints.openai.tool_grammar import tool_call_grammar
from srt.entrypoints.openai.tool_parser import Gemma4ToolParser, ToolCall
from srt.sampling.grammar import check_grammar
from srt.server_args import ServerArgs

ANY_JSON_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class ChatFeatures:
    """One chat request's tools, constraint and parsing, checked (RequestError for what cannot be served)."""

    tools: list[dict] | None  # for the chat template
    known_names: frozenset[str] | None  # functions a call may name
    parse_tools: bool
    parse_reasoning: bool
    grammar: tuple[str, str] | None  # (kind, text) for SamplingParams: "ebnf" or "json_schema"

    @classmethod
    def of(cls, request: ChatCompletionRequest, server_args: ServerArgs, chat_template: str | None) -> ChatFeatures:
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
        choice = request.tool_choice or ("auto" if tools else "none")
        if tools and "tools" not in (chat_template or ""):
            raise RequestError("this model's chat template cannot render tools", param="tools")
        names = frozenset(tool["function"]["name"] for tool in tools)
        if len(names) != len(tools):
            raise RequestError("tools must have distinct function names", param="tools")
        forced = None
        if isinstance(choice, NamedToolChoice):
            forced = choice.function.name
            if forced not in names:
                known = ", ".join(sorted(names)) or "none"
                message = f"tool_choice names {forced!r}, which is not in tools (tools: {known})"
                raise RequestError(message, param="tool_choice")
        elif choice == "required" and not tools:
            raise RequestError('tool_choice "required" needs tools', param="tool_choice")
        grammar = None
        if forced is not None or choice == "required":
            single = forced is not None or not request.parallel_tool_calls
            grammar = ("ebnf", tool_call_grammar(tools, forced, single))
        response_grammar = _response_format_grammar(request)
        if response_grammar is not None and grammar is not None:
            message = "response_format cannot be combined with a tool_choice that forces a call"
            raise RequestError(message, param="response_format")
        tool_parser_on = (server_args.tool_call_parser or "gemma4") != "none"
        reasoning_parser_on = (server_args.reasoning_parser or "gemma4") != "none"
        return cls(
            tools=tools or None,
            known_names=names if tools else None,
            parse_tools=tool_parser_on and bool(tools) and choice != "none",
            parse_reasoning=reasoning_parser_on and request.separate_reasoning,
            grammar=grammar or response_grammar,
        )

    def sampling_overrides(self) -> dict:
        """SamplingParams fields these features set."""
        overrides = {}
        if self.parse_tools or self.parse_reasoning:
            overrides["skip_special_tokens"] = False  # the parsers read the control tokens
        if self.grammar is not None:
            overrides[self.grammar[0]] = self.grammar[1]
        return overrides

    def output_parser(self, special_tokens: tuple[str, ...], keep_special_tokens: bool) -> ChatOutputParser:
        """A parser of one reply; `special_tokens` are dropped from what it returns unless kept."""
        return ChatOutputParser(
            Gemma4ReasoningParser() if self.parse_reasoning else None,
            Gemma4ToolParser(self.known_names) if self.parse_tools else None,
            None if keep_special_tokens or not (self.parse_tools or self.parse_reasoning) else special_tokens,
        )


def _response_format_grammar(request: ChatCompletionRequest) -> tuple[str, str] | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return "json_schema", ANY_JSON_OBJECT
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise RequestError("response_format json_schema needs json_schema.schema", param="response_format")
    source = json.dumps(spec.schema_)
    try:
        check_grammar("json_schema", source)
    except ValueError as error:
        raise RequestError(f"response_format: {error}", param="response_format") from None
    return "json_schema", source


@dataclass
class ChatDelta:
    """What a piece of the reply adds to each of the message's fields."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, other: ChatDelta) -> ChatDelta:
        return ChatDelta(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


class ChatOutputParser:
    """One reply's text deltas (special tokens kept) -> reasoning, content and tool calls, in order."""

    def __init__(
        self,
        reasoning: Gemma4ReasoningParser | None,
        tools: Gemma4ToolParser | None,
        drop_tokens: tuple[str, ...] | None,
    ) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.drop = (_TokenDropper(drop_tokens), _TokenDropper(drop_tokens)) if drop_tokens else None
        self.num_calls = 0

    def feed(self, text: str) -> ChatDelta:
        return self._step(text, finish=False)

    def finish(self) -> ChatDelta:
        """Everything held back; call once after the last delta."""
        return self._step("", finish=True)

    def _step(self, text: str, finish: bool) -> ChatDelta:
        out = ChatDelta(content=text)
        if self.reasoning is not None:
            part = self.reasoning.feed(text)
            if finish:
                last = self.reasoning.finish()
                part.reasoning, part.content = part.reasoning + last.reasoning, part.content + last.content
            out = ChatDelta(reasoning=part.reasoning, content=part.content)
        if self.tools is not None:
            parsed = self.tools.feed(out.content)
            if finish:
                last = self.tools.finish()
                parsed.content, parsed.calls = parsed.content + last.content, parsed.calls + last.calls
            out.content, out.calls = parsed.content, parsed.calls
        self.num_calls += len(out.calls)
        if self.drop is not None:
            out.reasoning = self.drop[0].feed(out.reasoning, finish)
            out.content = self.drop[1].feed(out.content, finish)
        return out


class _TokenDropper:
    """Removes special tokens' texts from a stream of text; a tail that may be the start of one waits."""

    def __init__(self, tokens: tuple[str, ...]) -> None:
        self.pattern = _token_pattern(tokens)
        self.prefixes = _token_prefixes(tokens)
        self.pending = ""

    def feed(self, text: str, finish: bool) -> str:
        text = self.pattern.sub("", self.pending + text)
        keep = 0 if finish else next((k for k in range(min(len(text), 32), 0, -1) if text[-k:] in self.prefixes), 0)
        self.pending = text[len(text) - keep :]
        return text[: len(text) - keep]


@lru_cache(maxsize=4)
def _token_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(re.escape(token) for token in sorted(tokens, key=len, reverse=True)))


@lru_cache(maxsize=4)
def _token_prefixes(tokens: tuple[str, ...]) -> frozenset[str]:
    return frozenset(token[:k] for token in tokens for k in range(1, len(token)))


def parse_reply(parser: ChatOutputParser, text: str) -> ChatDelta:
    """A whole reply, through the same parser a stream uses."""
    return parser.feed(text).add(parser.finish())
