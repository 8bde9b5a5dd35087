"""Decode-sized projections (<= 32 rows) as a chained Triton GEMM, where cuBLAS cannot be chained.

cuBLAS's kernels do not wait for the kernel ahead of them (bench/probe_cublas_chain.py), so in a captured
decode step each cuBLAS GEMM launches only once its producer has finished: 0.45-0.93 us of idle GPU before
each. This kernel is launched chained (`triton_support.pdl_start`): its CTAs are resident before the producer
ends. Weight tiles come by TMA, software-pipelined over K; on an H100 it streams E4B's projections as fast as
cuBLAS on their own (bench/bench_tma_gemm.py: gate_up 39.0 vs 38.9 us, down 21.7 vs 21.4, o 7.0 vs 6.9).

`decode_linear(x, weight, splits)`: with splits == 1 the product in x's dtype (rounded once from float32);
with more, [splits, rows, N] float32 partial sums over K-chunks, the form `fused_kernels.add_rms_norm` sums
(as `split_k.linear_partials`). SRT_TRITON_GEMM=0 leaves every projection to cuBLAS (A/B runs).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from srt.layers.triton_support import has_pdl, jit, pdl_launch, pdl_start, tl, triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: no host-side TMA descriptors
    TensorDescriptor = None

ENABLED = os.environ.get("SRT_TRITON_GEMM", "1") != "0"
MAX_ROWS = 32


class GemmTiles(NamedTuple):
    block_n: int
    block_k: int
    stages: int


# H100 sweeps at 32 rows (bench/bench_tma_gemm.py): N-blocks of 128-256 columns, 4 stages of 64-128 K
TILES = {1: GemmTiles(256, 64, 4), 4: GemmTiles(128, 128, 4)}


@jit
def _decode_gemm_kernel(
    x_desc, w_desc, out_ptr, rows, n, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """out[split, :, N-block] = x[:, K-chunk] @ w[K-chunk, N-block], w [K, N] row-major (srt's stored layout)."""
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    pdl_start(USE_PDL)  # x comes from the kernel ahead
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * k_per_split
    for k in tl.range(k_start, k_start + k_per_split, BLOCK_K, num_stages=STAGES):
        acc = tl.dot(x_desc.load([0, k]), w_desc.load([k, n0]), acc)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    out = out_ptr + (split * rows + offs_m)[:, None] * n + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < rows)[:, None])


def decode_gemm_applies(x: torch.Tensor, weight: torch.Tensor, splits: int) -> bool:
    """Whether `decode_linear` runs this product: CUDA with TMA (Hopper), <= 32 rows of a 16-bit dtype, weight
    stored transposed (a view of a contiguous [K, N]) with N and K multiples of the tiles."""
    if not (ENABLED and TensorDescriptor is not None and x.is_cuda and has_pdl(x.device)):
        return False
    rows, k = x.shape
    tiles = TILES.get(splits)
    return (
        tiles is not None
        and 0 < rows <= MAX_ROWS
        and weight.t().is_contiguous()
        and weight.shape[0] % tiles.block_n == 0
        and k % (splits * tiles.block_k) == 0
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)  # float32 would multiply in TF32 on the tensor cores
    )


def decode_linear(x: torch.Tensor, weight: torch.Tensor, splits: int = 1) -> torch.Tensor:
    """x @ weight^T for x [rows, K] and an nn.Linear weight [N, K] stored transposed: [rows, N] in x's dtype
    (splits == 1) or [splits, rows, N] float32 partial sums. Call only where `decode_gemm_applies`."""
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    tiles = TILES[splits]
    block_m = max(16, triton.next_power_of_2(rows))
    shape = (rows, n) if splits == 1 else (splits, rows, n)
    out = torch.empty(shape, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, tiles.block_k])
    w_desc = TensorDescriptor.from_tensor(weight.t(), [tiles.block_k, tiles.block_n])
    launch = pdl_launch(x.device, _decode_gemm_kernel)
    _decode_gemm_kernel[(n // tiles.block_n, splits)](
        x_desc, w_desc, out, rows, n, k // splits,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, STAGES=tiles.stages,
        USE_PDL=bool(launch), num_warps=4, **launch,
    )  # fmt: skip
    return out
