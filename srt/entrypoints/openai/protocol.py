"""Pydantic models of the OpenAI-compatible API (requests are strict: a wrong type is a 400, not a guess).

Only requests are modelled; responses are built as plain dicts in the serving modules, in the shapes of
OpenAI's API reference. Fields beyond OpenAI's (top_k, min_p, repetition_penalty, ignore_eos, ...) are
SGLang's extensions with SGLang's names.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI documents at most 5 for completions and 20 for chat; both accept up to 20 here.
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingExtensions(BaseModel):
    """Sampling knobs both endpoints share, OpenAI's and SGLang's."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> added to its logit, in [-100, 100]
    # SGLang extensions
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    # srt's: every streamed chunk carries "emit_ts" (response_parts.emit_ts), for measuring where tokens wait
    return_emit_ts: bool = False

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        """SamplingParams fields for this request (validated later, by SamplingParams itself)."""
        return {
            "max_new_tokens": max_tokens,
            "min_new_tokens": self.min_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "n": self.n,
            "logit_bias": self.logit_bias,
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingExtensions):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None  # OpenAI's insertion mode: Gemma 4 has none, so a suffix is refused, not dropped
    best_of: int | None = None  # OpenAI's legacy server-side n: refused above 1, not silently ignored


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string


class ToolCallMessage(BaseModel):
    """A call in an earlier assistant message."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer
    reasoning_content: str | None = None  # assistant messages (kept for a turn that called tools)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingExtensions):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": true}
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    separate_reasoning: bool = True  # SGLang's: False leaves the thought channel in the content
    # vLLM's: the image and video processors' settings, e.g. {"max_soft_tokens": 70, "num_frames": 8}
    mm_processor_kwargs: dict[str, Any] | None = None


def error_body(message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
