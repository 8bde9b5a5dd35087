"""FP8 projections at decode sizes (2-32 rows) as weight-only float16 products: srt's path for them (#26).

The kernel is `decode_gemm_fp8_variants.py`'s "swap_fp16": out^T = w @ x^T, each e4m3 weight tile widened to float16
(one cvt per two weights) as wgmma's register operand, x^T read from shared memory, float32 sums. Against the W8A8
kernel it replaces (x quantized to e4m3 per row and K-step in the kernel): the weights' bytes are the same, and
the products are exact, where W8A8's activation quantization put 2.4-3.4% of relative error on each projection
(docs/benchmarks.md, stop 48). x saturates at float16's largest value (`triton_support.as_dot_operand`): exact for
bf16 magnitudes 2^-17..65504, which normed activations stay well inside.

Tiles and K-chunks (`fp16_plan`): 64 weight rows a program (wgmma's M), K-steps of 256 columns where they divide the
chunk and the scale blocks, else 128, else 64, and the fewest K-chunks whose programs fill a wave of the H100's SMs.
On the H100 sweep of 2026-11-26 (bench/tune/tune_decode_gemm_fp8.py, tune-decode-gemm-fp8-h100.json) this rule
picks each E4B, 26B-A4B and 31B projection's fastest swapped tiles or tiles within a few percent of them, which ran
2-8% faster than each shape's fastest W8A8 tiles at 32 rows. The gated GEMM (gate_up, gelu in the epilogue) sums
its K-chunks in the kernel, as the W8A8 one; the others return float32 partials for the norm kernels.
In the model (H100, FP8 weights + FP8 KV, 512-token context, against W8A8; docs/benchmarks.md, stop 50): E4B batch
32 4.47 -> 4.16 ms a step, batch 2 3.50 -> 3.39; 26B-A4B batch 32 11.40 -> 11.33, batch 2 4.08 -> 3.96.
"""

from __future__ import annotations

import functools

import torch

from srt.kernels.decode_gemm import GemmTiles
from srt.kernels.decode_gemm_fp8 import chained_fp8_possible
from srt.kernels.decode_gemm_fp8_variants import decode_gelu_mlp_fp8_variant, decode_linear_fp8_variant

VARIANT = "swap_fp16"
# widest K-steps first; 3-6 stages keep ~96 KB of x and weight tiles in flight at 32 rows
TILES = (GemmTiles(64, 256, 3, 4), GemmTiles(64, 128, 4, 4), GemmTiles(64, 64, 6, 4))
WAVE_PROGRAMS = 128  # about one per SM of an H100 (132)
MAX_CHUNKS = 16


@functools.cache  # asked twice a projection (applies, then the launch) on every eager decode-sized step
def fp16_plan(n: int, k: int, block_k: int) -> tuple[GemmTiles, int] | None:
    """(tiles, K-chunks) for an [n, k] FP8 weight (each half for a gated one) with `block_k` columns per scale: the
    fewest chunks whose programs fill a wave (WAVE_PROGRAMS), each in the widest K-steps that divide it and the
    scale blocks; where none fill a wave, the most chunks that fit; None where no tiles fit."""
    if n % TILES[0].block_n:
        return None
    plan = None
    for chunks in range(1, MAX_CHUNKS + 1):
        if k % chunks:
            continue
        fitting = [t for t in TILES if (k // chunks) % t.block_k == 0 and block_k % t.block_k == 0]
        if not fitting:
            continue
        plan = (fitting[0], chunks)
        if n // fitting[0].block_n * chunks >= WAVE_PROGRAMS:
            return plan
    return plan


def decode_fp16_applies(x: torch.Tensor, weight: torch.Tensor, block_k: int, gated: bool = False) -> bool:
    """Whether `decode_linear_fp16` (or, `gated`, `decode_gelu_mlp_fp16`) runs x @ w^T for an Fp8Linear's [N, K]
    weight: `chained_fp8_possible` (Hopper, <= 32 rows of bf16 or fp16) and a plan that fits."""
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return chained_fp8_possible(x, weight) and fp16_plan(n, x.shape[1], block_k) is not None


def decode_linear_fp16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """x @ (weight * scale)^T: [rows, N] in x's dtype for one K-chunk, else [chunks, rows, N] float32 partial sums
    (the norm kernels sum them in chunk order)."""
    tiles, chunks = fp16_plan(weight.shape[0], x.shape[1], block_k)
    return decode_linear_fp8_variant(x, weight, scale, block_k, VARIANT, chunks, tiles)


def decode_gelu_mlp_fp16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """gelu_tanh(x @ gate^T) * (x @ up^T) [rows, I] in x's dtype for a stacked gate/up FP8 weight [2I, K]."""
    tiles, chunks = fp16_plan(weight.shape[0] // 2, x.shape[1], block_k)
    return decode_gelu_mlp_fp8_variant(x, weight, scale, block_k, VARIANT, tiles, chunks)
