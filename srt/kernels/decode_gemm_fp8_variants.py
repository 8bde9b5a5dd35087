"""Variants of the FP8 decode GEMM (`decode_gemm_fp8.py`): "swap_fp16" is srt's decode path for FP8 projections at
2-32 rows (called through `decode_gemm_fp16.py`); W8A8 (`decode_linear_w8a8`, `decode_gelu_mlp_w8a8`, where
`decode_w8a8_applies`) was that path before it and stays as the sweeps' baseline; the others are for the sweep
(bench/tune/tune_decode_gemm_fp8.py) to time against them (#26).

Why the default kernel streams FP8 weights no faster than bf16 ones on an H100 (sm90): with 1-32 rows,
x [16 or 32, K] @ w^T is too short for Hopper's wgmma (Triton needs the MMA's M to be a multiple of 64), so it
runs mma.sync with both operands in registers, and every weight value is converted e4m3 -> bf16 first. sm90
has no instruction for that: Triton emits cvt.rn.f16x2.e4m3x2 and then two cvt.bf16.f16, three conversions per
two values (its PTX: 64 and 128 of them per 64 x 128 tile), where the conversion units deliver 16 results per
clock per SM for most conversions (CUDA programming guide, cc 9.0). A 128 x 128 FP8 tile (16 KB, ~1,100 clocks
of an SM's share of 3.3 TB/s) costs ~24,600 conversions, ~1,500 clocks: the kernel is bound by conversions,
not bytes. Measured (H100, the sweep of 2026-11-26, E4B's projections summed over a decode step, batch 1 / 32):
srt's FP8 kernel 3.35 / 4.31 ms, its fastest tiles 2.68 / 3.22, "fp16" 1.92 / 2.35, "swap_fp16" 1.92 / 2.14,
"w8a8" 2.00 / 2.21; the bf16 GEMM 2.92 / 3.12; the FP8 weights' floor 1.29.

`VARIANTS` (name -> operands, swapped):

- "fp16": the same kernel with fp16 operands: e4m3 -> fp16 is one cvt per two values, a third of the
  conversions, and x goes bf16 -> fp16 (a [rows, BLOCK_K] tile per step, small next to the weight tile). Exact
  for |x| < 65504 and |x| >= 2^-17 (bf16's 8 bits fit fp16's there); larger activations saturate at 65504.
- "swap_fp16" / "swap_bf16": out^T = w @ x^T, so the weight tile is the MMA's long side (BLOCK_N a multiple of
  64) and Triton can issue wgmma, the upcast weights as its register operand and x^T read from shared memory;
  bf16 separates what the swap gains from what the cheaper conversion gains.
- "w8a8": out^T = w @ x_q^T on the FP8 tensor cores (wgmma e4m3): the weight tiles go from TMA to the tensor
  cores untouched, no instruction per weight value. x is quantized in the kernel per row and K-step: scale =
  absmax / 448, q = x * (448 / absmax) rounded to e4m3 (a multiply, not a division per value), and each step's
  product is scaled by it in float32 (which also bounds the FP8 MMA's reduced-precision accumulation to one
  K-step). W8A8 numerics, as the prefill GEMMs', not the weight-only ones of the default kernel.

Outputs, scales and chaining as `decode_linear_fp8` / `decode_gelu_mlp_fp8`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.kernels.decode_gemm import GATED, GemmTiles
from srt.kernels.decode_gemm_fp8 import chained_fp8_possible, decode_fp8_tiles, tma_operands
from srt.kernels.fp8_quant import FP8_MAX, MIN_ABSMAX, quantize_tile_rows
from srt.kernels.gelu_mul import gelu_tanh_mul_rounded
from srt.kernels.triton_support import (
    as_dot_operand,
    dot_options,
    jit,
    l2_prefetch_bytes,
    pdl_launch,
    pdl_start,
    prefetch_l2,
    round_to,
    ticket_counters,
    tl,
)


class Variant(NamedTuple):
    """How a variant multiplies: its operand dtype and orientation."""

    operands: torch.dtype  # the MMA's operand dtype: x's own (bf16), fp16, or float8_e4m3fn (x quantized)
    swap: bool  # out^T = w @ x^T: the weight tile is the MMA's M side (wgmma), BLOCK_N a multiple of 64


VARIANTS = {
    "fp16": Variant(torch.float16, False),
    "swap_fp16": Variant(torch.float16, True),
    "swap_bf16": Variant(torch.bfloat16, True),
    "w8a8": Variant(torch.float8_e4m3fn, True),
}


def decode_linear_fp8_variant(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_k: int,
    variant: str,
    splits: int = 1,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """`decode_linear_fp8` (same arguments and outputs) computed as `VARIANTS[variant]`; call where `tiles` (by
    default the weight-only kernel's) fit as `decode_fp8_applies` checks them (swapped variants: BLOCK_N a
    multiple of 64; W8A8: `decode_w8a8_applies`), or on CPU tensors under TRITON_INTERPRET=1."""
    rows, n = x.shape[0], weight.shape[0]
    shape = (rows, n) if splits == 1 else (splits, rows, n)
    out = torch.empty(shape, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    tiles = tiles or decode_fp8_tiles(splits, n, x.shape[1], block_k)
    _launch(x, weight, scale, block_k, out, splits, n, tiles, VARIANTS[variant], gated=False)
    return out


def decode_gelu_mlp_fp8_variant(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_k: int,
    variant: str,
    tiles: GemmTiles | None = None,
    splits: int = 1,
) -> torch.Tensor:
    """`decode_gelu_mlp_fp8` (same arguments and output) computed as `VARIANTS[variant]`. `splits` > 1: K-chunks
    whose float32 gate and up partials the last chunk of each column block sums (in chunk order) before the gelu."""
    rows, n = x.shape[0], weight.shape[0] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    tiles = tiles or decode_fp8_tiles(GATED, n, x.shape[1], block_k)
    _launch(x, weight, scale, block_k, out, splits, n, tiles, VARIANTS[variant], gated=True)
    return out


# srt's W8A8 tiles, from the H100 sweep of 2026-11-26 (tune-decode-gemm-fp8-h100.json; E4B and 31B projections at
# 1 and 32 rows): within 1.18x of each shape's fastest W8A8 tiles at 4 K-splits and 1.08x for gate_up; K-chunks
# that are no multiple of 128 (31B: 5376 / 4 = 1344) take 64-wide K-steps (31B qkv's fastest)
WIDE_TILES = GemmTiles(128, 128, 3, 8)
NARROW_K_TILES = GemmTiles(256, 64, 6, 4)
# K-chunks of a few 64-column steps, for K whose quarters hold no whole steps (26B-A4B's dense down, K 2112 = 33 x
# 64): bench/tune/tune_w8a8_chunks.py, H100, 32 rows, chained: 11 chunks 6.8 us, 3 chunks of 256 x 64 tiles 10.4
STEP_CHUNK_TILES = GemmTiles(128, 64, 4, 4)
W8A8_TILES = {
    8: (WIDE_TILES,),
    4: (WIDE_TILES, NARROW_K_TILES),
    2: (WIDE_TILES,),
    GATED: (GemmTiles(64, 128, 3, 4),),
}
# fewer programs than this at 4 K-splits leave the H100's 132 SMs short of a full wave: 8 splits then
FULL_WAVE_PROGRAMS = 96
MAX_STEP_CHUNKS, MAX_GATED_CHUNKS = 16, 8


def w8a8_splits(n: int, k: int, block_k: int) -> int:
    """The K-chunks of srt's W8A8 GEMM for an [n, k] weight (the same sweep): 4; 8 where 4 would run fewer than
    FULL_WAVE_PROGRAMS programs of the wide tiles (E4B down 16.5 -> 12.8 us, E4B and 26B-A4B o); 2 where the wide
    tiles' 128-column K-steps fit halves of K but not quarters (31B qkv 38.3 -> 36.7 us, 26B-A4B qkv 12.5 -> 11.8);
    where no tiles fit quarters, the fewest chunks of whole 64-column steps that fill a wave of STEP_CHUNK_TILES
    programs (26B-A4B's dense down, K 2112: 11 chunks of 3 steps)."""

    def wide_tiles_fit(splits: int) -> bool:
        return w8a8_tiles(splits, n, k, block_k) == WIDE_TILES

    if n // WIDE_TILES.block_n * 4 < FULL_WAVE_PROGRAMS and wide_tiles_fit(8):
        return 8
    if not wide_tiles_fit(4) and wide_tiles_fit(2):
        return 2
    if w8a8_tiles(4, n, k, block_k) is None:
        for chunks in range(3, MAX_STEP_CHUNKS + 1):
            programs = n // STEP_CHUNK_TILES.block_n * chunks
            if programs >= FULL_WAVE_PROGRAMS and w8a8_tiles(chunks, n, k, block_k) is not None:
                return chunks
    return 4


def w8a8_tiles(splits: int | str, n: int, k: int, block_k: int) -> GemmTiles | None:
    """srt's W8A8 tiles for `splits` (8, 4, 2, GATED, or other counts of 64-column-step chunks), width n (each half
    for GATED) and K; None where none fit (the K-chunks and the scale blocks must be multiples of BLOCK_K, n of
    BLOCK_N)."""
    if splits != GATED and k % splits:
        return None
    chunk = k if splits == GATED else k // splits
    for tiles in W8A8_TILES.get(splits, (STEP_CHUNK_TILES,)):
        if chunk % tiles.block_k == 0 and block_k % tiles.block_k == 0 and n % tiles.block_n == 0:
            return tiles
    return None


def decode_w8a8_applies(x: torch.Tensor, weight: torch.Tensor, block_k: int, splits: int | str) -> bool:
    """Whether `decode_linear_w8a8` (`w8a8_splits`) or `decode_gelu_mlp_w8a8` (GATED) runs x @ w^T for an Fp8Linear's
    [N, K] weight with `block_k` columns per scale: CUDA with TMA (Hopper), <= 32 rows of bf16 or fp16, and srt's
    W8A8 tiles fit."""
    n = weight.shape[0] // 2 if splits == GATED else weight.shape[0]
    return chained_fp8_possible(x, weight) and w8a8_tiles(splits, n, x.shape[1], block_k) is not None


def decode_linear_w8a8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int, splits: int
) -> torch.Tensor:
    """`decode_linear_fp8` with x quantized per row and K-step on the FP8 tensor cores (W8A8), srt's tiles."""
    tiles = w8a8_tiles(splits, weight.shape[0], x.shape[1], block_k)
    return decode_linear_fp8_variant(x, weight, scale, block_k, "w8a8", splits, tiles)


