"""Start the scheduler and detokenizer processes, wait until both are ready, and stop them again.

Children are started with `spawn` (a fresh interpreter: no inherited threads, CUDA state or locks). They
are daemon processes that also exit on their own once their parent is gone, so no child outlives the
server however it ends. As with any `spawn` program, a script that starts an Engine at import time must
do so under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from srt.distributed.placement import free_loopback_address, ranks_of_node
from srt.managers.io_struct import SchedulerInfo
from srt.managers.ipc import PortArgs, ReadyReport
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0  # loading a 31B checkpoint from a slow disk takes a while
SHUTDOWN_GRACE_S = 5.0
CHILDREN = {
    "scheduler": "srt.managers.scheduler_process:run_scheduler_process",
    "detokenizer": "srt.managers.detokenizer_manager:run_detokenizer_process",
}


@dataclass
class ServingProcesses:
    """The running children of one server and the addresses that connect them."""

    port_args: PortArgs
    children: dict[str, BaseProcess]
    info: SchedulerInfo | None = None
    stopped: bool = False

    def problem(self) -> str | None:
        """A message naming the children that died, or None while all are alive.

        One child's death often takes others with it (a killed tensor-parallel rank breaks its peers'
        connections, and they exit with an error a moment later), so a child ended by a signal is named
        first: that is the cause, the others' exits its consequence."""
        dead = [(name, proc.exitcode) for name, proc in self.children.items() if not proc.is_alive()]
        if not dead:
            return None
        dead.sort(key=lambda item: item[1] is None or item[1] >= 0)  # stable: signals first, then start order
        (name, code), *others = dead
        message = f"the {name} process exited unexpectedly (exit code {code})"
        also = ", ".join(f"{other} (exit code {other_code})" for other, other_code in others)
        return message + (f"; also exited: {also}" if also else "")

    def watch(self, loop: asyncio.AbstractEventLoop, on_death: Callable[[str], None]) -> Callable[[], None]:
        """Call `on_death(problem)` on `loop` the moment a child exits (its sentinel becomes readable: no
        polling), once; returns what stops watching (call it before `shutdown`, which ends the children)."""
        sentinels = {name: proc.sentinel for name, proc in self.children.items()}

        def stop() -> None:
            for fd in sentinels.values():
                loop.remove_reader(fd)

        def died(name: str) -> None:
            stop()
            self.children[name].join(1.0)  # the sentinel closes a moment before the exit status can be read
            if not self.stopped:
                on_death(self.problem() or f"the {name} process exited unexpectedly")

        for name, fd in sentinels.items():
            loop.add_reader(fd, died, name)
        return stop

    def shutdown(self) -> None:
        """Stop every child (SIGTERM, then SIGKILL after a grace period) and remove the socket files."""
        if self.stopped:
            return
        self.stopped = True
        for proc in self.children.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in self.children.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.port_args.cleanup()


def launch_processes(server_args: ServerArgs, timeout: float = STARTUP_TIMEOUT_S) -> ServingProcesses:
    """Start the children and return once they are ready; RuntimeError with the child's error if one fails.

    The scheduler is one process per tensor-parallel rank of this node ("scheduler" is rank 0); a node other
    than the first (--node-rank) starts only its ranks."""
    ctx = mp.get_context("spawn")
    port_args = PortArgs.create(server_args.dp_size)
    group = ServingProcesses(port_args, {})
    readers: dict[str, Connection] = {}
    for name, entry, child_args, child_ports, extra in _children(server_args, port_args):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_run_child,
            args=(entry, child_args, child_ports, writer, os.getpid(), *extra),
            name=f"srt-{name}",
            daemon=True,
        )
        proc.start()
        writer.close()  # the child holds the only writer: EOF on `reader` means it died
        group.children[name] = proc
        readers[name] = reader
    try:
        reports = _wait_ready(readers, timeout)
    except BaseException:
        group.shutdown()
        raise
    group.info = reports["scheduler"].info if "scheduler" in reports else None
    return group


def run_node_ranks(server_args: ServerArgs) -> None:
    """A node other than the first (--node-rank > 0): start its tensor-parallel ranks and wait until they end
    (rank 0 stopping ends them); RuntimeError naming a rank that failed."""
    processes = launch_processes(server_args)
    logger.info("node %d: ranks ready, serving for node 0", server_args.node_rank)
    try:
        wait([proc.sentinel for proc in processes.children.values()])
        time.sleep(0.5)  # the others end as well when rank 0 stopped: let them, then report any failure
        failed = [f"{name} (exit code {proc.exitcode})" for name, proc in processes.children.items() if proc.exitcode]
    finally:
        processes.shutdown()
    if failed:
        raise RuntimeError(f"node {server_args.node_rank}: {', '.join(failed)} ended with an error")


def _children(server_args: ServerArgs, port_args: PortArgs) -> list[tuple[str, str, ServerArgs, PortArgs, tuple]]:
    """(name, entry point, its server and port arguments, extra arguments) of every child this node starts.

    One scheduler per rank of each data-parallel replica; the ranks of a replica share a torch.distributed
    store of their own (--dist-init-addr, else a free loopback port per replica), and its rank 0 binds the
    replica's input. One detokenizer takes every replica's outputs."""
    if server_args.tp_size == 1 and server_args.dp_size == 1:
        return [(name, entry, server_args, port_args, ()) for name, entry in CHILDREN.items()]
    replica_args = [server_args] * server_args.dp_size
    if server_args.tp_size > 1:
        replica_args = [dataclasses.replace(server_args, dist_init_addr=_store_address(server_args, d))
                        for d in range(server_args.dp_size)]  # fmt: skip
    ranks = [
        (place.name, CHILDREN["scheduler"], replica_args[place.replica], port_args.of_replica(place.replica), (place,))
        for place in ranks_of_node(server_args)
    ]
    if server_args.node_rank > 0:
        return ranks
    return [*ranks, ("detokenizer", CHILDREN["detokenizer"], server_args, port_args, ())]


def _store_address(server_args: ServerArgs, replica: int) -> str:
    """The torch.distributed store of a replica's ranks: --dist-init-addr's port + replica, else a free one."""
    if server_args.dist_init_addr is None:
        return free_loopback_address()
    host, port = server_args.dist_init_addr.rsplit(":", 1)
    return f"{host}:{int(port) + replica}"


def _run_child(entry: str, *args: object) -> None:
    # Imported here, in the child: the main process never needs torch or the model code.
    module, function = entry.split(":")
    getattr(importlib.import_module(module), function)(*args)


def _wait_ready(readers: dict[str, Connection], timeout: float) -> dict[str, ReadyReport]:
    reports: dict[str, ReadyReport] = {}
    deadline = time.monotonic() + timeout
    by_conn = {conn: name for name, conn in readers.items()}
    while len(reports) < len(readers):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            waiting = ", ".join(name for name in readers if name not in reports)
            raise RuntimeError(f"the {waiting} process did not become ready within {timeout:.0f} s")
        for conn in wait([c for c, name in by_conn.items() if name not in reports], remaining):
            name = by_conn[conn]
            try:
                ready = conn.recv()
            except EOFError:
                raise RuntimeError(f"the {name} process exited before it was ready (see its log above)") from None
            if not ready.ok:
                raise RuntimeError(f"the {name} process failed to start:\n{ready.error}")
            reports[name] = ready
            logger.info("%s process ready", name)
    return reports
