"""`srt.Engine`: the serving runtime embedded in a Python program, without HTTP.

    with Engine(model_path="google/gemma-4-E4B-it") as engine:
        out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 16})
        print(out["text"], out["meta_info"]["completion_tokens"])

It runs the same processes as the HTTP server (scheduler, detokenizer) and a TokenizerManager on an event
loop in a background thread, so that both blocking calls (`generate`) and coroutines of any other event
loop (`async_generate`) can use it. Results are the dicts of `/generate` (see srt/managers/generate_output.py).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

from srt.entrypoints.model_source import resolve_model_path
from srt.entrypoints.processes import ServingProcesses, launch_processes
from srt.managers.generate_input import GenerateReqInput
from srt.managers.tokenizer_loader import load_tokenizer
from srt.managers.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs


def make_server_args(model_path: str | None, **kwargs: Any) -> ServerArgs:
    """ServerArgs from keyword arguments, with the model resolved; ValueError naming an unknown argument."""
    known = {f.name for f in dataclasses.fields(ServerArgs)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
    args = ServerArgs(model_path=model_path or kwargs.pop("model_path", "") or "", **kwargs)
    args.served_model_name = args.served_model_name or args.model_path
    args.model_path = resolve_model_path(args.model_path, args.load_format)
    return args


class Engine:
    """Serve a model in-process: `generate`, `async_generate`, `get_server_info`, `flush_cache`, `shutdown`."""

    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        self.server_args = make_server_args(model_path, **server_args)
        if self.server_args.node_rank > 0:
            raise ValueError("node_rank > 0 runs only that node's ranks: start it with launch_server, not an Engine")
        tokenizer = load_tokenizer(self.server_args)
        self._processes: ServingProcesses | None = launch_processes(self.server_args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="srt-engine-loop", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)
        try:
            self.tokenizer_manager = TokenizerManager(
                self.server_args, self._processes.port_args, self._processes.info, tokenizer, self._processes.problem
            )
            self._call(self.tokenizer_manager.start())
        except BaseException:
            self.shutdown()
            raise

    # ---- generation ------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | None | list[int | None] = None,
        top_logprobs_num: int | list[int] = 0,
        stream: bool = False,
        return_text_in_logprobs: bool = False,
        image_data: Any = None,
        mm_processor_kwargs: dict | None = None,
        video_data: Any = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (a dict) or a batch (a list of dicts, prompt-major when n > 1).

        `stream=True` returns an iterator of incremental chunks (batch chunks carry their output `index`).
        Raises ValueError naming the bad field before anything runs.
        """
        obj = _generate_input(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            stream,
            return_text_in_logprobs,
            image_data,
            mm_processor_kwargs,
            video_data,
        )
        prepared = self._call(self._prepare(obj))
        if not stream:
            return obj.answer(self._call(self.tokenizer_manager.generate_all(obj, prepared=prepared)))
        return self._stream(obj, prepared)

    async def async_generate(self, *args: Any, **kwargs: Any) -> dict | list[dict] | AsyncIterator[dict]:
        """`generate` for coroutines (any event loop); with stream=True it returns an async iterator."""
        obj = _generate_input(*args, **kwargs)
        prepared = await self._acall(self._prepare(obj))
        if not obj.stream:
            return obj.answer(await self._acall(self.tokenizer_manager.generate_all(obj, prepared=prepared)))
        return self._astream(obj, prepared)

    def _stream(self, obj: GenerateReqInput, prepared: list) -> Iterator[dict]:
        chunks = self.tokenizer_manager.generate(obj, prepared=prepared)
        try:
            while True:
                try:
                    index, chunk = self._call(_anext(chunks))
                except StopAsyncIteration:
                    return
                yield obj.stream_chunk(index, chunk)
        finally:
            if not self._loop.is_closed():
                self._call(chunks.aclose())  # aborts what is still running

    async def _astream(self, obj: GenerateReqInput, prepared: list) -> AsyncIterator[dict]:
        chunks = self.tokenizer_manager.generate(obj, prepared=prepared)
        try:
            while True:
                try:
                    index, chunk = await self._acall(_anext(chunks))
                except StopAsyncIteration:
                    return
                yield obj.stream_chunk(index, chunk)
        finally:
            if not self._loop.is_closed():
                await self._acall(chunks.aclose())

    async def _prepare(self, obj: GenerateReqInput) -> list:
        return self.tokenizer_manager.prepare(obj)

    # ---- info and lifetime -------------------------------------------------------------------------------
    def get_server_info(self) -> dict:
        """Server args, model limits and, per KV pool, total / free / cached / in_use tokens."""
        return self._call(self.tokenizer_manager.get_server_info())

    def flush_cache(self) -> int | None:
        """Drop every cached prompt prefix (SGLang's Engine.flush_cache): the tokens dropped, or None while
        requests run or wait (nothing is dropped then)."""
        return self._call(self.tokenizer_manager.flush_cache())

    def shutdown(self) -> None:
        """Stop the processes and the event loop; safe to call twice."""
        if self._processes is None:
            return
        processes, self._processes = self._processes, None
        atexit.unregister(self.shutdown)
        if self._loop.is_running():
            if hasattr(self, "tokenizer_manager"):
                asyncio.run_coroutine_threadsafe(self.tokenizer_manager.close(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        processes.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _call(self, coro: Coroutine) -> Any:
        if self._processes is None:
            coro.close()
            raise RuntimeError("the engine is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _acall(self, coro: Coroutine) -> Any:
        if self._processes is None:
            coro.close()
            raise RuntimeError("the engine is shut down")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))


async def _anext(iterator: AsyncIterator) -> Any:
    return await iterator.__anext__()


def _generate_input(
    prompt: str | list[str] | None = None,
    sampling_params: dict | list[dict] | None = None,
    input_ids: list[int] | list[list[int]] | None = None,
    return_logprob: bool | list[bool] = False,
    logprob_start_len: int | None | list[int | None] = None,
    top_logprobs_num: int | list[int] = 0,
    stream: bool = False,
    return_text_in_logprobs: bool = False,
    image_data: Any = None,
    mm_processor_kwargs: dict | None = None,
    video_data: Any = None,
) -> GenerateReqInput:
    """The request `Engine.generate` and `async_generate` take, by the same arguments (`prompt` is `text`)."""
    return GenerateReqInput(
        text=prompt,
        input_ids=input_ids,
        sampling_params=sampling_params,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        stream=stream,
        return_text_in_logprobs=return_text_in_logprobs,
        image_data=image_data,
        video_data=video_data,
        mm_processor_kwargs=mm_processor_kwargs,
    )
