"""FP8 projections of one row (batch-1 decode) on the CUDA cores, weight-only (#26).

At these sizes a projection is a stream of weight bytes, and the tensor-core kernels (`decode_gemm_fp8.py`,
`decode_gemm_fp8_variants.py`) pad the rows to the MMA's 16 or 64 and either convert every weight e4m3 -> bf16
in the conversion units (16 results per clock per SM on sm90) or quantize x and scale every K-step's product:
on an H100 they ran E4B's projections at ~1.5x their bytes' floor (`docs/benchmarks.md`). Here each program
loads [BLOCK_N, BLOCK_K] weight bytes with plain vector loads, turns them into float32 through float16 (Triton's
cast: one cvt.rn.f16x2.e4m3x2 per two weights, exact) and multiplies them by x in float32 FMAs, keeping one
product per loaded value in registers and summing along K once, at the end. Triton's software pipeline keeps
STAGES - 1 K-steps of weights in flight per program (the sweep: 1.3x faster than loading the next step by hand).
The tiles depend on the weight's shape (`gemv_tiles`).

srt runs it for one row (`FASTER_THAN_W8A8_ROWS`); the kernel takes up to 4 (at 2 and 4 the W8A8 kernel was as fast
or faster). Per-channel scales only (`--quantization fp8`, FP8-dynamic checkpoints); 128 x 128 block scales keep
the W8A8 kernel. Outputs as `decode_gemm_fp8.py`: `decode_linear_gemv` gives the product in x's dtype (splits == 1) or
[splits, rows, N] float32 partial sums over K-chunks for the norm kernels; `decode_gelu_mlp_gemv` gives
gelu_tanh(gate) * up of the stacked gate/up weight, each program taking a gate block and the matching up block.
Weight-only numerics: exact products, float32 sums, one rounding to x's dtype. Chained (PDL), graph-safe.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from srt import envs
from srt.kernels.decode_gemm import ENABLED, GATED
from srt.kernels.gelu_mul import gelu_tanh_mul_rounded
from srt.kernels.triton_support import (
    jit,
    kernel_runs_on,
    l2_prefetch_bytes,
    pdl_launch,
    pdl_start,
    prefetch_l2,
    round_to,
    tl,
    triton,
)

MAX_ROWS = 4
SRT_TAKES_IT = ENABLED and envs.SRT_FP8_GEMV.enabled()  # SRT_TRITON_GEMM=0 or SRT_FP8_GEMV=0: never (A/B)


class GemvTiles(NamedTuple):
    block_n: int  # output columns (weight rows) of a program; for GATED, of each half
    block_k: int  # weight bytes of a row per K-step
    warps: int = 4
    stages: int = 6  # the depth of Triton's software pipeline over K-steps


@jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, rows, n, k, k_per_split, up_offset, up_bytes,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """out[split, :, N-block] = x[:, K-chunk] @ (w * scale)[N-block, K-chunk]^T, w [N, K] e4m3 bytes row-major,
    scale [N] float32; GATED: gelu(x @ gate^T) * (x @ up^T) with the up rows at up_offset (up_bytes = up_offset *
    k), rounded as torch. PREFETCH: the bytes of each of its weight rows a program prefetches into L2 before its
    wait."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * k_per_split
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, ROWS)
    w_ptrs = w_ptr + offs_n[None, :, None].to(tl.int64) * k + (k_start + offs_k)[None, None, :]  # [1, N, K]
    x_ptrs = x_ptr + offs_r[:, None, None] * k + (k_start + offs_k)[None, None, :]  # [ROWS, 1, K]
    x_mask = offs_r[:, None, None] < rows
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    row_starts = w_ptr + offs_n.to(tl.int64) * k + k_start  # constant weights: prefetched before the wait
    prefetch_l2(row_starts, PREFETCH)
    if GATED:
        prefetch_l2(row_starts + up_bytes, PREFETCH)
    pdl_start(USE_PDL)  # x comes from the kernel ahead
    # Triton's software pipeline keeps STAGES - 1 K-steps of weights in flight (through shared memory)
    for step in tl.range(0, k_per_split, BLOCK_K, num_stages=STAGES):
        x = tl.load(x_ptrs + step, mask=x_mask, other=0.0).to(tl.float32)
        acc += tl.load(w_ptrs + step).to(tl.float8e4nv, bitcast=True).to(tl.float32) * x
        if GATED:
            acc_up += tl.load(w_ptrs + up_bytes + step).to(tl.float8e4nv, bitcast=True).to(tl.float32) * x
    out_dtype = out_ptr.dtype.element_ty
    result = tl.sum(acc, axis=2) * tl.load(scale_ptr + offs_n)[None, :]
    if GATED:  # the GEMM's two rounded outputs, then gelu_tanh_mul's rounding
        up = tl.sum(acc_up, axis=2) * tl.load(scale_ptr + up_offset + offs_n)[None, :]
        result = gelu_tanh_mul_rounded(round_to(result, out_dtype), round_to(up, out_dtype), out_dtype)
    out = out_ptr + (tl.program_id(1) * rows + offs_r)[:, None] * n + offs_n[None, :]
    tl.store(out, result.to(out_dtype), mask=(offs_r < rows)[:, None])


