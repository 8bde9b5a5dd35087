"""The scheduler process: owns the model and its KV memory and runs `Scheduler.step()` in a loop.

Each iteration: take every waiting message without blocking (requests, aborts, stats requests), run one
step if there is work, send its outputs to the detokenizer. When there is no work it blocks on its socket
(waking every second to check that its parent is alive), and checks every pool's integrity once.

Under tensor parallelism (--tp-size N) there is one such process per rank: rank 0 runs this loop and hands
each iteration's inputs to the others, which run `FollowerLoop` (`distributed/ranks.py` says why that keeps
every rank on the same step).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import time
import traceback
from multiprocessing.connection import Connection

import zmq

from srt.distributed.placement import RankPlace
from srt.distributed.ranks import StepInputs, TensorParallelGroup, rank_device
from srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    DetokenizeInit,
    FlushCacheReq,
    FlushCacheResult,
    GenerateError,
    PoolStats,
    SchedulerInfo,
    SchedulerStats,
    StatsReq,
    TokenizedGenerateReq,
)
from srt.managers.ipc import PARENT_CHECK_INTERVAL_S, PortArgs, ReadyReport, parent_alive, report, setup_child, socket
from srt.managers.scheduler import Scheduler
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def run_scheduler_process(
    server_args: ServerArgs,
    port_args: PortArgs,
    ready_pipe: Connection,
    parent_pid: int,
    place: RankPlace | None = None,
) -> None:
    """Process entry point: load the model, report readiness (or the error), then serve until orphaned.
    `place`: this process's rank and replica (None: the only scheduler)."""
    setup_child("scheduler" if place is None else place.name, server_args.log_level)
    group = None
    try:
        device = None
        if place is not None and place.size > 1:
            group = TensorParallelGroup(server_args, place)
        elif place is not None:
            device = rank_device(server_args, place)  # a replica of one rank: its own GPU
        scheduler = Scheduler(server_args, ModelRunner(server_args, tp=group, device=device))
        if scheduler.runner.device.type == "cuda" and not server_args.skip_server_warmup:
            warm_up(scheduler)  # every rank: the same requests, the same steps
        if place is None or place.is_first:
            loop = SchedulerLoop(scheduler, server_args, port_args, group, 0 if place is None else place.replica)
        else:
            loop = FollowerLoop(scheduler, group)
        # the model, pools and graphs live as long as the process: out of the collector's sight, so that its
        # full collections between steps do not walk them again and again
        gc.collect()
        gc.freeze()
    except Exception:
        report(ready_pipe, ReadyReport(ok=False, error=traceback.format_exc()))
        return
    if group is not None:
        # SIGTERM (the server's shutdown) must not unwind a rank inside a collective: a broadcast cut between its
        # size and its bytes, followed by rank 0's stop broadcast, hands the others garbage (seen in CI). Rank 0
        # stops at the top of its next iteration and tells the others; they end when it does.
        signal.signal(signal.SIGTERM, lambda signum, frame: loop.request_stop())
    report(ready_pipe, ReadyReport(ok=True, info=loop.info()))
    try:
        loop.run(parent_pid)
    finally:
        if group is not None:
            group.close()


# one prompt length a multiple of 16 and one not: Triton specialises kernels on row counts that are
WARMUP_PROMPT_LENS = (37, 64)
# then prompts of this length beside a decoding request: eager steps past the token-count graphs (4096 + 1 and
# 4095 + 1 tokens), where the norm + RoPE kernels take their largest token blocks (`rope.head_tiling`) and the
# decode rows of a mixed step run beside the prompt's tiles. Their kernels would otherwise compile while the
# first long prompts wait (E4B on an H100 with an empty Triton cache: 5.6 s for the first 8k prompt, then 1.7
# and 1.6 s for the first mixed steps).
WARMUP_LONG_PROMPT = 4096


