"""Pieces the completions and chat endpoints share: errors, SSE framing, usage, finish reasons."""

from __future__ import annotations

import json
import re
import time
import uuid

from srt.managers.tokenizer_manager import TokenizerManager

SSE_DONE = "data: [DONE]\n\n"

# Internal field names in error messages -> the names an OpenAI client sent.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "input_ids": "prompt"}
_FIELD_AT_START = re.compile(r"^([a-z_]+) (must|has|is|are)\b")


class RequestError(ValueError):
    """A bad request, with the request field (`param`) to blame."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def openai_error(error: ValueError) -> RequestError:
    """A ValueError from the runtime, in the API's terms: field names as the client spelled them."""
    if isinstance(error, RequestError):
        return error
    message = str(error)
    for internal, public in _OPENAI_NAMES.items():
        message = message.replace(internal, public)
    if message.startswith("text "):  # /generate's `text` is the OpenAI routes' `prompt`
        message = "prompt " + message.removeprefix("text ")
    return RequestError(message, param_of(message))


def param_of(message: str) -> str | None:
    """The field a runtime error message starts with ("temperature must be >= 0, ..." -> "temperature")."""
    match = _FIELD_AT_START.match(message)
    return match.group(1) if match else None


def check_model(tokenizer_manager: TokenizerManager, model: str) -> None:
    if model != tokenizer_manager.model_name:
        raise RequestError(
            f"model {model!r} is not served here; this server serves {tokenizer_manager.model_name!r}",
            param="model",
            code="model_not_found",
        )


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def emit_ts(meta: dict) -> dict[str, float]:
    """A streamed chunk's `emit_ts`: when its tokens left the scheduler, the detokenizer and the tokenizer
    manager (io_struct.EmitTimes), and "sse": now, as the chunk is written (wall-clock seconds)."""
    return {**meta["emit_ts"], "sse": time.time()}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else reason["type"]


def matched_stop(meta: dict) -> int | str | None:
    reason = meta.get("finish_reason") or {}
    return reason.get("matched") if reason.get("type") == "stop" else None


def usage(metas: list[dict], n: int) -> dict:
    """Token counts of a request whose outputs (prompt-major, n per prompt) finished with `metas`.

    Each prompt counts once however many samples were drawn from it, as in OpenAI's API.
    """
    prompt = sum(meta["prompt_tokens"] for meta in metas[::n])
    cached = sum(meta["cached_tokens"] for meta in metas[::n])
    completion = sum(meta["completion_tokens"] for meta in metas)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
