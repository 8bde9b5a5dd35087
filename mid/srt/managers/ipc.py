"""Plumbing shared by the serving processes: ZMQ addresses, readiness reports, and dying with the parent.

    TokenizerManager --PUSH--> scheduler_input   (requests, aborts, stats requests)
    detokenizer      --PUSH--> scheduler_input   (aborts of requests a stop string ended)
    scheduler        --PUSH--> detokenizer_input (step outputs, detokenize inits, errors, stats)
    detokenizer      --PUSH--> tokenizer_input   (text outputs; everything else passed through)

Each address is an `ipc://` socket file in a private temporary directory; messages are pickled dataclasses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

# How often (seconds) an idle child wakes up to check that its parent is still there.
PARENT_CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class PortArgs:
    """The ZMQ addresses of one server (one set per Engine or HTTP server)."""

    ipc_dir: str
    scheduler_input: str  # what a scheduler process binds: its replica's entry of `replica_inputs`
    detokenizer_input: str
    tokenizer_input: str
    replica_inputs: tuple[str, ...]  # every data-parallel replica's scheduler input, in replica order

    @classmethod
    def create(cls, dp_size: int = 1) -> PortArgs:
        ipc_dir = tempfile.mkdtemp(prefix="srt-ipc-")
        inputs = tuple(f"ipc://{ipc_dir}/scheduler" + (f"-dp{d}" if d else "") for d in range(dp_size))
        return cls(
            ipc_dir=ipc_dir,
            scheduler_input=inputs[0],
            detokenizer_input=f"ipc://{ipc_dir}/detokenizer",
            tokenizer_input=f"ipc://{ipc_dir}/tokenizer",
            replica_inputs=inputs,
        )

    def of_replica(self, replica: int) -> PortArgs:
        """The addresses as the schedulers of data-parallel replica `replica` use them."""
        return dataclasses.replace(self, scheduler_input=self.replica_inputs[replica])

    def cleanup(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


@dataclass
class ReadyReport:
    """Child -> parent over a pipe, once: ready (with `info`), or the traceback of why it could not start."""

    ok: bool
    info: Any = None
    error: str | None = None


def socket(context: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # never block process exit on undelivered messages
    if kind == zmq.PUSH:
        # No high-water mark: a burst of requests must queue, not block the sender's event loop. Every
        # receiver drains its socket each iteration, and a dead one is detected by its parent.
        sock.setsockopt(zmq.SNDHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def setup_child(name: str, log_level: str) -> None:
    """Common start of every child: name its log lines, exit cleanly on SIGTERM, leave Ctrl-C to the parent.

    A terminal's Ctrl-C reaches the whole process group; the parent then shuts its children down in order,
    so a child that also reacted would only print a second traceback.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # `ps`, `top` and `pgrep srt-scheduler` tell the children apart (every one's command line is spawn_main)
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(f"srt-{name}"[:15])  # the kernel keeps 15 characters
    # SIGTERM (the parent's shutdown) unwinds normally, so that multiprocessing's finalizers release what
    # they registered instead of leaving the resource tracker to warn about it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    logging.basicConfig(
        level=log_level.upper(), format=f"[%(asctime)s {name}] %(levelname)s %(name)s: %(message)s", force=True
    )


def parent_alive(parent_pid: int) -> bool:
    """False once the process that started us is gone (we were re-parented): time to exit too.

    Daemon processes die with a parent that exits normally; this also covers a parent killed by SIGKILL.
    """
    return os.getppid() == parent_pid


def report(pipe: Connection, ready: ReadyReport) -> None:
    pipe.send(ready)
    pipe.close()
