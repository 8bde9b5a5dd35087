"""Decode-sized projections (<= 32 rows) as a chained Triton GEMM, where cuBLAS cannot be chained.

cuBLAS's kernels do not wait for the kernel ahead of them (a probe of the eighth session: docs/history/), so in a
captured decode step each cuBLAS GEMM launches only once its producer has finished: 0.45-0.93 us of idle GPU
before each. This kernel is launched chained (`triton_support.pdl_start`): its CTAs are resident before the producer
ends. Weight tiles come by TMA, software-pipelined over K; on an H100 it streams E4B's projections as fast as
cuBLAS on their own (H100, eighth session: gate_up 39.0 vs 38.9 us, down 21.7 vs 21.4, o 7.0 vs 6.9).

`decode_linear(x, weight, splits)`: with splits == 1 the product in x's dtype (rounded once from float32);
with more, [splits, rows, N] float32 partial sums over K-chunks, the form the norm kernels sum
(`layers/linear.py`). `decode_gelu_mlp(x, gate_up_weight)`: the MLP's gelu(gate) * up straight
from the stacked gate/up weight, each CTA multiplying a gate block and the matching up block and applying
`gelu_tanh_mul_rounded` to the two rounded products, so no [rows, 2 * intermediate] tensor and no gelu
launch. SRT_TRITON_GEMM=0 leaves every projection to cuBLAS (A/B runs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt import envs
from srt.kernels.gelu_mul import gelu_tanh_mul_rounded
from srt.kernels.triton_support import (
    has_pdl,
    jit,
    pdl_launch,
    pdl_start,
    round_to,
    tl,
    triton,
)

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: no host-side TMA descriptors
    TensorDescriptor = None

ENABLED = envs.SRT_TRITON_GEMM.enabled()
MAX_ROWS = 32
GATED = "gated"  # the tiles key of `decode_gelu_mlp`


class GemmTiles(NamedTuple):
    block_n: int
    block_k: int
    stages: int
    warps: int = 4


# H100 sweeps at 32 rows of E4B's projections (bench/tune/tune_decode_gemm.py, session18-tune-decode-gemm.json): gate_up
# (gelu in the epilogue) 128-column halves, 4 stages; K-chunked projections 128 x 64 tiles in 5 stages (down 24.3
# vs 24.7 us with 128 x 128 x 4, o 9.7 vs 9.8), narrower and deeper where 128 columns give under 80 CTAs (q of
# the sliding layers, N 2048: 9.4 vs 10.1)
TILES = {1: GemmTiles(256, 64, 4), 4: GemmTiles(128, 64, 5), GATED: GemmTiles(128, 64, 4)}
NARROW_TILES = GemmTiles(64, 128, 4)
MIN_CTAS = 80
# the MoE router (N = 128 experts, K = 2816 on 26B-A4B): 64-column tiles over 256-wide K-chunks give 2 x 11 CTAs,
# each one chunk of the weight, whose float32 partials the top-k kernel sums (`kernels/moe/routing.py`)
ROUTER_TILES = GemmTiles(64, 256, 2)


def tiles_for(splits: int | str, n: int) -> GemmTiles | None:
    """srt's tiles for `splits` (1, 4 or GATED) and output width n (None: no tiles for that split count)."""
    tiles = TILES.get(splits)
    if splits == 4 and n // tiles.block_n * splits < MIN_CTAS:
        return NARROW_TILES
    return tiles


