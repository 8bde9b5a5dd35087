"""The tensor-parallel ranks of one server: which device each owns, how they join torch.distributed, and how
rank 0 hands every iteration's inputs to the others.

Each rank runs a whole Scheduler over its shard of the model. Rank 0 alone talks to the other processes
(ZMQ); at the top of every loop iteration it broadcasts what it received (requests, aborts) and what it
decided from its clock (requests that waited past --request-timeout) over a gloo group. Every rank then
applies the same inputs to the same state and so schedules the same step: the same batch, the same KV slots,
the same collectives in the same order, the same sampled tokens (identical logits after the gather, generators
seeded alike). Broadcasting the inputs (a few bytes per iteration) rather than each step's batch keeps the
scheduler one code path for one rank and for many.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import NamedTuple

import torch
import torch.distributed as dist

from srt import envs
from srt.distributed.placement import RankPlace
from srt.server_args import ServerArgs

# what may differ between the nodes of one server (paths name the same checkpoint wherever it lies on each node);
# every other argument decides what each rank computes
PER_NODE_ARGS = (
    "node_rank", "base_gpu_id", "host", "port", "log_level", "log_interval",
    "model_path", "tokenizer_path", "speculative_draft_model_path", "allowed_local_media_path",
)  # fmt: skip

# A rank waits this long for the others inside a collective before it fails (an idle rank 0 still broadcasts
# every second, so only a stuck or dead rank gets there); as long as start-up may take, since loading a large
# checkpoint from a slow disk sits between the first collectives.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


def rank_device(server_args: ServerArgs, place: RankPlace) -> torch.device:
    """A scheduler's device, made current: its GPU (`RankPlace.gpu`), or the CPU. RuntimeError when the GPUs
    are too few."""
    wants_cuda = server_args.device == "cuda" or (server_args.device == "auto" and torch.cuda.is_available())
    if not wants_cuda:
        return torch.device("cpu")
    needed = server_args.base_gpu_id + server_args.dp_size * server_args.tp_size // server_args.nnodes
    found = torch.cuda.device_count()
    if found < needed:
        replicas = f"--dp-size {server_args.dp_size} x " if server_args.dp_size > 1 else ""
        raise RuntimeError(
            f"{replicas}--tp-size {server_args.tp_size} on {server_args.nnodes} node(s) from --base-gpu-id "
            f"{server_args.base_gpu_id} needs GPUs 0..{needed - 1} on this node; torch sees {found}"
        )
    device = torch.device("cuda", place.gpu(server_args))
    torch.cuda.set_device(device)  # Triton launches and bare "cuda" tensors go to the current device
    return device


class StepInputs(NamedTuple):
    """What rank 0 hands every rank at the top of a loop iteration."""

    messages: list[object]  # requests, aborts, stats requests, in arrival order
    expired: list[str]  # rids of waiting requests dropped for --request-timeout
    stop: bool = False  # rank 0 is exiting: so are the others


class TensorParallelGroup:
    """This rank's membership of torch.distributed: the default group runs the model's collectives (NCCL on
    GPUs, gloo on CPUs), a gloo group carries rank 0's step inputs."""

    def __init__(self, server_args: ServerArgs, place: RankPlace) -> None:
        self.place = place
        self.device = device = rank_device(server_args, place)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{server_args.dist_init_addr}",
            world_size=place.size,
            rank=place.rank,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self.control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        self._check_same_args(server_args)

    def _check_same_args(self, server_args: ServerArgs) -> None:
        """ValueError on every rank when one was started with other arguments or environment switches than rank
        0 where they decide the steps (a node with another --chunked-prefill-size or GEMMA4_YOCO would run other
        steps and desynchronise); the rank that differs names what."""
        mine = (server_args, envs.step_shaping_values())
        box = [mine]
        dist.broadcast_object_list(box, src=0, group=self.control)
        first_args, first_env = box[0]
        differ = [
            f"--{f.name.replace('_', '-')} {getattr(server_args, f.name)!r} (rank 0: {getattr(first_args, f.name)!r})"
            for f in dataclasses.fields(ServerArgs)
            if f.name not in PER_NODE_ARGS and getattr(server_args, f.name) != getattr(first_args, f.name)
        ]
        differ += [f"{name}={value!r} (rank 0: {first_env[name]!r})" for name, value in mine[1].items()
                   if value != first_env[name]]  # fmt: skip
        flag = torch.tensor([len(differ)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        if differ:
            rank = self.place.rank
            raise ValueError(f"rank {rank} was started with other arguments than rank 0: {'; '.join(differ)}")
        if flag.item():
            raise ValueError("another rank was started with other arguments than rank 0 (its log names them)")

    def share(self, inputs: StepInputs | None) -> StepInputs:
        """Rank 0 passes its inputs and gets them back; every other rank passes None and gets rank 0's."""
        box = [inputs]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def agree_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum over the ranks (pool sizes, so that every rank allocates the same slots)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return tensor.tolist()

    def close(self) -> None:
        """Leave torch.distributed. On GPUs nothing is torn down: destroying an NCCL group whose collectives
        CUDA graphs captured hangs (measured on H200, torch 2.11), and the process is exiting anyway."""
        if dist.is_initialized() and self.device.type != "cuda":
            dist.destroy_process_group()
