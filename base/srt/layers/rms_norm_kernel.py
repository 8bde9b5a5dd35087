"""Fused RMSNorm for GPUs: one Triton program per row, float32 math, one kernel instead of ~8 torch ops.

A Gemma 4 layer applies up to eight norms (input, post-attention, pre/post-feedforward, q/k/v, per-layer
input); as separate torch ops they dominated prefill kernel launches. The math matches `RMSNorm`'s reference:
upcast to float32, x * (mean(x^2) + eps)^-0.5, times the float32 weight, cast back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, stride_x, stride_out, n_cols, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols
    y = x / tl.sqrt(mean_square + eps)
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` (any leading shape), output in x's dtype."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight if weight is not None else rows, out, rows.stride(0), out.stride(0), dim, eps,
            HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return out.view(x.shape)