@jit
def _decode_gemm_kernel(
    x_desc, w_desc, out_ptr, rows, n, k_per_split, up_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    GATED: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """out[split, :, N-block] = x[:, K-chunk] @ w[K-chunk, N-block], w [K, N] row-major (srt's stored layout);
    GATED: out[:, N-block] = gelu(x @ w[:, N-block]) * (x @ w[:, up_offset + N-block]), rounded as torch."""
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    k_start = split * k_per_split
    pdl_start(USE_PDL)  # x comes from the kernel ahead
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_start, k_start + k_per_split, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([0, k])
        acc = tl.dot(x, w_desc.load([k, n0]), acc)
        if GATED:
            acc_up = tl.dot(x, w_desc.load([k, up_offset + n0]), acc_up)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    out = out_ptr + (split * rows + offs_m)[:, None] * n + offs_n[None, :]
    dtype = out_ptr.dtype.element_ty
    if GATED:  # the GEMM's two rounded outputs, then gelu_tanh_mul's rounding
        acc = gelu_tanh_mul_rounded(round_to(acc, dtype), round_to(acc_up, dtype), dtype)
    tl.store(out, acc.to(dtype), mask=(offs_m < rows)[:, None])


def decode_gemm_applies(
    x: torch.Tensor, weight: torch.Tensor, splits: int | str, tiles: GemmTiles | None = None
) -> bool:
    """Whether `decode_linear` (splits 1 or 4, or any with `tiles`) or `decode_gelu_mlp` (splits GATED) runs this
    product: CUDA with TMA (Hopper), <= 32 rows of a 16-bit dtype, weight stored transposed (a view of a
    contiguous [K, N]) with N (each half of it for GATED) and K multiples of the tiles."""
    if not (ENABLED and TensorDescriptor is not None and x.is_cuda and has_pdl(x.device)):
        return False
    rows, k = x.shape
    n = weight.shape[0] // 2 if splits == GATED else weight.shape[0]
    tiles = tiles or tiles_for(splits, n)
    if tiles is None:
        return False
    chunks = 1 if splits == GATED else splits
    return (
        0 < rows <= MAX_ROWS
        and weight.t().is_contiguous()
        and n % tiles.block_n == 0
        and k % (chunks * tiles.block_k) == 0
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)  # float32 would multiply in TF32 on the tensor cores
    )


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, splits: int = 1, tiles: GemmTiles | None = None
) -> torch.Tensor:
    """x @ weight^T for x [rows, K] and an nn.Linear weight [N, K] stored transposed: [rows, N] in x's dtype
    (splits == 1) or [splits, rows, N] float32 partial sums. Call only where `decode_gemm_applies`; `tiles`
    overrides srt's (bench/tune/tune_decode_gemm.py)."""
    rows, n = x.shape[0], weight.shape[0]
    shape = (rows, n) if splits == 1 else (splits, rows, n)
    out = torch.empty(shape, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    _launch(x, weight, out, splits, n, tiles or tiles_for(splits, n), gated=False)
    return out


def decode_gelu_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, tiles: GemmTiles | None = None) -> torch.Tensor:
    """gelu_tanh(x @ gate^T) * (x @ up^T) [rows, I] in x's dtype, for the stacked [2I, K] gate/up weight stored
    transposed; the values of `gelu_tanh_mul_packed(decode_linear(x, gate_up_weight))`. Call only where
    `decode_gemm_applies(x, gate_up_weight, GATED)`; `tiles` as in `decode_linear`."""
    rows, n = x.shape[0], gate_up_weight.shape[0] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _launch(x, gate_up_weight, out, 1, n, tiles or tiles_for(GATED, n), gated=True)
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, splits: int, n: int, tiles: GemmTiles,
            gated: bool) -> None:  # fmt: skip
    x = x.contiguous()
    rows, k = x.shape
    k_per_split = k // splits
    block_m = max(16, triton.next_power_of_2(rows))
    weight_kn = weight.t()
    x_desc = TensorDescriptor.from_tensor(x, [block_m, tiles.block_k])
    w_desc = TensorDescriptor.from_tensor(weight_kn, [tiles.block_k, tiles.block_n])
    launch = pdl_launch(x.device, _decode_gemm_kernel)
    _decode_gemm_kernel[(n // tiles.block_n, splits)](
        x_desc, w_desc, out, rows, n, k_per_split, n if gated else 0,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, STAGES=tiles.stages, GATED=gated,
        USE_PDL=bool(launch), num_warps=tiles.warps, **launch,
    )  # fmt: skip
