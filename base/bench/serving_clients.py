"""The client processes of `bench_serving.py`: one run's streams spread over several Python processes.

Why: one process that parses every streamed chunk through the openai SDK (it builds a model object per chunk)
fills its core at a few thousand chunks/s, and the chat workload streams ~5,000/s (32 streams at a 6 ms step
on an H100). Chunks then wait in its sockets and are parsed in bursts. Measured there with emit timestamps: ITL
p50 0.18 ms against a TPOT of 6.0 ms while the scheduler emitted a token every 5.6 ms (p50), and 24 ms (p50)
between the server writing a chunk and the client parsing it; two processes of 16 streams each measured ITL
p50 6.0 ms against a TPOT of 6.2 ms.

Every process runs its own event loop and openai client. Request i goes to process i % N and the concurrency
limit is split the same way (the shares add up to the limit): with requests of equal length, as in every
workload, a process's requests wait for its own slots when they would have waited for the global limit. Arrival
times (Poisson) are drawn once, in the parent, and every process sends at them by the wall clock, so they do
not depend on N. The processes start, imports and all, before anything is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import httpx
import openai
from serving_metrics import RequestRecord
from serving_requests import RequestSpec, send_request
from tqdm import tqdm

STREAMS_PER_PROCESS = 8  # the chat workload's 32 streams: 4 processes, each well below a full core
START_MARGIN_S = 0.05  # jobs reach every process before the first request is due


@dataclass
class Job:
    """What one client process sends: its requests, when (seconds after `start_at`), how many at once."""

    base_url: str
    backend: str
    model: str
    timeout_s: float
    stream_logprobs: bool
    emit_timestamps: bool
    specs: list[RequestSpec]
    send_at: list[float]
    concurrency: int | None
    start_at: float = 0.0  # wall clock (time.time()), set when the job is sent


@dataclass
class JobResult:
    records: list[RequestRecord]
    finished_at: float  # wall clock


def default_process_count(concurrency: int | None, num_requests: int) -> int:
    """One process per STREAMS_PER_PROCESS open streams, leaving half the cores to the server (if local)."""
    streams = concurrency or num_requests
    return max(1, min(math.ceil(streams / STREAMS_PER_PROCESS), (os.cpu_count() or 2) // 2))


def split(job: Job, count: int) -> list[Job]:
    """`job` as `count` jobs (fewer if it has fewer requests or slots): request i to job i % count, the
    concurrency limit in shares that add up to it."""
    count = max(1, min(count, len(job.specs), job.concurrency or len(job.specs)))
    jobs = []
    for k in range(count):
        share = None if job.concurrency is None else job.concurrency // count + (k < job.concurrency % count)
        jobs.append(
            dataclasses.replace(job, specs=job.specs[k::count], send_at=job.send_at[k::count], concurrency=share)
        )
    return jobs


def merge(whole: Job, jobs: list[Job], results: list[JobResult]) -> list[RequestRecord]:
    """The records of `split(whole, ...)`'s jobs in `whole`'s request order."""
    records: list[RequestRecord | None] = [None] * len(whole.specs)
    for k, result in enumerate(results):
        records[k :: len(jobs)] = result.records
    return records


class ClientProcesses:
    """`count` client processes (spawned: no state of this one is shared), each ready before `run` times."""

    def __init__(self, count: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(count):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_serve, args=(theirs,), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        for conn in self.conns:
            _expect(conn, "ready")

    def run(
        self, whole: Job, deadline: float | None = None, progress: tqdm | None = None
    ) -> tuple[list[RequestRecord], float]:
        """Send `whole`'s requests from the processes; (records in request order, seconds from the first one
        due to the last one done). asyncio.TimeoutError past `deadline` (time.monotonic()), the processes
        then stopped."""
        start_at = time.time() + START_MARGIN_S
        jobs = [dataclasses.replace(job, start_at=start_at) for job in split(whole, len(self.conns))]
        for conn, job in zip(self.conns, jobs):
            conn.send(job)
        running = dict(zip(self.conns, range(len(jobs))))  # connection -> its job, until the job's result
        results: list[JobResult | None] = [None] * len(jobs)
        while running:
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                self.close(timeout_s=0)
                raise asyncio.TimeoutError(f"the requests of {len(running)} client process(es) did not finish")
            for conn in wait(list(running), timeout):
                message = _expect(conn, None)
                if message != "done":
                    results[running.pop(conn)] = message
                elif progress is not None:
                    progress.update(1)
        return merge(whole, jobs, results), max(r.finished_at for r in results) - start_at

    def close(self, timeout_s: float = 10.0) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join()

    def __enter__(self) -> ClientProcesses:
        return self

    def __exit__(self, error_type: type | None, *exc: object) -> None:
        self.close(timeout_s=10.0 if error_type is None else 0.0)  # after an error a job may still be running


def _expect(conn: Connection, wanted: str | None) -> object:
    """The next message from a client process; its error raised here, or RuntimeError if it died."""
    try:
        message = conn.recv()
    except EOFError:
        raise RuntimeError("a client process exited unexpectedly") from None
    if isinstance(message, Exception):
        raise message
    if wanted is not None and message != wanted:
        raise RuntimeError(f"a client process said {message!r}, expected {wanted!r}")
    return message


def _serve(conn: Connection) -> None:
    """A client process: run each job the parent sends until it sends None."""
    conn.send("ready")
    while (job := conn.recv()) is not None:
        try:
            conn.send(asyncio.run(_run_job(job, conn)))
        except Exception:
            conn.send(RuntimeError(f"in a client process:\n{traceback.format_exc()}"))


async def _run_job(job: Job, conn: Connection) -> JobResult:
    # One connection per request that may be open at once: the client's default pool (1000) would otherwise
    # queue requests on the client and count the wait as TTFT.
    connections = job.concurrency or len(job.specs)
    client = openai.AsyncOpenAI(
        base_url=f"{job.base_url}/v1",
        api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        max_retries=0,
        timeout=job.timeout_s,
        http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=connections)),
    )
    limit = asyncio.Semaphore(job.concurrency) if job.concurrency else contextlib.nullcontext()

    async def one(spec: RequestSpec, send_at: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, job.start_at + send_at - time.time()))
        async with limit:  # requests due earlier queue first, as they would for one global limit
            record = await send_request(client, job.backend, job.model, spec, job.stream_logprobs, job.emit_timestamps)
        conn.send("done")
        return record

    async with client:
        records = await asyncio.gather(*(one(spec, at) for spec, at in zip(job.specs, job.send_at)))
    return JobResult(list(records), time.time())
