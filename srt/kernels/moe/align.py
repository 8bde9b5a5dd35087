"""`ExpertBlocks` of a few hundred slots in one launch: the decode-size twin of `pad_to_blocks(sort_by_expert())`.

In torch, sorting and padding the slots takes ~20 small kernels (sort, scatter_add, cumsums, searchsorted,
index, ...). At decode there are top_k * rows <= a few hundred slots, each of those kernels is a ~2 us launch
and a 26B-A4B step runs 30 MoE layers. This kernel is one program that computes the same layout:

    counts[e]        slots routed to expert e                          (one-hot sums over chunks of slots)
    padded[e]        counts[e] rounded up to BLOCK_M; starts/ends by cumsum
    block_expert[b]  experts whose padded run ends at or before row b * BLOCK_M, clamped to E - 1
    row of slot s    starts[e] + (earlier slots of expert e), so runs keep slot order (a stable sort)

`slot_of_row` must arrive filled with the sentinel `num_slots` (rows the kernel writes are exactly the used
ones). Work grows with slots x experts, so `fused_experts` uses it only up to `ALIGN_MAX_SLOTS`.
"""

from __future__ import annotations

import torch

from srt.kernels.triton_support import jit, tl, triton

ALIGN_MAX_SLOTS = 2048
# slots compared with each other (and with every expert) at once: the slot count's power of two, 16 to 128. The
# kernel is one program whose time is the chain of its tiles' reductions: on an H100 (bench/tune/tune_moe_align.py)
# 8 slots took 9.0 us with 128-slot chunks and 2.5 with 16, 32 slots 9.0 and 3.4; 256 slots 17 us with 128 or 64,
# 113 with 256 (spilled)
MIN_CHUNK, MAX_CHUNK = 16, 128


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
    experts = tl.arange(0, EXPERTS_POW2)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([EXPERTS_POW2], dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_slots, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_rows_ptr, tl.sum(padded, axis=0).to(tl.int64))

    # what searchsorted(ends, block_start, right=True) gives; the padding experts past NUM_EXPERTS have
    # empty runs ending at the total, so they only count for blocks past it, which the clamp maps to E - 1
    for block0 in range(0, max_blocks, CHUNK):
        blocks = block0 + offs
        first_rows = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_rows[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.minimum(expert, NUM_EXPERTS - 1), mask=blocks < max_blocks)

    seen = tl.zeros([EXPERTS_POW2], dtype=tl.int32)  # slots of each expert placed by earlier chunks
    for start in range(0, num_slots, CHUNK):
        slots = start + offs
        ok = slots < num_slots
        ids = tl.load(ids_ptr + slots, mask=ok, other=-1)
        one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)
        base = tl.sum(one_hot * (starts + seen)[None, :], axis=1)
        earlier_same = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None])
        rank = tl.sum(earlier_same.to(tl.int32), axis=1)
        tl.store(slot_of_row_ptr + base + rank, slots.to(tl.int32), mask=ok)
        seen += tl.sum(one_hot, axis=0)


def align_slots(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot_of_row int32, block_expert int32, num_rows int64 [1]) for `expert_ids` [tokens, top_k], equal to
    `pad_to_blocks(sort_by_expert(expert_ids, num_experts), block_m)` (same shapes, same values)."""
    flat = expert_ids.reshape(-1)
    num_slots = flat.numel()
    if num_slots > ALIGN_MAX_SLOTS:
        raise ValueError(f"align_slots handles up to {ALIGN_MAX_SLOTS} slots, got {num_slots}")
    max_blocks = max_blocks_for(num_slots, num_experts, block_m)
    device = flat.device
    slot_of_row = torch.full((max_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_rows = torch.empty(1, dtype=torch.int64, device=device)
    _align_kernel[(1,)](
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
