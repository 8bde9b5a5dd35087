"""Decode-sized projections whose output goes straight into a residual add + norm, as K-split partial sums.

cuBLAS runs E4B's down projection (K = 10240) at decode sizes as a split-K GEMM followed by a reduction
kernel. Here the GEMM writes float32 partial sums over K-chunks, [splits, T, N]: the chained Triton GEMM's
TRITON_SPLITS where it applies (`decode_gemm.py`, Hopper), else cuBLAS's batched GEMM over SPLITS; and
the add + norm kernel that reads the output (`fused_kernels.add_rms_norm`) sums them, in split order, and
rounds the sum to the activation dtype as the GEMM would have: the same values up to float32 summation
order, one launch less. On an H100 (bench/bench_gemm_layouts.py, E4B) cuBLAS's batched GEMM alone takes 21.3 us where
cuBLAS's GEMM + reduction take 24.0 at 32 rows (down), 10.7 vs 12.7 (o of full layers), 6.9 vs 6.9 (o of
sliding layers); at 1 row 20.9 vs 22.1, 10.1 vs 12.2, 6.5 vs 6.6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.layers.decode_gemm import decode_gemm_applies, decode_linear

SPLITS = 2
TRITON_SPLITS = 4  # the chained Triton GEMM's K-chunks (decode_gemm.py; H100: 4 beat 2 and 8 for o and down)
MAX_ROWS = 32  # decode batch sizes (measured at 1 and 32 rows); prefill runs the plain GEMM


def linear_partials(x: torch.Tensor, weight: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """x @ weight^T for x [T, K] and an nn.Linear weight [N, K] stored transposed (a view of a contiguous
    [K, N]): [splits, T, N] float32 partial sums over K-chunks on CUDA for T <= MAX_ROWS rows, else the plain
    [T, N] product. Only for outputs that `add_rms_norm` (or `add_rms_norm_then_norm`) reads next. Graph safe.
    `splits`: None takes the chained Triton GEMM's TRITON_SPLITS where it applies (`decode_gemm`), else cuBLAS's
    batched GEMM over SPLITS chunks; a number always takes cuBLAS with that many (bench comparisons)."""
    if splits is None:
        if decode_gemm_applies(x, weight, TRITON_SPLITS):  # chained, where cuBLAS's kernels are not
            return decode_linear(x, weight, TRITON_SPLITS)
        splits = SPLITS
    rows, k = x.shape
    weight_t = weight.t()
    if not (x.is_cuda and 0 < rows <= MAX_ROWS and k % splits == 0 and weight_t.is_contiguous()):
        return F.linear(x, weight)
    chunks = x.contiguous().view(rows, splits, k // splits).transpose(0, 1)
    weight_chunks = weight_t.view(splits, k // splits, weight_t.shape[1])
    if x.dtype == torch.float32:
        return torch.bmm(chunks, weight_chunks)
    return torch.bmm(chunks, weight_chunks, out_dtype=torch.float32)
