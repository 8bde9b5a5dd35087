"""The OpenAPI document of the HTTP server, with every POST route's request body and its error responses.

The routes read their bodies themselves (`request_body.read_json_object`: size limit, parse off the event loop),
so FastAPI cannot see the body models in their signatures; they are added here, from the same models that
validate the bodies, so the document cannot drift from what the server accepts. Fuzzers (schemathesis, the
tests' hypothesis run) generate requests from it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter

from srt import __version__
from srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from srt.entrypoints.tokenizer_routes import DetokenizeRequest, TokenizeRequest
from srt.managers.generate_input import GenerateReqInput
from srt.sampling.sampling_params import SamplingParams

REF = "#/components/schemas/{model}"
BODIES: dict[str, Any] = {
    "/generate": GenerateReqInput,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"], "description": "the request field to blame"},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
ERRORS = {
    "400": "Bad request: the error names the field (`param`).",
    "413": "The body is larger than --max-request-body-mb.",
    "503": "The server cannot serve: a process it runs died.",
}
# generation routes only: admission control (srt/managers/admission.py)
OVERLOADED = (
    "Overloaded, with a Retry-After header: the queue is full (code `queue_full`), or the request waited past "
    "--request-timeout (code `queue_timeout`)."
)
GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


def document_routes(app: FastAPI) -> None:
    """Make `app.openapi()` describe each POST route's body and its 400 / 413 / 429 / 503 answers."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_document(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=__version__, routes=app.routes)
    components = document.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ERROR_SCHEMA
    error_ref = {"$ref": REF.format(model="ErrorResponse")}
    for path, model in BODIES.items():
        operation = document["paths"][path]["post"]
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _register(model, components)}},
        }
        errors = {**ERRORS, "429": OVERLOADED} if path in GENERATION_PATHS else ERRORS
        for status, description in sorted(errors.items()):
            content = {"application/json": {"schema": error_ref}}
            operation["responses"][status] = {"description": description, "content": content}
    return document


def _register(model: Any, components: dict[str, Any]) -> dict[str, str]:
    """Put `model`'s schema (and the schemas it refers to) into `components`; return a reference to it."""
    adapter = TypeAdapter(model)
    schema = adapter.json_schema(ref_template=REF)
    components.update(schema.pop("$defs", {}))
    if model is GenerateReqInput:
        schema["properties"]["sampling_params"] = _sampling_params_schema(components)
    name = model.__name__
    components[name] = schema
    return {"$ref": REF.format(model=name)}


def _sampling_params_schema(components: dict[str, Any]) -> dict[str, Any]:
    """/generate's `sampling_params` is a plain dict in Python; document what it holds: SamplingParams."""
    ref = _register(SamplingParams, components)
    return {"anyOf": [ref, {"type": "array", "items": ref}, {"type": "null"}], "default": None}
