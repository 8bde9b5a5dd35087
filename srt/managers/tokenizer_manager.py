"""The tokenizer manager: the main process's side of serving (asyncio).

It tokenizes and checks requests (so that bad input is refused before anything is queued), sends them to
the scheduler, and routes the detokenizer's outputs to per-request queues that `generate()` reads. A
request whose reader goes away (client disconnect, cancelled task) is aborted, which frees its KV slots.
It lives on one event loop: create it anywhere, call `start()` on the loop that will use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from srt import __version__
from srt.managers.admission import Overloaded
from srt.managers.generate_input import GenerateReqInput, SingleReq, is_sample_of
from srt.managers.generate_output import ResultBuilder, TokenTexts
from srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheResult,
    GenerateError,
    SchedulerInfo,
    SchedulerStats,
    StatsReq,
    StrOutput,
    TokenizedGenerateReq,
    check_vocab_ids,
    combine_stats,
)
from srt.managers.ipc import PortArgs, socket
from srt.managers.metrics import ServerMetrics
from srt.managers.replica_router import ReplicaRouter
from srt.multimodal.image_prompts import ImagePrompts
from srt.sampling.grammar import GrammarCompiler, check_grammar, tokenizer_info
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def check_text(text: str) -> None:
    """ValueError naming `text` for an empty prompt or one that is not valid Unicode (a lone surrogate)."""
    if not text:
        raise ValueError("text must not be empty (the prompt has no characters)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"text must be valid Unicode: the prompt holds a lone surrogate at character {error.start}"
        ) from None


DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a /generate request names none
DISCONNECT_CHECK_S = 0.25  # how often a non-streaming request checks whether its client is still there


@dataclass
class _ReqState:
    queue: asyncio.Queue
    index: int
    builder: ResultBuilder
    last_token_time: float | None = None


class _DisconnectWatch:
    """Asks `is_disconnected` at most every DISCONNECT_CHECK_S; raises ConnectionAbortedError once it says so."""

    def __init__(self, is_disconnected: Callable[[], Awaitable[bool]]) -> None:
        self.is_disconnected = is_disconnected
        self.next_check = time.monotonic() + DISCONNECT_CHECK_S

    async def check(self) -> None:
        if time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + DISCONNECT_CHECK_S
        if await self.is_disconnected():
            raise ConnectionAbortedError("the client disconnected")

    def until_next(self) -> float:
        return max(0.0, self.next_check - time.monotonic())


class TokenizerManager:
    """Front end of the serving processes; see the module docstring."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        info: SchedulerInfo,
        tokenizer,
        check_children: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.info = info
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.bos_text = tokenizer.bos_token or ""
        # a generous bound on characters per token: the longest vocabulary piece, twice over (normalizers)
        self.max_token_chars = 2 * max(map(len, tokenizer.get_vocab()), default=1)
        self.image_prompts = ImagePrompts(server_args, tokenizer)
        self.model_name = server_args.served_model_name or server_args.model_path
        self.metrics = ServerMetrics(self.model_name)
        self.check_children = check_children
        self.dead: str | None = None  # why the server cannot serve any more (a child died)
        self.states: dict[str, _ReqState] = {}
        # answers of the schedulers to StatsReq / FlushCacheReq, by the request's id
        self._waiters: dict[int, asyncio.Future] = {}
        self._request_ids = itertools.count()
        # one input per data-parallel replica (its rank 0 scheduler); requests go to the least loaded
        context = zmq.Context.instance()
        self._sends = [socket(context, zmq.PUSH, address, bind=False) for address in port_args.replica_inputs]
        self.router = ReplicaRouter(len(self._sends))
        self._recv: zmq.asyncio.Socket | None = None
        self._loop_task: asyncio.Task | None = None
        self._grammar_compiler: GrammarCompiler | None = None  # built at the first constrained request

    async def start(self) -> None:
        """Bind to the running event loop and start receiving outputs."""
        self._context = zmq.asyncio.Context()
        self._recv = socket(self._context, zmq.PULL, self.port_args.tokenizer_input, bind=True)
        self._loop_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        """Stop receiving and close the sockets (call on the manager's loop)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._recv is not None:
            self._recv.close()
        for send in self._sends:
            send.close()

    # ---- requests ------------------------------------------------------------------------------------
    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids, as every request and /tokenize see them; ValueError naming `text`.

        A text that already starts with `<bos>` keeps that one (the tokenizer would add a second). The length
        is checked before tokenizing too: no longer than the context at `max_token_chars` per token, so a
        prompt that cannot fit is refused without minutes of tokenizer work.
        """
        check_text(text)
        limit = min(self.info.context_len, self.info.max_total_tokens)
        if len(text) > limit * self.max_token_chars:
            raise ValueError(f"text is too long: {len(text)} characters cannot fit in {limit} tokens")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        bos = self.tokenizer.bos_token_id
        if add_special_tokens and bos is not None and ids[:2] == [bos, bos] and text.startswith(self.bos_text):
            ids = ids[1:]
        return ids

    def tokenize(self, single: SingleReq, add_special_tokens: bool = True) -> TokenizedGenerateReq:
        """Tokenize and check one request; ValueError naming the bad field."""
        ids, mm = single.input_ids, None
        if single.image_data or single.video_data:
            ids, mm = self.image_prompts.tokenize(single, add_special_tokens)
        elif ids is None:
            ids = self.encode_text(single.text, add_special_tokens)
        vocab, context = self.info.vocab_size, self.info.context_len
        check_vocab_ids(ids, vocab)
        limit = min(context, self.info.max_total_tokens)
        if len(ids) >= limit:
            raise ValueError(f"prompt is too long: {len(ids)} tokens; the context length is {limit}")
        sampling = dict(single.sampling_params)
        if "max_new_tokens" not in sampling:
            sampling["max_new_tokens"] = min(DEFAULT_MAX_NEW_TOKENS, context - len(ids))
        elif sampling["max_new_tokens"] is None:  # explicitly unlimited: up to the context length
            sampling["max_new_tokens"] = context - len(ids)
        try:
            params = SamplingParams.from_dict(sampling)
        except TypeError as error:
            raise ValueError(f"sampling_params: {error}") from None
        params.validate(vocab)
        if params.grammar is not None:
            check_grammar(*params.grammar)
        if len(ids) + params.max_new_tokens > context:
            raise ValueError(
                f"max_new_tokens is too large: the prompt ({len(ids)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) exceeds the context length ({context})"
            )
        start = single.logprob_start_len
        if start is not None and not 0 <= start <= len(ids):
            raise ValueError(f"logprob_start_len must be in [0, {len(ids)}] (the prompt length), got {start}")
        return TokenizedGenerateReq(
            rid=single.rid,
            input_ids=list(ids),
            sampling_params=params,
            return_logprob=single.return_logprob,
            logprob_start_len=start if single.return_logprob else None,
            top_logprobs_num=single.top_logprobs_num if single.return_logprob else 0,
            mm_inputs=mm,
        )

    def prepare(self, obj: GenerateReqInput) -> list[TokenizedGenerateReq]:
        """Every request of `obj`, tokenized and checked; ValueError naming the bad field. Nothing is sent."""
        if self.dead:
            raise RuntimeError(self.dead)
        singles = obj.expand()
        requests = [self.tokenize(single, obj.add_special_tokens) for single in singles]
        rids = {req.rid for req in requests}
        # membership tests, not iteration: the HTTP server prepares on a worker thread while the loop edits states
        if len(rids) != len(requests) or any(rid in self.states for rid in rids):
            raise ValueError("rid must be unique among running requests")
        return requests

    async def generate(
        self,
        obj: GenerateReqInput,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
        prepared: list[TokenizedGenerateReq] | None = None,
    ) -> AsyncIterator[tuple[int, dict]]:
        """Run every request of `obj`; yields (output index, dict): with `obj.stream` a chunk per step,
        else one whole result per output, in the order they finish.

        Bad input raises ValueError at the first step; call `prepare(obj)` first and pass its result as
        `prepared` to find out before committing to a response (an HTTP stream, say).
        """
        requests = prepared if prepared is not None else self.prepare(obj)
        await self._compile_grammars(requests)
        queue: asyncio.Queue = asyncio.Queue()
        texts = self.token_texts if obj.return_text_in_logprobs else None
        for index, req in enumerate(requests):  # requests are in output order
            builder = ResultBuilder(req.rid, req.return_logprob, req.top_logprobs_num, texts)
            self.states[req.rid] = _ReqState(queue, index, builder)
        for req in requests:
            self._sends[self.router.route(req.rid)].send_pyobj(req)
        pending = {req.rid for req in requests}
        watch = _DisconnectWatch(is_disconnected) if is_disconnected is not None else None
        try:
            while pending:
                item = await self._next(queue, watch)
                if isinstance(item, Exception):
                    raise item
                state, out, times = item
                self._on_output(state, out)
                if out.output.finished:
                    pending.discard(out.output.rid)
                    self.states.pop(out.output.rid, None)
                    self.router.release(out.output.rid)
                if obj.stream:
                    chunk = state.builder.chunk(out)
                    if obj.return_emit_ts:
                        chunk["meta_info"]["emit_ts"] = times.to_json()
                    yield state.index, chunk
                elif out.output.finished:
                    yield state.index, state.builder.result()
        finally:
            for rid in pending:  # the reader left early (disconnect, error, cancellation): stop the rest
                self.abort(rid)

    async def _compile_grammars(self, requests: list[TokenizedGenerateReq]) -> None:
        """Compile the requests' grammars in a worker thread (cached), so the scheduler only deserializes them."""
        for req in requests:
            if req.sampling_params.grammar is not None and req.grammar is None:
                if self._grammar_compiler is None:
                    info = await asyncio.to_thread(
                        tokenizer_info, self.tokenizer, self.info.vocab_size, self.info.eos_token_ids
                    )
                    self._grammar_compiler = GrammarCompiler(info)
                req.grammar = await asyncio.to_thread(self._grammar_compiler.compile, *req.sampling_params.grammar)

    async def generate_all(
        self,
        obj: GenerateReqInput,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
        prepared: list[TokenizedGenerateReq] | None = None,
    ) -> list[dict]:
        """Run a non-streaming `obj` to the end: every output's whole result, in output order."""
        requests = prepared if prepared is not None else self.prepare(obj)
        results: list[dict] = [{}] * len(requests)
        async for index, result in self.generate(obj, is_disconnected, requests):
            results[index] = result
        return results

    async def _next(self, queue: asyncio.Queue, watch: _DisconnectWatch | None) -> object:
        if watch is None:
            return await queue.get()
        while True:
            # checked on a clock, not only when idle: outputs of a running request arrive every few ms
            await watch.check()
            try:
                return await asyncio.wait_for(queue.get(), watch.until_next())
            except asyncio.TimeoutError:
                continue

    def _on_output(self, state: _ReqState, out: StrOutput) -> None:
        now, o = time.monotonic(), out.output
        if o.new_token_ids:
            if state.last_token_time is None:
                self.metrics.first_token(now - state.builder.created)
            else:
                self.metrics.next_tokens(now - state.last_token_time, len(o.new_token_ids))
            state.last_token_time = now
        state.builder.add(out)
        if o.finished:
            reason = o.finished_reason.kind if o.finished_reason else "unknown"
            e2e = now - state.builder.created
            self.metrics.finished(reason, o.prompt_tokens, o.completion_tokens, o.cached_tokens, e2e)

    def abort_request(self, rid: str | None = None) -> list[str]:
        """SGLang's /abort_request: stop `rid` and its n samples (`rid-0`, `rid-1`, ...; every request in flight
        when None) on behalf of another caller. Unlike `abort`, the request's own reader keeps it: the
        scheduler's last output (finish reason "abort", the tokens so far) ends its response as any finish
        does. The rids asked to stop."""
        asked = [r for r in self.states if rid is None or r == rid or is_sample_of(r, rid)]
        stopping = [(r, replica) for r in asked if (replica := self.router.replica_of(r)) is not None]
        for r, replica in stopping:
            self._sends[replica].send_pyobj(AbortReq(r))
        return [r for r, _ in stopping]

    def abort(self, rid: str) -> None:
        """Stop a request and forget it; its later outputs are dropped."""
        if self.states.pop(rid, None) is not None:
            self._sends[self.router.release(rid) or 0].send_pyobj(AbortReq(rid))
            self.metrics.ended("abort")

    async def scheduler_stats(self, timeout: float = 10.0) -> SchedulerStats:
        """A fresh snapshot of the scheduler's queues and pools (summed over the data-parallel replicas);
        RuntimeError once a serving process died."""
        return combine_stats(await self.replica_stats(timeout))

    async def replica_stats(self, timeout: float = 10.0) -> list[SchedulerStats]:
        """Each data-parallel replica's snapshot, in replica order."""
        return await self._ask_replicas(StatsReq, timeout)

    async def flush_cache(self, timeout: float = 10.0) -> int | None:
        """Drop every replica's cached prefixes: the tokens dropped, or None if some replica had requests running
        or waiting (the others still flushed)."""
        results = await self._ask_replicas(FlushCacheReq, timeout)
        flushed = [result.flushed_tokens for result in results]
        return None if None in flushed else sum(flushed)

    async def _ask_replicas(self, make: Callable[[int], object], timeout: float) -> list:
        """Send `make(request id)` to every replica's scheduler; their answers, in replica order."""
        if self.dead:
            raise RuntimeError(self.dead)
        loop = asyncio.get_running_loop()
        req_ids = [next(self._request_ids) for _ in self._sends]
        futures = [self._waiters.setdefault(req_id, loop.create_future()) for req_id in req_ids]
        for send, req_id in zip(self._sends, req_ids, strict=True):
            send.send_pyobj(make(req_id))
        try:
            return list(await asyncio.wait_for(asyncio.gather(*futures), timeout))
        finally:
            for req_id in req_ids:
                self._waiters.pop(req_id, None)

    async def get_server_info(self) -> dict:
        """Server args, the model's limits, and the scheduler's queues and KV pools right now (with
        --dp-size, summed over the replicas, and each replica's under "replicas")."""
        replicas = await self.replica_stats()
        stats = combine_stats(replicas)
        info = {
            "version": __version__,
            "model_name": self.model_name,
            "server_args": {**dataclasses.asdict(self.server_args), "api_key": None},  # never the key itself
            "model": dataclasses.asdict(self.info),
            "num_running_reqs": stats.num_running,
            "num_waiting_reqs": stats.num_waiting,
            "num_retractions": stats.num_retractions,
            "generated_tokens_total": stats.generated_tokens_total,
            "pools": {name: dataclasses.asdict(pool) for name, pool in stats.pools.items()},
        }
        if len(replicas) > 1:
            info["replicas"] = [dataclasses.asdict(replica) for replica in replicas]
        return info

    # ---- outputs -------------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        assert self._recv is not None
        while True:
            if not await self._recv.poll(1000):
                self._check_children()
                continue
            message = await self._recv.recv_pyobj()
            if isinstance(message, BatchStrOut):
                times = message.times.stamp("tokenizer_manager")
                for out in message.outputs:
                    state = self.states.get(out.output.rid)
                    if state is not None:
                        state.queue.put_nowait((state, out, times))
            elif isinstance(message, GenerateError):
                state = self.states.pop(message.rid, None)
                self.router.release(message.rid)
                if state is not None:
                    state.queue.put_nowait(self._error_of(message))
            elif isinstance(message, SchedulerStats | FlushCacheResult):
                future = self._waiters.get(message.req_id)
                if future is not None and not future.done():
                    future.set_result(message)
            else:
                logger.error("tokenizer manager got an unknown message %r", type(message).__name__)

    def _error_of(self, message: GenerateError) -> Exception:
        if message.kind == "queue_timeout":
            self.metrics.ended("queue_timeout")
            return Overloaded(message.message, code="queue_timeout")
        return ValueError(message.message)

    def _check_children(self) -> None:
        problem = self.check_children()
        if problem is not None:
            self.fail_all(problem)

    def fail_all(self, problem: str) -> None:
        """A serving process died: every open request ends with RuntimeError(problem), every later one too."""
        if self.dead:
            return
        self.dead = problem
        logger.error("%s; failing every request", problem)
        for state in self.states.values():
            state.queue.put_nowait(RuntimeError(problem))
        self.metrics.ended("abort", len(self.states))
        self.states.clear()
        self.router.clear()
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(RuntimeError(problem))
