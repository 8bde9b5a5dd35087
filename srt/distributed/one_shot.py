"""A one-shot all-reduce for the small messages of decode steps: every rank copies its partial sum into a
buffer in symmetric memory (mapped into every rank's address space), and one kernel per rank reads all ranks'
buffers over NVLink and adds them. torch's `symm_mem` ops do the work (barriers on signal pads before the reads
and after them, so the next call cannot overwrite a buffer a peer is still reading); this class only owns the
buffer. NCCL's ring costs 25-28 us per all-reduce of a decode step's message on two H200s, and 31B runs 120
of them per step (bench/tp_timing.py measures both).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BUFFER_BYTES = 2 * 1024 * 1024  # 32 rows x 5376 float32 (31B's decode batch 32) is 0.7 MiB
ALIGNMENT = 16  # the kernel's vector width: messages whose bytes it does not divide go to NCCL


class OneShotAllReduce:
    """Sums a tensor over the ranks of the default process group through symmetric memory. Build it on every
    rank at the same point (the buffer's rendezvous is a collective)."""

    def __init__(self, device: torch.device, buffer_bytes: int = BUFFER_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(buffer_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in (torch.float32, torch.bfloat16)
            and x.is_contiguous()
            and nbytes <= self.buffer.numel()
            and nbytes % ALIGNMENT == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `x` (which `fits`), as a new tensor."""
        nbytes = x.numel() * x.element_size()
        staging = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)


def try_one_shot_all_reduce(device: torch.device) -> OneShotAllReduce | None:
    """The one-shot all-reduce of this rank, or None (NCCL for everything) where the GPUs cannot map each
    other's memory; the reason is logged."""
    dist.all_reduce(torch.zeros(1, device=device))  # NCCL's communicator exists before the rendezvous
    try:
        one_shot = OneShotAllReduce(device)
        probe = torch.ones(ALIGNMENT // 4, dtype=torch.float32, device=device)
        total = one_shot(probe)
        if not torch.equal(total, probe * dist.get_world_size()):
            raise RuntimeError(f"probe sum {total.tolist()}")
    except (RuntimeError, AttributeError) as error:  # no P2P between these GPUs, or a torch without the ops
        logger.warning("one-shot all-reduce unavailable, NCCL for every all-reduce: %s", error)
        return None
    logger.info("one-shot all-reduce in symmetric memory for messages up to %d KiB", one_shot.buffer.numel() // 1024)
    return one_shot