def warm_up(scheduler: Scheduler, long_prompt: int = WARMUP_LONG_PROMPT) -> None:
    """Serve short greedy requests, then long prompts beside a decoding one, before the first real request,
    so that it does not wait while Triton compiles the prefill kernels (~5 s for E4B on an H100). Leaves every
    pool and cache as it found them."""
    start = time.perf_counter()
    vocab = scheduler.runner.model_config.vocab_size
    # short of the context and of the pools, however small they are configured
    room = min(scheduler.runner.context_len - 3, scheduler.allocator.full_size // 4)
    served = 0

    def submit(length: int, max_new_tokens: int) -> None:
        nonlocal served
        ids = [(7 * j + 3 + 11 * served) % vocab for j in range(max(1, min(length, room)))]  # no shared prefix
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
        scheduler.add_request(TokenizedGenerateReq(rid=f"warmup-{served}", input_ids=ids, sampling_params=params))
        served += 1

    def drain() -> None:
        while scheduler.has_work():
            scheduler.step()

    for length in WARMUP_PROMPT_LENS:  # one at a time: each its own step of that many rows
        submit(length, max_new_tokens=2)
        drain()
    submit(8, max_new_tokens=16)  # decodes through the long prompts' steps
    scheduler.step()
    for length in (long_prompt, long_prompt - 1):
        submit(length, max_new_tokens=1)
        while any(req.rid == f"warmup-{served - 1}" for req in scheduler.waiting + scheduler.running):
            scheduler.step()
    drain()
    scheduler.cache.evict(scheduler.allocator.full_size)
    scheduler.check_integrity()
    logger.info("warm-up: %d requests in %.1f s", served, time.perf_counter() - start)


class SchedulerLoop:
    """The message loop around one Scheduler."""

    def __init__(
        self,
        scheduler: Scheduler,
        server_args: ServerArgs,
        port_args: PortArgs,
        group: TensorParallelGroup | None = None,
        replica: int = 0,
    ) -> None:
        """`replica`: this scheduler's data-parallel replica (--dp-size), named in what it tells the detokenizer."""
        self.scheduler = scheduler
        self.replica = replica
        self.group = group
        self.context = zmq.Context()
        self.recv_socket = socket(self.context, zmq.PULL, port_args.scheduler_input, bind=True)
        self.send_socket = socket(self.context, zmq.PUSH, port_args.detokenizer_input, bind=False)
        self.generated_tokens_total = 0
        self.status_log = StatusLog(server_args.log_interval)
        self.request_timeout = server_args.request_timeout
        self.port_args = port_args
        self.stop_requested = False

    def request_stop(self) -> None:
        """End the loop at the top of its next iteration (within a second when idle), between steps."""
        self.stop_requested = True

    def info(self) -> SchedulerInfo:
        """What the tokenizer side needs to know of the model and its pools (the ready report's payload)."""
        runner = self.scheduler.runner
        return SchedulerInfo(
            context_len=runner.context_len,
            vocab_size=runner.model_config.vocab_size,
            max_total_tokens=self.scheduler.allocator.full_size,
            max_swa_tokens=self.scheduler.allocator.swa_size,
            eos_token_ids=list(runner.eos_token_ids),
            device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
        )

    def run(self, parent_pid: int) -> None:
        busy = False
        last_parent_check = time.monotonic()
        while True:
            if self.stop_requested:
                logger.info("stopping")
                if self.group is not None:
                    self.group.share(StepInputs([], [], stop=True))
                return
            messages = self._recv_all(block=not self.scheduler.has_work())
            expired = self._expire_waiting()
            if self.group is not None:  # the other ranks apply the same inputs before the same step
                self.group.share(StepInputs(messages, expired))
            for message in messages:
                self._handle(message)
            if self.scheduler.has_work():
                busy = True
                outputs = self.scheduler.step()
                self.generated_tokens_total += sum(len(out.new_token_ids) for out in outputs)
                if outputs:
                    self.send_socket.send_pyobj(BatchTokenIDOut(outputs))
                    self.scheduler.trace.mark("sent")
            elif busy:
                busy = False
                self._check_integrity()
            self.status_log.maybe_log(self.scheduler, self.generated_tokens_total, busy)
            now = time.monotonic()
            if now - last_parent_check >= PARENT_CHECK_INTERVAL_S:
                last_parent_check = now
                if not parent_alive(parent_pid):
                    logger.info("parent process is gone; exiting")
                    if self.group is not None:
                        self.group.share(StepInputs([], [], stop=True))
                    self.port_args.cleanup()  # a parent killed by SIGKILL could not remove the socket files
                    return

    def _expire_waiting(self) -> list[str]:
        """Answer the requests that waited in the queue past --request-timeout with an error; their rids."""
        timeout = self.request_timeout
        if timeout is None or not self.scheduler.waiting:
            return []
        expired = self.scheduler.expire_waiting(time.monotonic(), timeout)
        for rid in expired:
            message = f"the request waited {timeout:g} s in the queue without being started (--request-timeout)"
            self.send_socket.send_pyobj(GenerateError(rid, message, kind="queue_timeout"))
        return expired

    def _recv_all(self, block: bool) -> list[object]:
        if block and not self.recv_socket.poll(int(PARENT_CHECK_INTERVAL_S * 1000)):
            return []
        messages = []
        while True:
            try:
                messages.append(self.recv_socket.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return messages

    def _handle(self, message: object) -> None:
        if isinstance(message, TokenizedGenerateReq):
            try:
                self.scheduler.add_request(message)
            except ValueError as error:
                self.send_socket.send_pyobj(GenerateError(message.rid, str(error)))
                return
            params = message.sampling_params
            # sent before any output of the request: both travel through this one socket, in order
            init = DetokenizeInit(message.rid, list(params.stop or []), params.skip_special_tokens, self.replica)
            self.send_socket.send_pyobj(init)
        elif isinstance(message, AbortReq):
            output = self.scheduler.abort(message.rid)
            if output is not None:
                self.send_socket.send_pyobj(BatchTokenIDOut([output]))
        elif isinstance(message, StatsReq):
            self.send_socket.send_pyobj(self.stats(message.req_id))
        elif isinstance(message, FlushCacheReq):
            flushed = self.scheduler.flush_cache()
            if flushed is not None:
                logger.info("cache flushed: %d tokens", flushed)
            self.send_socket.send_pyobj(FlushCacheResult(message.req_id, flushed))
        else:
            logger.error("scheduler got an unknown message %r", type(message).__name__)

    def stats(self, req_id: int) -> SchedulerStats:
        return SchedulerStats(
            req_id=req_id,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            pools=pool_stats(self.scheduler),
            num_retractions=self.scheduler.num_retractions,
            generated_tokens_total=self.generated_tokens_total,
            spec_accept_counts=list(self.scheduler.spec.accept_counts) if self.scheduler.spec else [],
        )

    def _check_integrity(self) -> None:
        try:
            self.scheduler.check_integrity()
        except AssertionError:
            logger.exception("KV pools are inconsistent after the last request finished")


class FollowerLoop:
    """The loop of a tensor-parallel rank other than 0: rank 0's inputs in, the same step out, no sockets (its
    outputs equal rank 0's, which rank 0 sends)."""

    def __init__(self, scheduler: Scheduler, group: TensorParallelGroup) -> None:
        self.scheduler = scheduler
        self.group = group

    def info(self) -> None:
        """Nothing: rank 0 reports the server's figures."""
        return None

    def request_stop(self) -> None:
        """Nothing: a rank ends when rank 0 says so (or its parent is gone), never in the middle of a step that
        rank 0 runs; its parent kills it after the shutdown's grace period if rank 0 does not stop."""
        logger.info("SIGTERM: ending when rank 0 stops")

    def run(self, parent_pid: int) -> None:
        scheduler = self.scheduler
        busy = False
        while True:
            # checked before taking part in another step, never inside one (rank 0 would wait in a collective for
            # a rank that left): rank 0's next broadcast then fails and it exits too
            if not parent_alive(parent_pid):
                logger.info("the parent process is gone; exiting")
                return
            inputs = self.group.share(None)  # blocks until rank 0's next iteration (at least every second)
            if inputs.stop:
                logger.info("rank 0 stopped; exiting")
                return
            scheduler.drop_waiting(inputs.expired)  # rank 0's order: expired requests first, then the messages
            for message in inputs.messages:
                if isinstance(message, TokenizedGenerateReq):
                    with contextlib.suppress(ValueError):  # rank 0 answers it with the same error
                        scheduler.add_request(message)
                elif isinstance(message, AbortReq):
                    scheduler.abort(message.rid)
                elif isinstance(message, FlushCacheReq):  # rank 0 flushes at this point too, or refuses as here
                    scheduler.flush_cache()
            if scheduler.has_work():
                busy = True
                scheduler.step()
            elif busy:
                busy = False
                try:
                    scheduler.check_integrity()
                except AssertionError:
                    logger.exception("KV pools are inconsistent after the last request finished")


def pool_stats(scheduler: Scheduler) -> dict[str, PoolStats]:
    """Token counts of the full pool and the sliding-window pool."""
    full = scheduler.cache.stats()
    pools = {"full": PoolStats(full.total, full.free, full.cached, full.evictable, full.in_use)}
    swa = scheduler.cache.swa_stats()
    pools["swa"] = PoolStats(swa.total, swa.free, swa.cached, swa.evictable, swa.in_use)
    return pools


class StatusLog:
    """One log line every `interval` seconds while busy: load, KV usage and throughput."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last_time = time.monotonic()
        self.last_tokens = 0
        self.active = False  # something happened since the last line
        self.last_accept_counts: list[int] = []  # verify rounds by accepted drafts at the last line

    def maybe_log(self, scheduler: Scheduler, generated_tokens_total: int, busy: bool) -> None:
        self.active = self.active or busy
        now = time.monotonic()
        if not self.interval or now - self.last_time < self.interval:
            return
        if self.active:
            pools = pool_stats(scheduler)
            usage = ", ".join(
                f"{name} {100 * (p.total - p.free) / p.total:.1f}% ({p.in_use} in use, {p.cached} cached)"
                for name, p in pools.items()
            )
            throughput = (generated_tokens_total - self.last_tokens) / (now - self.last_time)
            logger.info(
                "running %d, waiting %d, KV %s, generation %.1f tok/s, retractions %d%s",
                len(scheduler.running),
                len(scheduler.waiting),
                usage,
                throughput,
                scheduler.num_retractions,
                self._accept_length(scheduler),
            )
        self.last_time, self.last_tokens, self.active = now, generated_tokens_total, busy

    def _accept_length(self, scheduler: Scheduler) -> str:
        """ ", accept length L" (tokens per verify round since the last line) under speculative decoding."""
        if scheduler.spec is None:
            return ""
        counts = scheduler.spec.accept_counts
        last, self.last_accept_counts = self.last_accept_counts or [0] * len(counts), list(counts)
        rounds = [now - before for now, before in zip(counts, last, strict=True)]
        if not sum(rounds):
            return ""
        return f", accept length {sum((n + 1) * r for n, r in enumerate(rounds)) / sum(rounds):.2f}"
