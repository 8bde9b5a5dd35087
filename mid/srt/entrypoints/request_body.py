"""Reading a request's JSON body: bounded in size, parsed off the event loop, checked before anything runs.

Every POST route reads its body through `read_json_object`, or (the generation routes, which parse on their
worker thread) `read_body` then `parse_json_object`, so a body that is too large, too deep, holds a
number JSON cannot carry (NaN, Infinity, 1e999) or a string that is not valid Unicode (a lone surrogate
escape such as "\\ud800") is refused with a 4xx naming the top-level field, before any model work, and the
event loop that answers `/health` and every other stream never waits on a big body's parse.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from fastapi import Request

from srt.entrypoints.openai.response_parts import RequestError

MAX_JSON_DEPTH = 64  # chat messages with tool schemas nest ~10 deep; 100,000-deep arrays are an attack
PARSE_INLINE_BYTES = 64 * 1024  # smaller bodies parse on the loop: a thread hop would cost more than the parse


class BodyTooLarge(RequestError):
    """A body over --max-request-body-mb: HTTP 413."""

    status_code = 413


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a checked JSON object; RequestError (400, 413 for size) naming what is wrong."""
    raw = await read_body(request, max_bytes)
    if len(raw) <= PARSE_INLINE_BYTES:
        return parse_json_object(raw)
    return await asyncio.to_thread(parse_json_object, raw)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body's bytes, for `parse_json_object` on a worker thread; BodyTooLarge (413) past `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():  # a body sent without Content-Length is counted as it arrives
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """`raw` parsed and checked (depth, finite numbers, valid Unicode); RequestError naming the field."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep(None) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}", code="invalid_json") from None
    except ValueError as error:  # e.g. an integer of more than 4300 digits
        raise RequestError(f"the request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key, value in body.items():
        _check_value(key, value)
    return body


def _check_value(field: str, value: Any) -> None:
    """Walk one top-level field without recursion (the depth check must not itself overflow the stack)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(field)
        if isinstance(item, str):
            _check_text(field, item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise RequestError(f"{field} must hold finite numbers, got {item!r}", param=field)
        elif isinstance(item, dict):
            for key, inner in item.items():
                _check_text(field, key)
                stack.append((inner, depth + 1))
        elif isinstance(item, list):
            if all(type(inner) is int for inner in item):
                continue  # token ids: nothing to check, and 8k of them would cost ~2 ms one by one
            stack.extend((inner, depth + 1) for inner in item)


def _check_text(field: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(
            f"{field} must be valid Unicode: it holds a lone surrogate ({text[error.start]!r} at character "
            f"{error.start})",
            param=field,
        ) from None


def _too_large(size: int, max_bytes: int) -> BodyTooLarge:
    return BodyTooLarge(
        f"the request body is {size} bytes, more than this server accepts ({max_bytes} bytes; --max-request-body-mb)",
        code="request_too_large",
    )


def _too_deep(field: str | None) -> RequestError:
    where = field if field is not None else "the request body"
    return RequestError(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep", param=field)
