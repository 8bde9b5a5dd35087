"""Dynamic FP8 quantization of activations (#26): x [T, K] -> float8_e4m3fn x_q and float32 scales with
x ~ x_q * scale, scale = absmax / 448 per row (`group` None: the per-token scales of fp8-dynamic checkpoints
and `--quantization fp8`) or per row and `group` columns ([T, ceil(K / group)]: 128-groups of block
checkpoints). The input of the FP8 prefill GEMMs (`layers/fp8_linear.py`).

The torch reference makes ~6 passes over a float32 copy; the kernel reads x twice (absmax, then quantize) and
writes one byte per value: one program per (row, group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.kernels.triton_support import jit, runs_triton, tl

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_TINY = torch.finfo(torch.float32).tiny
BLOCK = 1024


def quantize_fp8(
    x: torch.Tensor, group: int | None = None, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [T, K] float8_e4m3fn, scale [T, 1] or [T, ceil(K / group)] float32); `use_triton` as in
    `triton_support.runs_triton` (None: the kernel on CUDA, the reference elsewhere)."""
    if not runs_triton(x.device, use_triton, _quantize_kernel):
        return quantize_fp8_reference(x, group)
    rows, k = x.shape
    group = group or k
    groups = -(-k // group)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_kernel[(rows, groups)](
            x, out, scale, k, x.stride(0), group, groups, FP8_MAX, _TINY, BLOCK=min(BLOCK, _pow2(group))
        )
    return out, scale


def quantize_fp8_reference(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8` in torch ops (float32 math, round to nearest even, saturating at +-448)."""
    rows, k = x.shape
    if group is None:
        scale = _ieee_div(x.abs().amax(dim=1, keepdim=True).float(), FP8_MAX).clamp(min=_TINY)
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(rows, groups, group)
    scale = _ieee_div(padded.abs().amax(dim=2), FP8_MAX).clamp(min=_TINY)
    q = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows, groups * group)[:, :k].contiguous(), scale


def _ieee_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor rounded as IEEE division (the kernel's `div_rn`): on CUDA torch divides by a Python scalar as
    a multiplication by its reciprocal, which differs in the last bit (found comparing the two on an H100)."""
    return x / torch.full_like(x, divisor)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@jit
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, k, row_stride, group, groups, fp8_max, tiny, BLOCK: tl.constexpr):
    """One (row, group): absmax over the group's columns, then each value / scale rounded to FP8."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    start = g * group
    end = tl.minimum(start + group, k)
    x_row = x_ptr + row.to(tl.int64) * row_stride
    absmax = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(start, end, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        values = tl.load(x_row + cols, mask=cols < end, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(values))
    scale = tl.maximum(tl.div_rn(tl.max(absmax, axis=0), fp8_max), tiny)  # IEEE division, as torch's
    tl.store(scale_ptr + row.to(tl.int64) * groups + g, scale)
    out_row = out_ptr + row.to(tl.int64) * k
    for c in range(start, end, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        values = tl.load(x_row + cols, mask=cols < end, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(values, scale), -fp8_max, fp8_max)  # IEEE division, as torch's
        tl.store(out_row + cols, round_to_e4m3(q).to(out_ptr.dtype.element_ty), mask=cols < end)


@jit
def round_to_e4m3(x):
    """float32 `x` (|x| <= 448) rounded to the nearest float8_e4m3fn value (ties to even), as float32, so the
    cast after it is exact: Triton's CPU interpreter truncates float32 -> float8 casts where the GPU rounds,
    and this keeps the tested path and the GPU path the same code (as `triton_support.round_to` for bf16).
    Normal values keep 3 of float32's 23 mantissa bits; below 2^-6 the grid is 2^-9 (subnormals), which adding
    and subtracting 1.5 * 2^14 (a float32 ulp of 2^-9 there) rounds |x| to; the sign is put back after (a tiny
    negative value rounds to -0, as torch's cast)."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    magnitude = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = tl.where(x < 0, -magnitude, magnitude)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal.to(tl.float32, bitcast=True))
