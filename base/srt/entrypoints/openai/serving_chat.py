"""`POST /v1/chat/completions`: messages -> the checkpoint's chat template -> the model's reply.

The template's text already starts with `<bos>`, so it is tokenized without adding special tokens again.
Without `max_tokens` (or `max_completion_tokens`) a reply may run to the end of the context.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import cache

import jinja2

from srt.entrypoints.openai.chat_features import ChatDelta, ChatFeatures, ChatOutputParser, parse_reply
from srt.entrypoints.openai.chat_images import chat_media_urls, media_kind
from srt.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ToolCallMessage
from srt.entrypoints.openai.response_parts import (
    SSE_DONE,
    RequestError,
    check_model,
    emit_ts,
    finish_reason,
    matched_stop,
    new_id,
    now,
    openai_error,
    sse,
    usage,
)
from srt.managers.generate_input import GenerateReqInput
from srt.managers.generate_output import TokenTexts
from srt.managers.tokenizer_manager import TokenizerManager


class ChatRun:
    """One checked chat request, ready to run as a whole response or as an SSE stream."""

    def __init__(self, tm: TokenizerManager, request: ChatCompletionRequest) -> None:
        check_model(tm, request.model)
        self.tm, self.request = tm, request
        self.features = ChatFeatures.of(request, tm.server_args, tm.tokenizer.chat_template)
        prompt = apply_chat_template(
            tm.tokenizer, request.messages, request.chat_template_kwargs or {}, self.features.tools
        )
        images, videos = chat_media_urls(request.messages)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        self.obj = GenerateReqInput(
            text=prompt,
            sampling_params={**request.sampling_params(max_tokens), **self.features.sampling_overrides()},
            return_logprob=request.logprobs,
            top_logprobs_num=(request.top_logprobs or 0) if request.logprobs else 0,
            stream=request.stream,
            add_special_tokens=False,
            return_emit_ts=request.return_emit_ts,
            image_data=images or None,
            video_data=videos or None,
            mm_processor_kwargs=request.mm_processor_kwargs,
        )
        try:
            self.prepared = tm.prepare(self.obj)
        except ValueError as error:
            problem = openai_error(error)
            if problem.param == "prompt":  # the prompt a chat request has is its messages
                problem.param = "messages"
            raise problem from None
        self.id, self.created = new_id("chatcmpl"), now()

    async def response(self, is_disconnected: Callable[[], Awaitable[bool]] | None) -> dict:
        results = await self.tm.generate_all(self.obj, is_disconnected, self.prepared)
        choices = []
        for index, result in enumerate(results):
            meta = result["meta_info"]
            reply = parse_reply(self._parser(), result["text"])
            message = {"role": "assistant", "content": reply.content if reply.content or not reply.calls else None}
            if self.features.parse_reasoning:
                message["reasoning_content"] = reply.reasoning or None
            if reply.calls:
                message["tool_calls"] = [call.to_openai() for call in reply.calls]
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": self._logprobs(meta),
                    "finish_reason": _finish_reason(meta, bool(reply.calls)),
                    "matched_stop": matched_stop(meta),
                }
            )
        metas = [r["meta_info"] for r in results]
        return {**self._envelope("chat.completion"), "choices": choices, "usage": usage(metas, self.request.n)}

    async def stream(self) -> AsyncIterator[str]:
        metas: list[dict] = [{}] * len(self.prepared)
        extra = {"usage": None} if self.request.include_usage else {}
        envelope = {**self._envelope("chat.completion.chunk"), **extra}
        for index in range(len(self.prepared)):  # OpenAI opens every choice with the role alone
            opening = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            yield sse({**envelope, "choices": [{**opening, "finish_reason": None}]})
        parsers = [self._parser() for _ in self.prepared]
        chunks = self.tm.generate(self.obj, prepared=self.prepared)
        try:
            async for index, chunk in chunks:
                meta = metas[index] = chunk["meta_info"]
                reason = finish_reason(meta)
                parser = parsers[index]
                part = parser.feed(chunk["text"])
                if reason is not None:
                    part = part.add(parser.finish())
                delta = _delta(part)
                if not delta and reason is None and not (self.request.logprobs and chunk["output_ids"]):
                    continue  # tokens held back (half a character, a stop string, a marker): nothing to show yet
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": self._logprobs(meta),
                    "finish_reason": _finish_reason(meta, parser.num_calls > 0),
                }
                if reason is not None:
                    choice["matched_stop"] = matched_stop(meta)
                payload = {**envelope, "choices": [choice]}
                if self.request.return_emit_ts:
                    payload["emit_ts"] = emit_ts(meta)
                yield sse(payload)
            if self.request.include_usage:
                yield sse({**envelope, "choices": [], "usage": usage(metas, self.request.n)})
            yield SSE_DONE
        finally:
            await chunks.aclose()  # a client that went away aborts what is still running

    def _parser(self) -> ChatOutputParser:
        keep = not self.request.skip_special_tokens
        return self.features.output_parser(special_tokens(self.tm.tokenizer), keep)

    def _envelope(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.tm.model_name}

    def _logprobs(self, meta: dict) -> dict | None:
        if not self.request.logprobs:
            return None
        entries = meta["output_token_logprobs"]
        tops = meta.get("output_top_logprobs") or [[] for _ in entries]
        texts = self.tm.token_texts
        content = []
        for (logprob, token_id, _), top in zip(entries, tops):
            item = _token_entry(texts, token_id, logprob)
            item["top_logprobs"] = [_token_entry(texts, tid, value) for value, tid, _ in top or []]
            content.append(item)
        return {"content": content}


def _delta(part: ChatDelta) -> dict:
    """An OpenAI stream delta of what a piece of the reply adds."""
    delta: dict = {}
    if part.reasoning:
        delta["reasoning_content"] = part.reasoning
    if part.content:
        delta["content"] = part.content
    if part.calls:
        delta["tool_calls"] = [call.to_delta() for call in part.calls]
    return delta


def _finish_reason(meta: dict, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when a reply that stopped by itself called tools."""
    reason = finish_reason(meta)
    return "tool_calls" if reason == "stop" and called else reason


