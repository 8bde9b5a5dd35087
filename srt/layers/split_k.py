"""Decode-sized projections as K-split partial sums: float32 [splits, T, N] that the next kernel sums.

A projection at decode sizes (1..32 rows) reads megabytes of weight for a few rows of activations: it is bound
by how fast, and how early, its weight streams from HBM. Its output here is left as float32 partial sums over
K-chunks, [splits, T, N], and the kernel that reads it next sums them in split order and rounds the sum to the
activation dtype as a GEMM rounds its output (`fused_kernels.add_rms_norm` after o and down;
`qkv_norm_rope_store` and `rms_norm_rope` after qkv and q): the same values up to float32 summation order.

Two ways to compute the partials:

- `_split_k_kernel` (Triton, CUDA): grid (N / BLOCK_N, splits); a CTA owns a [K-chunk, BLOCK_N] tile of the
  transposed weight (W^T, [K, N] row-major: `gemma4_layers.store_transposed`). It is chained (programmatic
  dependent launch): its CTAs start while the kernel ahead runs, load their first weight block, and only then
  wait (`pdl_start`) for the activations. The weight is constant, so reading it early is safe, and the
  stream of the GEMM's bytes overlaps the latency-bound kernel ahead (a norm, the attention's combine)
  instead of starting after it; the kernel after it starts early in turn.
- a batched cuBLAS GEMM over the K-chunks (`torch.bmm` with float32 output): the path before the Triton kernel,
  kept for A/B runs (`SRT_SPLIT_K=bmm`) and where the kernel has no tiles for a shape.

bench/bench_split_k.py times both in a chain of norm -> projection -> add + norm over distinct layers'
weights, as a decode step runs them.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from srt.layers.triton_support import dot_options, jit, pdl_launch, pdl_start, runs_triton, tl

MAX_ROWS = 32  # decode batch sizes; prefill runs the plain GEMM
BMM_SPLITS = 2
MAX_SPLITS = 16  # the kernel after the projection reads every split's partials
BACKEND = os.environ.get("SRT_SPLIT_K", "triton")  # "bmm": cuBLAS batched GEMM partials, for A/B runs


class SplitKTiles(NamedTuple):
    """A CTA's tile: BLOCK_N output columns over STEPS * BLOCK_K of K (so splits = K / (STEPS * BLOCK_K))."""

    block_n: int
    block_k: int
    steps: int
    num_warps: int

    def splits(self, k: int) -> int:
        return k // (self.block_k * self.steps)


@jit
def _split_k_kernel(
    x_ptr, wt_ptr, out_ptr, rows, stride_x, stride_wt, stride_split, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * (STEPS * BLOCK_K) + tl.arange(0, BLOCK_K)
    w_block = wt_ptr + offs_k.to(tl.int64)[:, None] * stride_wt + cols[None, :]
    w = tl.load(w_block)  # the weight is constant: its first block streams while the kernel ahead runs
    pdl_start(USE_PDL)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = (offs_m < rows)[:, None]
    x_block = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in tl.static_range(STEPS):
        x = tl.load(x_block + step * BLOCK_K, mask=row_ok, other=0.0)
        if step + 1 < STEPS:  # the next block in flight while this one multiplies
            w_next = tl.load(w_block + (step + 1) * BLOCK_K * stride_wt)
        if UPCAST:  # the interpreter multiplies 16-bit floats in tl.dot as integers
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if step + 1 < STEPS:
            w = w_next
    out = out_ptr + split * stride_split + offs_m.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, acc, mask=row_ok)


def tuned_tiles(n: int, k: int) -> SplitKTiles | None:
    """The kernel's tiles for an [N, K] projection (H100 sweep of bench/bench_split_k.py), None for cuBLAS."""
    for tiles in (SplitKTiles(64, 256, 1, 4), SplitKTiles(64, 256, 2, 4), SplitKTiles(64, 256, 4, 4)):
        if n % tiles.block_n == 0 and k % (tiles.block_k * tiles.steps) == 0 and tiles.splits(k) <= MAX_SPLITS:
            return tiles
    return None


def linear_partials(
    x: torch.Tensor,
    weight: torch.Tensor,
    tiles: SplitKTiles | None = None,
    use_triton: bool | None = None,
    bmm_splits: int = BMM_SPLITS,
) -> torch.Tensor:
    """x @ weight^T for x [T, K] and an nn.Linear weight [N, K] stored transposed (a view of a contiguous
    [K, N]): [splits, T, N] float32 partial sums over K-chunks for T <= MAX_ROWS rows on CUDA (the Triton
    kernel with `tiles`, default `tuned_tiles`; else a batched cuBLAS GEMM over `bmm_splits` chunks), the plain
    [T, N] product otherwise. Only for outputs that a kernel summing partials reads next. Graph safe.

    `use_triton=True` forces the kernel (on the CPU only under TRITON_INTERPRET=1), with `tiles` or default
    tiles; False forces the cuBLAS paths."""
    rows, k = x.shape
    weight_t = weight.t()
    decode_sized = 0 < rows <= MAX_ROWS and weight_t.is_contiguous() and x.dtype == weight.dtype
    if use_triton is None:
        tiles = tiles or (tuned_tiles(weight.shape[0], k) if BACKEND == "triton" else None)
        use_triton = None if tiles is not None and decode_sized and x.is_cuda else False
    if runs_triton(x.device, use_triton, _split_k_kernel):
        return _triton_partials(x, weight_t, tiles or SplitKTiles(16, 16, 2, 4))
    if not (x.is_cuda and decode_sized and k % bmm_splits == 0):
        return F.linear(x, weight)
    chunks = x.contiguous().view(rows, bmm_splits, k // bmm_splits).transpose(0, 1)
    weight_chunks = weight_t.view(bmm_splits, k // bmm_splits, weight_t.shape[1])
    if x.dtype == torch.float32:
        return torch.bmm(chunks, weight_chunks)
    return torch.bmm(chunks, weight_chunks, out_dtype=torch.float32)


def _triton_partials(x: torch.Tensor, weight_t: torch.Tensor, tiles: SplitKTiles) -> torch.Tensor:
    rows, k = x.shape
    n = weight_t.shape[1]
    splits = tiles.splits(k)
    if not (0 < rows <= MAX_ROWS and n % tiles.block_n == 0 and splits * tiles.block_k * tiles.steps == k):
        raise ValueError(f"linear_partials: x {list(x.shape)}, weight^T {list(weight_t.shape)} do not fit {tiles}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((splits, rows, n), dtype=torch.float32, device=x.device)
    precision, upcast = dot_options(_split_k_kernel, x.dtype)
    launch = pdl_launch(x.device, _split_k_kernel)
    _split_k_kernel[(n // tiles.block_n, splits)](
        x, weight_t, out, rows, x.stride(0), weight_t.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=max(16, 1 << (rows - 1).bit_length()), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        STEPS=tiles.steps, PRECISION=precision, UPCAST=upcast, USE_PDL=bool(launch),
        num_warps=tiles.num_warps, **launch,
    )  # fmt: skip
    return out