# H100 sweeps of 2026-11-27 (bench/tune/tune_decode_gemv_fp8.py, tune-decode-gemv-fp8-h100.json and, with the
# cvt, tune-decode-gemv-fp8-weights-h100.json): Triton's pipeline 4-8 deep beat the hand prefetch everywhere; 4
# warps beat 8; 8-column programs for N up to NARROW_N (E4B's o, down, q of KV-shared layers, sliding qkv), 16 above
# (31B: 8 columns made its step 12.55 -> 12.99 ms); the MLP's gate_up 8 x 512 where K allows (E4B 23.1 -> 20.6 us)
TILES = GemvTiles(16, 256, 4, 6)
NARROW_TILES = GemvTiles(8, 256, 4, 4)
NARROW_N = 3072
GATED_TILES = GemvTiles(16, 256, 4, 6)
WIDE_K_GATED_TILES = GemvTiles(8, 512, 4, 8)
# srt takes this kernel over the W8A8 one up to this many rows: at 1 row a decode step's projections took 1.81 vs
# 2.10 ms (E4B) and 10.95 vs 12.32 (31B); at 2 rows E4B's were no faster (2.10 vs 2.10), at 4 slower (2.89 vs 2.10)
FASTER_THAN_W8A8_ROWS = 1
# K-chunks: where one chunk has up to FEW_PROGRAMS programs, as many chunks as keep N x chunks within FEW_COLUMNS
# (16-column tiles: 320-336 programs fast, 640-672 slow; 8-column ones: 512-640 fast, 768 slow; E4B's o 3.94 -> 3.69
# us in 2 chunks), else chunks of at most MAX_STEPS K-steps (31B qkv: 39.2 us in 21 steps, 35.0 in 3 chunks of 7)
FEW_PROGRAMS = 400
FEW_COLUMNS = 5120
MAX_STEPS = 8
# ... except behind a kernel that holds every SM to its end (the MLP's down, K >= 2N, behind the gate_up GEMV): its
# chained programs take the slots of the first programs to finish and pile onto a few SMs unless there are enough
# to fill them all. E4B at batch 1 (H100, 2026-11-27): down in 2 chunks (320 programs) 21 us a layer in the model
# against 11.7 alone, a decode step 3.43 ms; 4 chunks 3.17, 8 (1280 programs) 3.12, 10 3.14.
FILLING_PROGRAMS = 1024


@functools.cache  # asked at every FP8 projection's call
def gemv_tiles(n: int, k: int, gated: bool) -> GemvTiles:
    """srt's tiles for an [n, k] weight (for GATED, n is each half's rows)."""
    if gated:
        return WIDE_K_GATED_TILES if k % WIDE_K_GATED_TILES.block_k == 0 else GATED_TILES
    return NARROW_TILES if n <= NARROW_N else TILES


