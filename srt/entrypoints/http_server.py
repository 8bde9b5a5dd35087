"""The HTTP server: FastAPI routes over one TokenizerManager, served by uvicorn.

Routes: POST /generate (SGLang's native API), POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
/health, /health_generate, /metrics (Prometheus), /server_info, /flush_cache (vLLM's /reset_prefix_cache),
/abort_request, /version, /get_model_info, and vLLM's POST /tokenize, POST /detokenize, GET /tokenizer_info.
Every bad request gets HTTP 400 (413 for a body over --max-request-body-mb) with an OpenAI-style error body and
the server carries on; a client that disconnects has its requests aborted.
Generation bodies are read by `request_body`, then parsed, checked and tokenized in one hop to one worker
thread, first come first served: a large request never holds up the event loop that serves everyone else, and
of requests that come together the first reaches the scheduler first (with the parse on the loop, 8 prompts of
8k ids interleaved their stages and all reached it ~20 ms later on a 2-core CPU). Generation requests beyond
--max-running-requests + --max-queued-requests get 429 with Retry-After (`managers/admission.py`). When the
scheduler or detokenizer dies, every open request gets an error at once, /health answers 503, and with
--exit-on-child-death (the default) the server stops and exits with status 1. With --api-key every route but
/health, /health_generate and /metrics answers 401 to a request without the key (`api_key.py`).
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
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from srt import __version__
from srt.entrypoints.api_key import ApiKeyCheck
from srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, error_body
from srt.entrypoints.openai.response_parts import SSE_DONE, RequestError, now, sse
from srt.entrypoints.openai.serving_chat import ChatRun
from srt.entrypoints.openai.serving_completions import CompletionRun
from srt.entrypoints.openapi_schema import document_routes
from srt.entrypoints.processes import ServingProcesses, launch_processes
from srt.entrypoints.request_body import parse_json_object, read_body, read_json_object
from srt.entrypoints.sse_response import error_response, sse_response
from srt.entrypoints.tokenizer_routes import add_tokenizer_routes
from srt.managers.admission import Admission, Overloaded, Ticket
from srt.managers.generate_input import GenerateReqInput
from srt.managers.tokenizer_loader import load_tokenizer
from srt.managers.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0
SHUTDOWN_GRACE_S = 5  # open streams get this long to finish once SIGTERM arrives
T = TypeVar("T")


def create_app(tm: TokenizerManager, watch_children: Callable[[], Callable[[], None]] | None = None) -> FastAPI:
    """The FastAPI app; the manager is started and closed with the app's lifespan. `watch_children`, called
    on the running loop, starts watching the serving processes and returns what stops it."""

    # One thread tokenizes (and builds) every request: the event loop stays free, and the tokenizer, which
    # is not safe to share between threads, is only ever used by one of them for encoding.
    tokenize_thread = ThreadPoolExecutor(1, thread_name_prefix="srt-tokenize")
    max_body_bytes = int(tm.server_args.max_request_body_mb * 1024 * 1024)
    admission = Admission(tm.server_args)

    async def off_loop(build: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(tokenize_thread, build, *args)

    async def json_body(request: Request) -> dict[str, Any]:
        return await read_json_object(request, max_body_bytes)

    async def built(request: Request, build: Callable[[dict[str, Any]], T]) -> T:
        """`build(the parsed body)` with the parse on the tokenize thread too (one hop, in arrival order)."""
        raw = await read_body(request, max_body_bytes)
        return await off_loop(lambda: build(parse_json_object(raw)))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        stop_watching = watch_children() if watch_children is not None else None
        yield
        if stop_watching is not None:
            stop_watching()
        await tm.close()
        tokenize_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="srt", lifespan=lifespan)
    if tm.server_args.api_key is not None:
        app.add_middleware(ApiKeyCheck, key=tm.server_args.api_key)

    @app.exception_handler(ValueError)
    async def bad_request(request: Request, error: ValueError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, error: Overloaded) -> JSONResponse:
        if error.code == "queue_full":
            tm.metrics.refused()
        return error_response(error)

    @app.exception_handler(pydantic.ValidationError)
    async def invalid_body(request: Request, error: pydantic.ValidationError) -> JSONResponse:
        return JSONResponse(error_body(*_describe(error)), status_code=400)

    @app.exception_handler(RuntimeError)
    async def unavailable(request: Request, error: RuntimeError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(ConnectionAbortedError)
    async def client_gone(request: Request, error: ConnectionAbortedError) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while serving, its body saying whether new requests are being refused ("overloaded"); 503
        only when the server cannot serve at all (a serving process died)."""
        if tm.dead:
            return JSONResponse({"status": "failed", "message": tm.dead}, status_code=503)
        load = {"in_flight": admission.in_flight, "queued": admission.queued, "max_in_flight": admission.limit}
        return JSONResponse({"status": "overloaded" if admission.full else "ok", **load})

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
        except (asyncio.TimeoutError, RuntimeError):
            stats = None  # the scheduler is busy with a long step, or gone: report what this process knows
        return Response(tm.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        return await tm.get_server_info()

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/get_model_info")
    async def model_info() -> dict:
        """SGLang's: what is served, from where."""
        args = tm.server_args
        return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path or args.model_path,
                "served_model_name": tm.model_name, "is_generation": True}  # fmt: skip

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict:
        """SGLang's: {"rid": ...} stops that request, {"abort_all": true} every one in flight; each ends its own
        response with finish reason "abort" and what it generated so far."""
        body = await json_body(request)
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not isinstance(abort_all, bool) or (rid is None) == (not abort_all) or not isinstance(rid, str | None):
            raise RequestError("give either a string rid or abort_all: true", param="rid")
        return {"aborted": tm.abort_request(rid)}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @app.post("/reset_prefix_cache")
    async def flush_cache() -> JSONResponse:
        """SGLang's /flush_cache (vLLM's /reset_prefix_cache): drop every cached prefix while nothing runs."""
        flushed = await tm.flush_cache()
        if flushed is None:
            message = "requests are running or waiting: the cache was not flushed (retry once the server is idle)"
            return JSONResponse(error_body(message, code="server_busy"), status_code=400)
        return JSONResponse({"flushed_tokens": flushed})

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": tm.model_name, "object": "model", "created": now(), "owned_by": "srt"}
        card.update(root=tm.server_args.model_path, max_model_len=tm.info.context_len)
        return {"object": "list", "data": [card]}

    def prepared_generate(body: dict[str, Any]) -> tuple[GenerateReqInput, list]:
        unknown = sorted(set(body) - set(GenerateReqInput.__dataclass_fields__))
        if unknown:
            raise RequestError(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
        obj = GenerateReqInput(**body)
        return obj, tm.prepare(obj)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        admission.check()  # a full server refuses before reading the body
        obj, prepared = await built(request, prepared_generate)
        ticket = admission.admit(len(prepared))
        if obj.stream:
            return sse_response(_generate_stream(tm, obj, prepared), ticket)
        try:
            return JSONResponse(obj.answer(await tm.generate_all(obj, request.is_disconnected, prepared)))
        finally:
            ticket.release()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        admission.check()
        run = await built(request, lambda body: CompletionRun(tm, CompletionRequest.model_validate(body)))
        return await _respond(run, request, admission.admit(len(run.prepared)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        admission.check()
        run = await built(request, lambda body: ChatRun(tm, ChatCompletionRequest.model_validate(body)))
        return await _respond(run, request, admission.admit(len(run.prepared)))

    add_tokenizer_routes(app, tm, json_body, off_loop)
    document_routes(app)
    return app


def _describe(error: pydantic.ValidationError) -> tuple[str, str | None]:
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"]]
    where = ".".join(loc)
    return (f"{where}: {first['msg']}" if where else first["msg"]), (loc[0] if loc else None)


async def _respond(run: CompletionRun | ChatRun, request: Request, ticket: Ticket) -> Response:
    """A checked OpenAI request's reply: an SSE stream, or one JSON body (aborted if the client leaves)."""
    if run.request.stream:
        return sse_response(run.stream(), ticket)
    try:
        return JSONResponse(await run.response(request.is_disconnected))
    finally:
        ticket.release()


async def _generate_stream(tm: TokenizerManager, obj: GenerateReqInput, prepared: list) -> AsyncIterator[str]:
    chunks = tm.generate(obj, prepared=prepared)
    try:
        async for index, chunk in chunks:
            yield sse(obj.stream_chunk(index, chunk))
        yield SSE_DONE
    finally:
        await chunks.aclose()  # a client that went away aborts what is still running


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
    """Start the processes, serve HTTP until SIGTERM / SIGINT, then stop every child. RuntimeError after the
    server stopped because a child died (--exit-on-child-death)."""
    check_port_free(server_args.host, server_args.port)
    processes: ServingProcesses = launch_processes(server_args)
    deaths: list[str] = []
    try:
        tokenizer = load_tokenizer(server_args)
        tm = TokenizerManager(server_args, processes.port_args, processes.info, tokenizer, processes.problem)

        def on_child_death(problem: str) -> None:
            tm.fail_all(problem)
            if server_args.exit_on_child_death:
                deaths.append(problem)
                server.should_exit = True  # uvicorn stops listening and lets the errored responses finish

        config = uvicorn.Config(
            create_app(tm, lambda: processes.watch(asyncio.get_running_loop(), on_child_death)),
            host=server_args.host,
            port=server_args.port,
            log_level=server_args.log_level,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        logger.info("serving %s on http://%s:%d", tm.model_name, server_args.host, server_args.port)
        server = uvicorn.Server(config)
        server.run()
    finally:
        processes.shutdown()
    if deaths:
        raise RuntimeError(f"{deaths[0]}; the server stopped (--exit-on-child-death)")
