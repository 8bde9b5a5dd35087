"""vLLM's tokenizer routes, so clients (lm-eval's `remote` tokenizer backend among them) use the server's own
tokenizer instead of loading a copy that may tokenize differently:

    POST /tokenize        {"prompt": str, "add_special_tokens": true} or {"messages": [...]}
                          -> {"tokens": [...], "count": n, "max_model_len": n, "token_strs": [...] | null}
    POST /detokenize      {"tokens": [...]} -> {"prompt": str}
    GET  /tokenizer_info  the tokenizer's class and special tokens, its chat template, the context length

A text prompt is tokenized exactly as a generation request's is (`TokenizerManager.encode_text`: one `<bos>`,
never two).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from srt.entrypoints.openai.protocol import ChatMessage
from srt.entrypoints.openai.response_parts import RequestError, check_model
from srt.entrypoints.openai.serving_chat import apply_chat_template
from srt.managers.tokenizer_manager import TokenizerManager


class TokenizeRequest(BaseModel):
    """A text prompt, or chat messages rendered by the chat template first (as vLLM's /tokenize)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt; False for messages (the template adds <bos>)
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]


def add_tokenizer_routes(
    app: FastAPI,
    tm: TokenizerManager,
    json_body: Callable[[Request], Awaitable[dict[str, Any]]],
    off_loop: Callable[..., Awaitable[Any]],
) -> None:
    """Register the three routes on `app`; bodies are read by `json_body`, tokenizer work runs in `off_loop`."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = TokenizeRequest.model_validate(await json_body(request))
        if body.model is not None:
            check_model(tm, body.model)
        tokens = await off_loop(_tokenize, tm, body)
        strs = tm.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": tm.info.context_len, "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = DetokenizeRequest.model_validate(await json_body(request))
        if body.model is not None:
            check_model(tm, body.model)
        vocab = tm.info.vocab_size
        if any(not 0 <= tok < vocab for tok in body.tokens):
            raise RequestError(f"tokens must be token ids in [0, {vocab})", param="tokens")
        return {"prompt": await off_loop(tm.tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        tokenizer = tm.tokenizer
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_ids": list(tm.info.eos_token_ids),
            "chat_template": tokenizer.chat_template,
            "model_max_length": tm.info.context_len,
            "vocab_size": tm.info.vocab_size,
        }


def _tokenize(tm: TokenizerManager, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("exactly one of prompt and messages must be given", param="prompt")
    if body.prompt is not None:
        field, text = "prompt", body.prompt
        add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
    else:
        field, text = "messages", apply_chat_template(tm.tokenizer, body.messages, {})
        add_special_tokens = bool(body.add_special_tokens)
    try:
        return tm.encode_text(text, add_special_tokens)
    except ValueError as error:
        raise RequestError(str(error), param=field) from None