@functools.cache  # asked at every FP8 projection's call
def gemv_splits(n: int, k: int) -> int:
    """srt's K-chunks for an [n, k] weight's partial sums (`FEW_PROGRAMS`, `FEW_COLUMNS`, `MAX_STEPS`,
    `FILLING_PROGRAMS`); 1 where BLOCK_K does not divide k (`gemv_fits` then refuses the shape)."""
    tiles = gemv_tiles(n, k, gated=False)
    steps, programs = k // tiles.block_k, n // tiles.block_n
    if steps == 0 or k % tiles.block_k:
        return 1
    divisors = [s for s in range(1, steps + 1) if steps % s == 0]
    if k >= 2 * n:  # the MLP's down (E4B and 31B: K = 4N; 2N where tensor parallelism halves K)
        return next((s for s in divisors if programs * s >= FILLING_PROGRAMS), steps)
    if programs > FEW_PROGRAMS:
        return next(s for s in divisors if steps // s <= MAX_STEPS)
    return max(s for s in divisors if n * s <= FEW_COLUMNS or s == 1)


def decode_gemv_applies(x: torch.Tensor, weight: torch.Tensor, block_k: int, splits: int | str) -> bool:
    """Whether srt runs x @ w^T for an Fp8Linear's [N, K] weight with `block_k` columns per scale in this kernel
    (`decode_linear_gemv` over `splits` K-chunks, or `decode_gelu_mlp_gemv` for GATED): CUDA, a 16-bit x of up to
    FASTER_THAN_W8A8_ROWS rows, a contiguous weight, and `gemv_fits`."""
    if not (SRT_TAKES_IT and x.is_cuda and kernel_runs_on(x.device, _fp8_gemv_kernel)):
        return False
    rows, k = x.shape
    fits = rows <= FASTER_THAN_W8A8_ROWS and gemv_fits(rows, weight.shape[0], k, block_k, splits)
    return fits and x.dtype in (torch.bfloat16, torch.float16) and weight.is_contiguous()


def gemv_fits(rows: int, n: int, k: int, block_k: int, splits: int | str, tiles: GemvTiles | None = None) -> bool:
    """What the kernel takes: 1-4 rows, per-channel scales (block_k >= k), and `tiles` (default: srt's,
    `gemv_tiles`) dividing N (each half of it for GATED) and the K-chunks."""
    n = n // 2 if splits == GATED else n
    chunks = 1 if splits == GATED else splits
    tiles = tiles or gemv_tiles(n, k, splits == GATED)
    return 0 < rows <= MAX_ROWS and block_k >= k and n % tiles.block_n == 0 and k % (chunks * tiles.block_k) == 0


def decode_linear_gemv(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, splits: int = 1, tiles: GemvTiles | None = None
) -> torch.Tensor:
    """x @ (weight * scale)^T for x [rows, K], an Fp8Linear's weight [N, K] and per-channel scale [N, 1]:
    [rows, N] in x's dtype (splits == 1) or [splits, rows, N] float32 partial sums. Call where
    `decode_gemv_applies`; `tiles` overrides srt's (the sweep)."""
    rows, n = x.shape[0], weight.shape[0]
    shape = (rows, n) if splits == 1 else (splits, rows, n)
    out = torch.empty(shape, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    _launch(x, weight, scale, out, splits, n, tiles or gemv_tiles(n, x.shape[1], False), gated=False)
    return out


def decode_gelu_mlp_gemv(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, tiles: GemvTiles | None = None
) -> torch.Tensor:
    """gelu_tanh(x @ gate^T) * (x @ up^T) [rows, I] in x's dtype for a stacked gate/up Fp8Linear's weight [2I, K]
    and per-channel scale; call where `decode_gemv_applies(x, weight, block_k, GATED)`."""
    rows, n = x.shape[0], weight.shape[0] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _launch(x, weight, scale, out, 1, n, tiles or gemv_tiles(n, x.shape[1], True), gated=True)
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, splits: int, n: int,
            tiles: GemvTiles, gated: bool) -> None:  # fmt: skip
    x = x.contiguous()
    rows, k = x.shape
    launch = pdl_launch(x.device, _fp8_gemv_kernel)
    prefetch = l2_prefetch_bytes(x.device, _fp8_gemv_kernel, k // splits)
    _fp8_gemv_kernel[(n // tiles.block_n, splits)](
        x, weight.view(torch.uint8), scale, out, rows, n, k, k // splits, n if gated else 0, n * k if gated else 0,
        ROWS=triton.next_power_of_2(rows), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, STAGES=tiles.stages,
        GATED=gated, USE_PDL=bool(launch), PREFETCH=prefetch, num_warps=tiles.warps, **launch,
    )  # fmt: skip
