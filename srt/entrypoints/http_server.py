"""The HTTP server: FastAPI routes over one TokenizerManager, served by uvicorn.

Routes: POST /generate (SGLang's native API), POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
/health, /health_generate, /metrics (Prometheus), /server_info, and vLLM's POST /tokenize, POST /detokenize,
GET /tokenizer_info. Every bad request gets HTTP 400 (413 for a body over --max-request-body-mb) with an
OpenAI-style error body and the server carries on; a client that disconnects has its requests aborted.
Bodies are read and parsed by `request_body` and tokenized on one worker thread, so a large request never
holds up the event loop that serves everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, error_body
from srt.entrypoints.openai.response_parts import SSE_DONE, RequestError, now, param_of, sse
from srt.entrypoints.openai.serving_chat import ChatRun
from srt.entrypoints.openai.serving_completions import CompletionRun
from srt.entrypoints.openapi_schema import document_routes
from srt.entrypoints.processes import ServingProcesses, launch_processes
from srt.entrypoints.request_body import read_json_object
from srt.entrypoints.tokenizer_routes import add_tokenizer_routes
from srt.managers.generate_input import GenerateReqInput
from srt.managers.tokenizer_loader import load_tokenizer
from srt.managers.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0
SHUTDOWN_GRACE_S = 5  # open streams get this long to finish once SIGTERM arrives
T = TypeVar("T")


def create_app(tm: TokenizerManager) -> FastAPI:
    """The FastAPI app; the manager is started and closed with the app's lifespan."""

    # One thread tokenizes (and builds) every request: the event loop stays free, and the tokenizer, which
    # is not safe to share between threads, is only ever used by one of them for encoding.
    tokenize_thread = ThreadPoolExecutor(1, thread_name_prefix="srt-tokenize")
    max_body_bytes = int(tm.server_args.max_request_body_mb * 1024 * 1024)

    async def off_loop(build: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(tokenize_thread, build, *args)

    async def json_body(request: Request) -> dict[str, Any]:
        return await read_json_object(request, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        yield
        await tm.close()
        tokenize_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="srt", lifespan=lifespan)

    @app.exception_handler(ValueError)
    async def bad_request(request: Request, error: ValueError) -> JSONResponse:
        param = error.param if isinstance(error, RequestError) else param_of(str(error))
        code = error.code if isinstance(error, RequestError) else None
        status = getattr(error, "status_code", 400)
        return JSONResponse(error_body(str(error), param, code), status_code=status)

    @app.exception_handler(pydantic.ValidationError)
    async def invalid_body(request: Request, error: pydantic.ValidationError) -> JSONResponse:
        return JSONResponse(error_body(*_describe(error)), status_code=400)

    @app.exception_handler(RuntimeError)
    async def unavailable(request: Request, error: RuntimeError) -> JSONResponse:
        body = error_body(str(error))
        body["error"]["type"] = "server_error"
        return JSONResponse(body, status_code=503)

    @app.exception_handler(ConnectionAbortedError)
    async def client_gone(request: Request, error: ConnectionAbortedError) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if tm.dead else 200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Healthy only if a one-token generation completes."""
        obj = GenerateReqInput(input_ids=[tm.info.eos_token_ids[0]], sampling_params={"max_new_tokens": 1})
        try:
            await asyncio.wait_for(tm.generate_all(obj), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await tm.scheduler_stats(timeout=5.0)
        except asyncio.TimeoutError:
            stats = None  # the scheduler is busy with a long step: report what this process knows
        return Response(tm.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        return await tm.get_server_info()

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": tm.model_name, "object": "model", "created": now(), "owned_by": "srt"}
        card.update(root=tm.server_args.model_path, max_model_len=tm.info.context_len)
        return {"object": "list", "data": [card]}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await json_body(request)
        known = GenerateReqInput.__dataclass_fields__
        unknown = sorted(set(body) - set(known))
        if unknown:
            raise RequestError(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
        obj = GenerateReqInput(**body)
        prepared = await off_loop(tm.prepare, obj)
        if obj.stream:
            return _sse(_generate_stream(tm, obj, prepared))
        return JSONResponse(obj.answer(await tm.generate_all(obj, request.is_disconnected, prepared)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = CompletionRequest.model_validate(await json_body(request))
        return await _respond(await off_loop(CompletionRun, tm, body), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = ChatCompletionRequest.model_validate(await json_body(request))
        return await _respond(await off_loop(ChatRun, tm, body), request)

    add_tokenizer_routes(app, tm, json_body, off_loop)
    document_routes(app)
    return app


def _describe(error: pydantic.ValidationError) -> tuple[str, str | None]:
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"]]
    where = ".".join(loc)
    return (f"{where}: {first['msg']}" if where else first["msg"]), (loc[0] if loc else None)


async def _respond(run: CompletionRun | ChatRun, request: Request) -> Response:
    """A checked OpenAI request's reply: an SSE stream, or one JSON body (aborted if the client leaves)."""
    if run.request.stream:
        return _sse(run.stream())
    return JSONResponse(await run.response(request.is_disconnected))


async def _generate_stream(tm: TokenizerManager, obj: GenerateReqInput, prepared: list) -> AsyncIterator[str]:
    chunks = tm.generate(obj, prepared=prepared)
    try:
        async for index, chunk in chunks:
            yield sse(obj.stream_chunk(index, chunk))
        yield SSE_DONE
    finally:
        await chunks.aclose()  # a client that went away aborts what is still running


def _sse(stream: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def check_port_free(host: str, port: int) -> None:
    """RuntimeError if HTTP could not listen on host:port: said before the model loads (minutes), not after."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as error:
            raise RuntimeError(
                f"cannot listen on {host}:{port}: {error.strerror} (another server there? pick another --port)"
            ) from None


def launch_server(server_args: ServerArgs) -> None:
    """Start the processes, serve HTTP until SIGTERM / SIGINT, then stop every child."""
    check_port_free(server_args.host, server_args.port)
    processes: ServingProcesses = launch_processes(server_args)
    try:
        tokenizer = load_tokenizer(server_args)
        tm = TokenizerManager(server_args, processes.port_args, processes.info, tokenizer, processes.problem)
        config = uvicorn.Config(
            create_app(tm),
            host=server_args.host,
            port=server_args.port,
            log_level=server_args.log_level,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        logger.info("serving %s on http://%s:%d", tm.model_name, server_args.host, server_args.port)
        uvicorn.Server(config).run()
    finally:
        processes.shutdown()
