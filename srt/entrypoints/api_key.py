"""`--api-key`: every route but the health checks and metrics asks for `Authorization: Bearer KEY`.

A plain ASGI middleware (not FastAPI's `@app.middleware`, which wraps every response, streams included): a
request without the key is answered 401 with an OpenAI-style error before any route sees it; the rest pass
through untouched. The comparison takes the same time wherever the keys differ.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse

from srt.entrypoints.openai.protocol import error_body

# what load balancers and Prometheus poll without credentials, as with SGLang's and vLLM's keys
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


class ApiKeyCheck:
    """ASGI middleware: 401 unless the request carries `Authorization: Bearer <key>` (or asks an OPEN_PATHS route)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        message = "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
        body = error_body(message, code="invalid_api_key")
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
