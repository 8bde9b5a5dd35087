"""A scheduler's timeline as JSON lines, for finding where a request's time goes (`bench/step_trace.py` reads it).

`SRT_STEP_TRACE=PATH` (one file per scheduler process: `PATH.<pid>`) writes one line per event, wall-clock
seconds (`time.time()`, comparable with the clients' and `emit_ts`):

    {"t": ..., "event": "arrive", "rid": ...}                          the scheduler queued a request
    {"t": ..., "event": "launch", "mode": "extend", "prompt_tokens": 8192, "decode_rows": 7,
     "admitted": [rid, ...], "waiting": 0, "running": 8}              a step's forward was queued
    {"t": ..., "event": "finish", "mode": "extend", "first_token": [rid, ...]}   its tokens were read
    {"t": ..., "event": "mark", "at": "forward"}                      a point of the host's work (`mark`):
        "finished" (a step's bookkeeping done), "sent" (its outputs sent), "schedule" (the next step being
        chosen), "forward" (its batch laid out, the forward called)

Unset (the default), every call returns at once. A trace is a diagnosis, not a metric: /metrics and the
periodic log line are what a server reports.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, TextIO

from srt.envs import step_trace_path

if TYPE_CHECKING:
    from srt.managers.schedule_batch import ScheduleBatch


class StepTrace:
    """Appends the scheduler's events to `$SRT_STEP_TRACE.<pid>` when the variable is set."""

    def __init__(self, path: str | None = None) -> None:
        path = path if path is not None else step_trace_path()
        self._file: TextIO | None = open(f"{path}.{os.getpid()}", "a", buffering=1) if path else None  # noqa: SIM115

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def arrived(self, rid: str) -> None:
        if self._file is not None:
            self._write({"event": "arrive", "rid": rid})

    def launched(self, batch: ScheduleBatch, waiting: int, running: int) -> None:
        if self._file is None:
            return
        prompt = [item for item in batch.items if item.num_tokens > 1 and not item.num_drafts]
        self._write({
            "event": "launch", "mode": batch.mode.name.lower(),
            "prompt_tokens": sum(item.num_tokens for item in prompt),
            "decode_rows": sum(item.num_tokens for item in batch.items if item not in prompt),
            # first chunks: nothing computed beyond the cached prefix yet
            "admitted": [item.req.rid for item in prompt if item.req.kv_len == item.req.cached_tokens],
            "waiting": waiting, "running": running,
        })  # fmt: skip

    def finished(self, batch: ScheduleBatch) -> None:
        """After the step's tokens were appended: the requests of `batch` whose first output token it was."""
        if self._file is not None:
            first = [item.req.rid for item in batch.items if len(item.req.output_ids) == 1]
            self._write({"event": "finish", "mode": batch.mode.name.lower(), "first_token": first})

    def mark(self, at: str) -> None:
        """A point of the host's work between steps, to time the stretches between them."""
        if self._file is not None:
            self._write({"event": "mark", "at": at})

    def _write(self, record: dict) -> None:
        assert self._file is not None
        self._file.write(json.dumps({"t": time.time(), **record}) + "\n")