@cache
def special_tokens(tokenizer) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens (control tokens such as <turn|> included)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    texts = {token.content for token in added.values() if token.special} | set(tokenizer.all_special_tokens)
    return tuple(sorted(texts))


def _token_entry(texts: TokenTexts, token_id: int, logprob: float) -> dict:
    return {"token": texts.text(token_id), "logprob": logprob, "bytes": list(texts.bytes(token_id))}


def apply_chat_template(tokenizer, messages: list[ChatMessage], kwargs: dict, tools: list[dict] | None = None) -> str:
    """The prompt text of `messages` (and `tools`); RequestError naming `messages` for what the template cannot
    take. Calls' JSON arguments go to the template as objects, which it writes in the model's notation."""
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    conversation = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                part = part if isinstance(part, dict) else part.model_dump()
                kind = media_kind(part)
                if kind is not None:
                    parts.append({"type": kind})
                    continue
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(
                        f"messages[{i}].content: only text, image_url and video_url parts are supported,"
                        f" got {part.get('type')!r}",
                        param="messages",
                    )
                parts.append({"type": "text", "text": part["text"]})
            content = parts
        turn = {"role": message.role, "content": content if content is not None else ""}
        if message.tool_calls:
            turn["tool_calls"] = [_call_of(call, f"messages[{i}]") for call in message.tool_calls]
        for name in ("tool_call_id", "name", "reasoning_content"):
            if getattr(message, name) is not None:
                turn[name] = getattr(message, name)
        conversation.append(turn)
    if tokenizer.chat_template is None:
        raise RequestError("this model has no chat template; use /v1/completions", param="messages")
    try:
        return tokenizer.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except (jinja2.TemplateError, ValueError, TypeError) as error:
        raise RequestError(f"messages cannot be formatted by the chat template: {error}", param="messages") from None


def _call_of(call: ToolCallMessage, where: str) -> dict:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise RequestError(f"{where}: tool call arguments are not JSON: {error}", param="messages") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}: tool call arguments must be a JSON object", param="messages")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
