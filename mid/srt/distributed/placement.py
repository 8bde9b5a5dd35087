"""Which tensor-parallel ranks a node runs (imported by the launching process, which never imports torch)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from srt.server_args import ServerArgs


@dataclass(frozen=True)
class RankPlace:
    """Where one scheduler process runs: its tensor-parallel rank in its data-parallel replica."""

    rank: int  # among all ranks of the replica, over every node
    size: int  # --tp-size
    local_rank: int  # among the replica's ranks on this node
    replica: int = 0  # --dp-size replicas, on one node

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def name(self) -> str:
        """The process's name: "scheduler" is replica 0's rank 0, the one whose info the server reports."""
        replica = f"-dp{self.replica}" if self.replica else ""
        rank = f"-{self.rank}" if self.rank else ""
        return f"scheduler{replica}{rank}"

    def gpu(self, server_args: ServerArgs) -> int:
        """Its GPU: --base-gpu-id, then the replicas before it, then its local rank."""
        return server_args.base_gpu_id + self.replica * (self.size // server_args.nnodes) + self.local_rank


def ranks_of_node(server_args: ServerArgs) -> list[RankPlace]:
    """The schedulers this node runs: of each replica, --tp-size / --nnodes ranks from node_rank * that many."""
    per_node = server_args.tp_size // server_args.nnodes
    first = server_args.node_rank * per_node
    return [
        RankPlace(first + i, server_args.tp_size, i, replica)
        for replica in range(server_args.dp_size)
        for i in range(per_node)
    ]


def free_loopback_address() -> str:
    """HOST:PORT of a loopback port that nothing listens on now (the TCP store of a one-node server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"