def decode_gelu_mlp_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """`decode_gelu_mlp_fp8` as W8A8 (`decode_linear_w8a8`), in `w8a8_gated_plan`'s tiles and K-chunks."""
    tiles, splits = w8a8_gated_plan(weight.shape[0] // 2, x.shape[1], block_k)
    return decode_gelu_mlp_fp8_variant(x, weight, scale, block_k, "w8a8", tiles, splits)


# narrower K-steps for gated GEMMs whose K has no 128-column chunks to spread over the SMs (26B-A4B's dense gate_up)
GATED_NARROW_K_TILES = GemmTiles(64, 64, 6, 4)


def w8a8_gated_plan(n: int, k: int, block_k: int) -> tuple[GemmTiles, int]:
    """Tiles and K-chunks of srt's gated W8A8 GEMM for halves of width n: one chunk where the column blocks fill a
    wave (FULL_WAVE_PROGRAMS), else the fewest chunks of whole K-steps (128 columns, else 64) that do (26B-A4B's
    dense MLP: 33 column blocks of 2112, K 2816 = 4 chunks of 11 64-column steps)."""
    whole = w8a8_tiles(GATED, n, k, block_k)
    if whole is None or n // whole.block_n >= FULL_WAVE_PROGRAMS:
        return whole, 1
    for tiles in (whole, GATED_NARROW_K_TILES):
        for chunks in range(2, MAX_GATED_CHUNKS + 1):
            if k % (chunks * tiles.block_k) or block_k % tiles.block_k:
                continue
            if n // tiles.block_n * chunks >= FULL_WAVE_PROGRAMS:
                return tiles, chunks
    return whole, 1


_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8e4nv"}


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int, out: torch.Tensor,
            splits: int, n: int, tiles: GemmTiles, variant: Variant, gated: bool) -> None:  # fmt: skip
    if variant.swap and tiles.block_n % 64:
        raise ValueError(f"a swapped variant needs BLOCK_N a multiple of 64 (wgmma's M), got {tiles.block_n}")
    x = x.contiguous()
    rows, k = x.shape
    block_m, x_desc, w_desc = tma_operands(x, weight, tiles)
    launch = pdl_launch(x.device, _decode_gemm_fp8_variant_kernel)
    precision, interpreted = dot_options(_decode_gemm_fp8_variant_kernel, x.dtype)
    gated_splits = splits if gated else 1
    partials, tickets = out, out  # placeholders unless a gated GEMM runs K-chunks
    if gated_splits > 1:
        partials = torch.empty((splits, 2, rows, n), dtype=torch.float32, device=x.device)
        tickets = ticket_counters("fp8_gated_gemm", x.device, n // tiles.block_n)
    prefetch = l2_prefetch_bytes(x.device, _decode_gemm_fp8_variant_kernel, k // splits)
    _decode_gemm_fp8_variant_kernel[(n // tiles.block_n, splits)](
        x_desc, w_desc, weight, scale, out, partials, tickets, rows, n, k, k // splits, n if gated else 0,
        scale.shape[1], PREFETCH=prefetch,
        # per-channel scales: SCALE_K unused, 1 rather than K so that one compiled kernel serves every K
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SCALE_K=block_k if block_k < k else 1,
        PER_CHANNEL=block_k >= k, STAGES=tiles.stages, GATED=gated, GATED_SPLITS=gated_splits, USE_PDL=bool(launch),
        OPERAND=getattr(tl, _TL_DTYPES[variant.operands]), SWAP=variant.swap, INTERPRETED=interpreted,
        PRECISION=precision, FP8_MAX=FP8_MAX, MIN_ABSMAX=MIN_ABSMAX, num_warps=tiles.warps, **launch,
    )  # fmt: skip


@jit
def _decode_gemm_fp8_variant_kernel(
    x_desc, w_desc, w_ptr, scale_ptr, out_ptr, partials_ptr, tickets_ptr, rows, n, k, k_per_split, up_offset,
    scale_cols, PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_K: tl.constexpr,
    PER_CHANNEL: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr, GATED_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
    OPERAND: tl.constexpr, SWAP: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_ABSMAX: tl.constexpr,
):  # fmt: skip
    """`_decode_gemm_fp8_kernel`'s product with OPERAND operands; with SWAP the accumulators are [BLOCK_N, BLOCK_M]
    (out^T). INTERPRETED: float32 operands (Triton's interpreter, `triton_support.dot_options`). GATED_SPLITS > 1:
    a gated GEMM over K-chunks; each chunk stores its float32 gate and up sums to partials [chunks, 2, rows, n],
    and the chunk that draws a column block's last ticket sums them in chunk order and applies the gelu.
    PREFETCH: the bytes of each of its weight rows (w_ptr [N, k]) a program prefetches into L2 before its wait."""
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    k_start = split * k_per_split
    offs_n = n0 + tl.arange(0, BLOCK_N)
    prefetch_l2(w_ptr + offs_n.to(tl.int64) * k + k_start, PREFETCH)
    if GATED:
        prefetch_l2(w_ptr + (up_offset + offs_n).to(tl.int64) * k + k_start, PREFETCH)
    pdl_start(USE_PDL)  # x comes from the kernel ahead
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    for k in tl.range(k_start, k_start + k_per_split, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([0, k])
        if OPERAND == tl.float8e4nv:
            x, x_scale = quantize_tile_rows(x, FP8_MAX, MIN_ABSMAX, INTERPRETED)
        else:  # float16 saturates at its largest value
            x, x_scale = as_dot_operand(x, OPERAND), 1.0
        w_scales = scale_ptr + offs_n * scale_cols + k // SCALE_K  # this K-step's block scales (not PER_CHANNEL)
        acc = _step(acc, x, x_scale, w_desc.load([n0, k]), w_scales, PER_CHANNEL, OPERAND, SWAP, INTERPRETED,
                    PRECISION)  # fmt: skip
        if GATED:
            w_up = w_desc.load([up_offset + n0, k])
            acc_up = _step(acc_up, x, x_scale, w_up, w_scales + up_offset * scale_cols, PER_CHANNEL, OPERAND, SWAP,
                           INTERPRETED, PRECISION)  # fmt: skip
    if PER_CHANNEL:
        acc = acc * _per_column(tl.load(scale_ptr + offs_n), SWAP)
        if GATED:
            acc_up = acc_up * _per_column(tl.load(scale_ptr + up_offset + offs_n), SWAP)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = _per_row(offs_m < rows, SWAP)
    out_dtype = out_ptr.dtype.element_ty
    if not GATED:
        out = out_ptr + _per_row((split * rows + offs_m) * n, SWAP) + _per_column(offs_n, SWAP)
        tl.store(out, acc.to(out_dtype), mask=row_ok)
    else:
        tile = _per_row(offs_m * n, SWAP) + _per_column(offs_n, SWAP)
        last = True
        if GATED_SPLITS > 1:
            tl.store(partials_ptr + split * 2 * rows * n + tile, acc, mask=row_ok)
            tl.store(partials_ptr + (split * 2 + 1) * rows * n + tile, acc_up, mask=row_ok)
            tl.debug_barrier()  # every thread's partials are stored before the ticket is taken (release, gpu scope)
            ticket = tickets_ptr + tl.program_id(0)
            last = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == GATED_SPLITS - 1
            if last:
                acc, acc_up = tl.zeros_like(acc), tl.zeros_like(acc_up)
                for chunk in tl.static_range(GATED_SPLITS):
                    gate_part = partials_ptr + chunk * 2 * rows * n + tile
                    acc += tl.load(gate_part, mask=row_ok, other=0.0, cache_modifier=".cg")
                    acc_up += tl.load(gate_part + rows * n, mask=row_ok, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(ticket, 0)  # ready for the next call (CUDA-graph replays reuse the tickets)
        if last:  # the GEMM's two rounded outputs, then gelu_tanh_mul's rounding
            acc = gelu_tanh_mul_rounded(round_to(acc, out_dtype), round_to(acc_up, out_dtype), out_dtype)
            tl.store(out_ptr + tile, acc.to(out_dtype), mask=row_ok)


@jit
def _step(acc, x, x_scale, w, w_scales, PER_CHANNEL: tl.constexpr, OPERAND: tl.constexpr, SWAP: tl.constexpr,
          INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """acc plus one K-step's x [BLOCK_M, BLOCK_K] (OPERAND values; FP8 ones times x_scale per row) times the FP8
    weight tile w [BLOCK_N, BLOCK_K] (times its block scales at w_scales unless PER_CHANNEL)."""
    if OPERAND != tl.float8e4nv:
        w = w.to(OPERAND)  # exact: e4m3 values are fp16 and bf16 values
    if INTERPRETED:  # the interpreter's tl.dot of 8- and 16-bit floats is wrong; float32 products are exact
        x, w = x.to(tl.float32), w.to(tl.float32)
    if OPERAND != tl.float8e4nv and PER_CHANNEL:  # no per-step scale: accumulate in the MMA
        if SWAP:
            return tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        else:
            return tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if SWAP:
        product = tl.dot(w, tl.trans(x), input_precision=PRECISION)
    else:
        product = tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if OPERAND == tl.float8e4nv:
        product = product * _per_row(x_scale, SWAP)
    if not PER_CHANNEL:
        product = product * _per_column(tl.load(w_scales), SWAP)
    return acc + product


@jit
def _per_column(values, SWAP: tl.constexpr):
    """A [BLOCK_N] vector over output columns, broadcast against the accumulator."""
    if SWAP:
        return values[:, None]
    else:
        return values[None, :]


@jit
def _per_row(values, SWAP: tl.constexpr):
    """A [BLOCK_M] vector over rows, broadcast against the accumulator."""
    if SWAP:
        return values[None, :]
    else:
        return values[:, None]
