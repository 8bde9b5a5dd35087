"""Admission control: how many requests may be in flight, and the answer to those beyond it.

A request is in flight from the moment it is admitted (after its body is checked) until its response has
been written. At most `--max-running-requests` of them run (per data-parallel replica); the rest wait in the
schedulers' queues, at most `--max-queued-requests` of them. The count is kept in the HTTP process, where a
refusal costs nothing: no round trip to the scheduler, and no tokenizing when the server is already full.

    in flight:  [ running (<= max_running) | queued (<= max_queued) ]  -> next one: 429, Retry-After

The running share is not known here (the scheduler may run fewer when KV memory is short), so "queued" is
the in-flight count beyond max_running: the queue can hold a few more than that, never more in total.
"""

from __future__ import annotations

from srt.server_args import ServerArgs

QUEUE_PER_RUNNING = 4  # default --max-queued-requests per --max-running-requests
RETRY_AFTER_S = 1  # what a refused client is told to wait: about one batch's worth of work on a busy server


class Overloaded(Exception):
    """The server cannot take (or start) this request now; answered HTTP 429 with Retry-After."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code  # "queue_full": refused on arrival; "queue_timeout": waited past --request-timeout
        self.retry_after = RETRY_AFTER_S


def max_running_requests(server_args: ServerArgs) -> int:
    """The server's running batches together: --max-running-requests on each data-parallel replica."""
    return server_args.max_running_requests * server_args.dp_size


def max_queued_requests(server_args: ServerArgs) -> int:
    """--max-queued-requests, or its default: QUEUE_PER_RUNNING x the server's running requests."""
    if server_args.max_queued_requests is not None:
        return server_args.max_queued_requests
    return QUEUE_PER_RUNNING * max_running_requests(server_args)


class Ticket:
    """What one admitted request holds; `release()` (idempotent) when its response is done."""

    def __init__(self, admission: Admission, count: int) -> None:
        self.admission, self.count = admission, count

    def release(self) -> None:
        self.admission.in_flight -= self.count
        self.count = 0


class Admission:
    """Counts requests in flight and refuses those beyond the limit (module docstring)."""

    def __init__(self, server_args: ServerArgs) -> None:
        self.max_running = max_running_requests(server_args)
        self.max_queued = max_queued_requests(server_args)
        self.limit = self.max_running + self.max_queued
        self.in_flight = 0

    @property
    def queued(self) -> int:
        return max(0, self.in_flight - self.max_running)

    @property
    def full(self) -> bool:
        """True while a new request would be refused."""
        return self.in_flight >= self.limit

    def check(self, count: int = 1) -> None:
        """Overloaded if `count` more requests would not fit now."""
        if count > self.limit:
            raise ValueError(
                f"n must be at most {self.limit} here: the request asks for {count} samples and the server "
                f"holds {self.limit} requests (--max-running-requests + --max-queued-requests)"
            )
        if self.in_flight + count > self.limit:
            raise Overloaded(
                f"the server is overloaded: {self.in_flight} requests in flight, at most {self.limit} "
                f"({self.max_running} running + {self.max_queued} queued); retry after {RETRY_AFTER_S} s",
                code="queue_full",
            )

    def admit(self, count: int) -> Ticket:
        """A ticket for `count` requests (the samples of one HTTP request); Overloaded if they do not fit."""
        self.check(count)
        self.in_flight += count
        return Ticket(self, count)
