"""The MLP's gelu(x @ gate^T) * (x @ up^T) at prefill sizes as one Triton GEMM, gelu * up in its epilogue.

cuBLAS has no gated epilogue: its gate_up GEMM writes [rows, 2I] and `gelu_tanh_mul` reads it back and writes
[rows, I]. Here each program multiplies an M-block of x by a gate block and the matching up block of the stacked
weight (two accumulators, loaded by TMA, software-pipelined over K) and stores only the gated product, rounded
as the unfused path rounds (each GEMM's output, gelu's, the product's), so no [rows, 2I] tensor exists.

`prefill_gelu_mlp(x, gate_up_weight, tiles)`; `prefill_gated_applies` says where it runs (Hopper, 16-bit).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.kernels.gelu_mul import gelu_tanh_mul_rounded
from srt.kernels.triton_support import jit, round_to, tl, triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: no host-side TMA descriptors
    TensorDescriptor = None


class GatedTiles(NamedTuple):
    block_m: int
    block_n: int  # columns of the gated output (each of gate and up)
    block_k: int
    stages: int
    warps: int
    group_m: int = 8  # M-blocks that walk the N-blocks together (the weight's blocks reused from L2)


TILES = GatedTiles(128, 128, 64, 3, 8)


@jit
def _gated_gemm_kernel(
    x_desc, w_desc, out_ptr, rows, inter, k, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[M-block, N-block] = gelu(x @ w[:, N-block]) * (x @ w[:, inter + N-block]), w [K, 2 * inter]."""
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(rows, BLOCK_M)
    blocks_n = tl.cdiv(inter, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    block_m = first_m + (pid % per_group) % group_rows
    block_n = (pid % per_group) // group_rows
    m0, n0 = block_m * BLOCK_M, block_n * BLOCK_N
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in tl.range(0, k, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([m0, kk])  # rows past the end come as zeros
        gate = tl.dot(x, w_desc.load([kk, n0]), gate)
        up = tl.dot(x, w_desc.load([kk, inter + n0]), up)
    dtype = out_ptr.dtype.element_ty
    out = gelu_tanh_mul_rounded(round_to(gate, dtype), round_to(up, dtype), dtype)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = (offs_m < rows)[:, None] & (offs_n < inter)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :], out.to(dtype), mask=mask)


def prefill_gated_applies(x: torch.Tensor, gate_up_weight: torch.Tensor, tiles: GatedTiles = TILES) -> bool:
    """CUDA with host TMA descriptors, 16-bit x and weight alike, the weight stored transposed (a view of a
    contiguous [K, 2I]) with I a multiple of the N-block and K of the K-block."""
    if TensorDescriptor is None or not x.is_cuda:
        return False
    inter, k = gate_up_weight.shape[0] // 2, gate_up_weight.shape[1]
    return (
        gate_up_weight.t().is_contiguous()
        and x.dtype == gate_up_weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and inter % tiles.block_n == 0
        and k % tiles.block_k == 0
    )


def prefill_gelu_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, tiles: GatedTiles = TILES) -> torch.Tensor:
    """gelu_tanh(x @ gate^T) * (x @ up^T) [rows, I] in x's dtype for the stacked [2I, K] gate/up weight stored
    transposed: the values of `gelu_tanh_mul_packed(F.linear(x, gate_up_weight))` up to the GEMMs' summation
    order. Call where `prefill_gated_applies`."""
    x = x.contiguous()
    rows, k = x.shape
    inter = gate_up_weight.shape[0] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [tiles.block_m, tiles.block_k])
    w_desc = TensorDescriptor.from_tensor(gate_up_weight.t(), [tiles.block_k, tiles.block_n])
    grid = (triton.cdiv(rows, tiles.block_m) * (inter // tiles.block_n),)
    _gated_gemm_kernel[grid](
        x_desc, w_desc, out, rows, inter, k, out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, STAGES=tiles.stages,
        GROUP_M=tiles.group_m, num_warps=tiles.warps,
    )  # fmt: skip
    return out
