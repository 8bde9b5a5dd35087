"""Softcapped logits in one pass, with each row's argmax (greedy ids) found on the way.

Gemma 4 caps its final logits: softcap * tanh(logits / softcap), in float32. Torch takes four passes over the
[rows, vocab] logits (the cast, the division, tanh, the product) and greedy sampling a fifth (argmax). Here
one kernel writes the capped float32 logits and, per block of 4096 ids, the block's largest value and its
lowest id; a second, tiny one reduces those to each row's argmax (ties: the lowest id; NaN counts as the
largest, as in torch.argmax). `softcap_logits_reference` is the math and the CPU path; `use_triton` as in
kernels/norm.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.kernels.triton_support import jit, pdl_launch, pdl_start, runs_triton, tl, triton


class Logits(NamedTuple):
    logits: torch.Tensor  # [rows, vocab] float32
    greedy_ids: torch.Tensor | None  # [rows] int64 argmax of each row (ties: the lowest id), or None


def softcap_logits_reference(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(logits.float() / softcap) * softcap


@jit
def _softcap_kernel(
    logits_ptr, out_ptr, block_max_ptr, block_argmax_ptr, vocab, softcap,
    BLOCK: tl.constexpr, WITH_ARGMAX: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One BLOCK of one row: the softcapped logits, and with WITH_ARGMAX the block's largest value and its
    lowest id (NaN counts as the largest, as in torch.argmax)."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    pdl_start(USE_PDL)
    ids = block * BLOCK + tl.arange(0, BLOCK)
    mask = ids < vocab
    y = tl.load(logits_ptr + row * vocab + ids, mask=mask, other=0.0).to(tl.float32) / softcap
    # tanh from exp(-2|y|) (no overflow); near 0 its Taylor series, where 1 - e would cancel
    e = tl.exp(-2.0 * tl.abs(y))
    large = (1.0 - e) / (1.0 + e)
    y2 = y * y
    small = tl.abs(y) * (1.0 - y2 * (1.0 / 3.0 - y2 * (2.0 / 15.0)))
    tanh_abs = tl.where(tl.abs(y) < 0.01, small, large)
    capped = tl.where(y < 0, -tanh_abs, tanh_abs) * softcap
    tl.store(out_ptr + row * vocab + ids, capped, mask=mask)
    if WITH_ARGMAX:
        # softcapped values are finite, so +inf stands for NaN; -inf for the padding past the vocabulary
        ranked = tl.where(mask, tl.where(capped != capped, float("inf"), capped), float("-inf"))
        best = tl.max(ranked, axis=0)
        partial = row * tl.num_programs(1) + block
        tl.store(block_max_ptr + partial, best)
        tl.store(block_argmax_ptr + partial, tl.min(tl.where(ranked == best, ids, vocab), axis=0))


@jit
def _row_argmax_kernel(
    block_max_ptr, block_argmax_ptr, out_ptr, num_blocks, BLOCKS: tl.constexpr, USE_PDL: tl.constexpr
):  # fmt: skip
    """Each row's argmax from its blocks' (largest value, lowest id): the lowest id among the largest."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCKS)
    mask = offsets < num_blocks
    pdl_start(USE_PDL)
    values = tl.load(block_max_ptr + row * num_blocks + offsets, mask=mask, other=float("-inf"))
    ids = tl.load(block_argmax_ptr + row * num_blocks + offsets, mask=mask, other=2**31 - 1)
    best = tl.max(values, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(values == best, ids, 2**31 - 1), axis=0).to(tl.int64))


def softcap_logits(
    logits: torch.Tensor, softcap: float, use_triton: bool | None = None, with_argmax: bool = False
) -> Logits:
    """softcap * tanh(logits / softcap) in float32 from [rows, vocab] logits of any float dtype: one pass on GPU,
    where torch takes four (the cast, the division, tanh, the product). `with_argmax`: each row's argmax too
    (on GPU only; None elsewhere), from the same pass plus a [rows, vocab / 4096] reduction, where
    torch.argmax would read the float32 logits again (20.8 us of an E4B batch-32 decode step on an H100)."""
    if not runs_triton(logits.device, use_triton, _softcap_kernel):
        return Logits(softcap_logits_reference(logits, softcap), None)
    logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    block = 4096
    num_blocks = triton.cdiv(vocab, block)
    block_max = block_argmax = greedy_ids = None
    if with_argmax:
        block_max = torch.empty((rows, num_blocks), dtype=torch.float32, device=logits.device)
        block_argmax = torch.empty((rows, num_blocks), dtype=torch.int32, device=logits.device)
        greedy_ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows and vocab:
        launch = pdl_launch(logits.device, _softcap_kernel)
        pdl = bool(launch)
        partials = (block_max, block_argmax) if with_argmax else (out, out)  # unread without the argmax
        _softcap_kernel[(rows, num_blocks)](
            logits, out, *partials, vocab, float(softcap),
            BLOCK=block, WITH_ARGMAX=with_argmax, USE_PDL=pdl, num_warps=8, **launch,
        )  # fmt: skip
        if with_argmax:
            blocks = max(triton.next_power_of_2(num_blocks), 2)
            _row_argmax_kernel[(rows,)](
                block_max, block_argmax, greedy_ids, num_blocks, BLOCKS=blocks, USE_PDL=pdl, num_warps=1, **launch
            )
    return Logits(out, greedy_ids)
