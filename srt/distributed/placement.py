"""Which tensor-parallel ranks a node runs (imported by the launching process, which never imports torch)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from srt.server_args import ServerArgs


@dataclass(frozen=True)
class RankPlace:
    """Where one tensor-parallel rank runs."""

    rank: int  # among all ranks of every node
    size: int  # --tp-size
    local_rank: int  # among the ranks of this node

    @property
    def is_first(self) -> bool:
        return self.rank == 0


def ranks_of_node(server_args: ServerArgs) -> list[RankPlace]:
    """The ranks this node runs: --tp-size / --nnodes of them, from node_rank * that many."""
    per_node = server_args.tp_size // server_args.nnodes
    first = server_args.node_rank * per_node
    return [RankPlace(first + i, server_args.tp_size, i) for i in range(per_node)]


def free_loopback_address() -> str:
    """HOST:PORT of a loopback port that nothing listens on now (the TCP store of a one-node server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"
