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

from srt.kernels.triton_support import jit, round_to_e4m3, runs_triton, tl

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_TINY = torch.finfo(torch.float32).tiny
# in-kernel quantization (`quantize_tile_rows`): a zero row's absmax becomes this, so its scale is float32's tiny
# (as `quantize_fp8`'s) and q is 0 (no 0 * inf)
MIN_ABSMAX = FP8_MAX * _TINY
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
def quantize_tile_rows(x, FP8_MAX: tl.constexpr, MIN_ABSMAX: tl.constexpr, INTERPRETED: tl.constexpr):
    """A GEMM kernel's activation tile x [BLOCK_M, BLOCK_K] -> (float8e4nv q, float32 scale [BLOCK_M]) with
    x ~ q * scale per row: scale = absmax / 448, q = x * (448 / absmax) rounded to nearest even (a multiply per
    value, not `quantize_fp8`'s division; the two can differ by one e4m3 step). The W8A8 decode GEMM quantizes
    each K-step of its rows with it (`decode_gemm_fp8_variants.py`)."""
    x = x.to(tl.float32)
    absmax = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_ABSMAX)
    inverse = tl.div_rn(tl.full(absmax.shape, FP8_MAX, tl.float32), absmax)  # IEEE, as the torch reference's
    q = tl.clamp(x * inverse[:, None], -FP8_MAX, FP8_MAX)
    if INTERPRETED:  # the interpreter's float32 -> fp8 cast truncates; the GPU's (cvt.rn) rounds to nearest even
        q = round_to_e4m3(q)
    return q.to(tl.float8e4nv), tl.div_rn(absmax, FP8_MAX)
