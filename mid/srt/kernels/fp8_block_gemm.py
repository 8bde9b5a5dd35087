"""The prefill GEMM of block-scaled FP8 weights (#26; fp8-block checkpoints): FP8 activations with a scale per
row and 128-column group (`fp8_quant.quantize_fp8(x, 128)`) times FP8 weights with a scale per row and
128-column block (`layers/fp8_linear.py`'s row form of the checkpoint's 128 x 128 tiles), on FP8 tensor cores:

    out[m, n] = sum over K-blocks b of (x_q[m, b] . w_q[n, b]) * x_scale[m, b] * w_scale[n, b]

Each K-step is one scale group (BLOCK_K = the group width), so the two scales multiply each step's float32
product. `torch._scaled_mm` takes one scale per row and column only, hence this kernel. Untuned tiles.
"""

from __future__ import annotations

import torch

from srt.kernels.triton_support import dot_options, jit, runs_triton, tl, triton

TILES = (128, 128, 3, 8)  # BLOCK_M, BLOCK_N, stages, warps
GROUP_M = 8  # row tiles that share their column tiles' weight reads in L2


def block_fp8_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group: int,
    out_dtype: torch.dtype,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """[T, N] in `out_dtype` for x_q [T, K] with x_scale [T, ceil(K / group)] and weight [N, K] with weight_scale
    [N, ceil(K / group)]; `use_triton` as in `triton_support.runs_triton`."""
    if not runs_triton(x_q.device, use_triton, _block_fp8_gemm_kernel):
        return block_fp8_gemm_reference(x_q, x_scale, weight, weight_scale, group, out_dtype)
    rows, k = x_q.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=out_dtype, device=x_q.device)
    if rows == 0:
        return out
    block_m, block_n, stages, warps = TILES
    precision, upcast = dot_options(_block_fp8_gemm_kernel, torch.float8_e4m3fn)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)
    _block_fp8_gemm_kernel[grid](
        x_q, x_scale, weight, weight_scale, out, rows, n, k, x_q.stride(0), weight.stride(0), x_scale.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=group, GROUP_M=GROUP_M, PRECISION=precision, UPCAST=upcast,
        num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return out


def block_fp8_gemm_reference(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`block_fp8_gemm` as both operands dequantized to float32, then one product."""
    k = x_q.shape[1]
    x = x_q.float() * x_scale.repeat_interleave(group, dim=1)[:, :k]
    w = weight.float() * weight_scale.repeat_interleave(group, dim=1)[:, :k]
    return (x @ w.t()).to(out_dtype)


@jit
def _block_fp8_gemm_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, rows, n, k, x_stride, w_stride, scale_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] output tile; tiles are ordered GROUP_M row tiles at a time (L2 reuse of weights)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(rows, BLOCK_M), tl.cdiv(n, BLOCK_N)
    group_size = GROUP_M * tiles_n
    first_m = (pid // group_size) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % group_rows
    pid_n = (pid % group_size) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < rows, offs_n < n
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, tl.cdiv(k, BLOCK_K)):
        cols = b * BLOCK_K + offs_k
        x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & (cols < k)[None, :], other=0.0)
        w = tl.load(w_rows + cols[None, :], mask=n_mask[:, None] & (cols < k)[None, :], other=0.0)
        x_scale = tl.load(x_scale_ptr + offs_m * scale_cols + b, mask=m_mask, other=0.0)
        w_scale = tl.load(w_scale_ptr + offs_n * scale_cols + b, mask=n_mask, other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        product = tl.dot(x, tl.trans(w), input_precision=PRECISION)
        acc += product * x_scale[:, None] * w_scale[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * n + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
