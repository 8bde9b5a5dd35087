"""Streamed answers (server-sent events) and the error answers every route shares.

A stream's headers go out as soon as the request is admitted, before it leaves the queue. Once they are
out, an error can no longer change the status, so it ends the stream as an event instead of cutting it:

    data: {"error": {"message": ..., "type": ..., "code": ...}}
    data: [DONE]

(the openai client raises an APIError on such an event, as vLLM and SGLang send them).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from srt.entrypoints.openai.protocol import error_body
from srt.entrypoints.openai.response_parts import SSE_DONE, RequestError, param_of, sse
from srt.managers.admission import Overloaded, Ticket

logger = logging.getLogger(__name__)


def error_response(error: Exception) -> JSONResponse:
    """The OpenAI-style error answer to `error`: 400 (or its status_code) for bad input, 429 with Retry-After
    when overloaded, 503 when a serving process died."""
    body, status = _error_of(error)
    headers = {"Retry-After": str(error.retry_after)} if isinstance(error, Overloaded) else None
    return JSONResponse(body, status_code=status, headers=headers)


def _error_of(error: Exception) -> tuple[dict, int]:
    if isinstance(error, Overloaded):
        body = error_body(str(error), code=error.code)
        body["error"]["type"] = "overloaded_error"
        return body, 429
    if isinstance(error, ValueError):
        param = error.param if isinstance(error, RequestError) else param_of(str(error))
        code = error.code if isinstance(error, RequestError) else None
        return error_body(str(error), param, code), getattr(error, "status_code", 400)
    body = error_body(str(error) or type(error).__name__)
    body["error"]["type"] = "server_error"
    return body, 503


class _AdmittedStream(StreamingResponse):
    """A streaming response that gives its admission ticket back when it ends, however it ends (even when
    the client left before the stream's first piece was asked for)."""

    def __init__(self, content: AsyncIterator[str], ticket: Ticket | None) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.ticket is not None:
                self.ticket.release()


def sse_response(stream: AsyncIterator[str], ticket: Ticket | None = None) -> StreamingResponse:
    """`stream`'s events, ended by an error event if it raises; `ticket` released when the response ends."""
    return _AdmittedStream(_with_error_event(stream), ticket)


async def _with_error_event(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for piece in stream:
            yield piece
    except Exception as error:  # noqa: BLE001 - every failure becomes an event: silence is the one wrong answer
        if not isinstance(error, (ValueError, Overloaded, RuntimeError)):
            logger.exception("a stream failed")
        yield sse(_error_of(error)[0])
        yield SSE_DONE
    finally:
        await stream.aclose()  # type: ignore[attr-defined] - a client that went away aborts what still runs
