"""`ExpertBlocks` of a few hundred slots in one launch: the decode-size twin of `pad_to_blocks(sort_by_expert())`.

In torch, sorting and padding the slots takes ~20 small kernels (sort, scatter_add, cumsums, searchsorted,
index, ...). At decode there are top_k * rows <= a few hundred slots, each of those kernels is a ~2 us launch
and a 26B-A4B step runs 30 MoE layers. This kernel computes the same layout in one launch of one program per
expert; every program counts all slots (the run starts need every expert's count) and then lays out its own run:

    counts[e]        slots routed to expert e (a histogram of the ids)
    padded[e]        counts[e] rounded up to BLOCK_M; run e spans rows [start[e], start[e] + padded[e])
    row of slot s    start[e] + (earlier slots of expert e), so runs keep slot order (a stable sort); the
                     run's padding rows get the sentinel num_slots
    block_expert[b]  e for the blocks of run e; E - 1 for the blocks past the last run (the last program, which
                     also fills the rows past it with the sentinel and stores the row total)

So every row and block is written by exactly one program, and the outputs need no fill beforehand. The
one-program form before it chained ~10 reductions over [slots x experts] tiles: 17-20 us at 256 slots
(26B-A4B decode at batch 32, top 8) on an H100, 4% of the step. Work per program grows with the slots, so
`fused_experts` uses it only up to `ALIGN_MAX_SLOTS`.
"""

from __future__ import annotations

import torch

from srt.kernels.triton_support import jit, tl, triton

ALIGN_MAX_SLOTS = 2048
# slots loaded at once: the slot count's power of two, 16 to 512
MIN_CHUNK, MAX_CHUNK = 16, 512


def chunk_for(num_slots: int) -> int:
    """The kernel's slot chunk for `num_slots` slots (MIN_CHUNK to MAX_CHUNK)."""
    return min(max(triton.next_power_of_2(num_slots), MIN_CHUNK), MAX_CHUNK)


def max_blocks_for(num_slots: int, num_experts: int, block_m: int) -> int:
    """Blocks of `block_m` rows that `num_slots` slots can need at most: each expert that holds any pads its run."""
    return -(-(num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m)


@jit
def _align_kernel(
    ids_ptr,
    slot_of_row_ptr,
    block_expert_ptr,
    num_rows_ptr,
    num_slots,
    max_blocks,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    expert = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_POW2)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([EXPERTS_POW2], dtype=tl.int32)
    for first in range(0, num_slots, CHUNK):
        ok = first + offs < num_slots
        counts += tl.histogram(tl.load(ids_ptr + first + offs, mask=ok, other=0), EXPERTS_POW2, mask=ok)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    mine = experts == expert
    start = tl.sum(tl.where(mine, ends - padded, 0), axis=0)
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    end = start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M

    placed = 0  # this expert's slots in earlier chunks
    for first in range(0, num_slots, CHUNK):
        slots = first + offs
        ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1)
        ours = ids == expert
        rank = placed + tl.cumsum(ours.to(tl.int32), axis=0) - 1
        tl.store(slot_of_row_ptr + start + rank, slots.to(tl.int32), mask=ours)
        placed += tl.sum(ours.to(tl.int32), axis=0)
    padding = count + tl.arange(0, BLOCK_M)  # a run has fewer than BLOCK_M padding rows
    tl.store(slot_of_row_ptr + start + padding, num_slots, mask=start + padding < end)
    for block0 in range(start // BLOCK_M, end // BLOCK_M, CHUNK):
        blocks = block0 + offs
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < end // BLOCK_M)

    if expert == NUM_EXPERTS - 1:  # past the last run: blocks of expert E - 1 (searchsorted's clamp), no slots
        total = tl.sum(padded, axis=0)
        tl.store(num_rows_ptr, total.to(tl.int64))
        for row0 in range(total, max_blocks * BLOCK_M, CHUNK):
            rows = row0 + offs
            tl.store(slot_of_row_ptr + rows, num_slots, mask=rows < max_blocks * BLOCK_M)
        for block0 in range(total // BLOCK_M, max_blocks, CHUNK):
            blocks = block0 + offs
            tl.store(block_expert_ptr + blocks, NUM_EXPERTS - 1, mask=blocks < max_blocks)


def align_slots(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot_of_row int32, block_expert int32, num_rows int64 [1]) for `expert_ids` [tokens, top_k], equal to
    `pad_to_blocks(sort_by_expert(expert_ids, num_experts), block_m)` (same shapes, same values)."""
    flat = expert_ids.reshape(-1)
    num_slots = flat.numel()
    if num_slots > ALIGN_MAX_SLOTS:
        raise ValueError(f"align_slots handles up to {ALIGN_MAX_SLOTS} slots, got {num_slots}")
    if block_m & (block_m - 1):
        raise ValueError(f"align_slots needs a power-of-two block_m, got {block_m}")
    max_blocks = max_blocks_for(num_slots, num_experts, block_m)
    device = flat.device
    slot_of_row = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_rows = torch.empty(1, dtype=torch.int64, device=device)
    _align_kernel[(num_experts,)](
        flat.to(torch.int32),
        slot_of_row,
        block_expert,
        num_rows,
        num_slots,
        max_blocks,
        NUM_EXPERTS=num_experts,
        EXPERTS_POW2=triton.next_power_of_2(num_experts),
        BLOCK_M=block_m,
        CHUNK=chunk_for(num_slots),
        num_warps=4,
    )
    return slot_of_row, block_expert, num_rows
