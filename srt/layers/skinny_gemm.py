"""The MLP's gate_up projection at decode sizes (1..32 rows) with gelu_tanh(gate) * up folded in, in Triton.

cuBLAS then `gelu_tanh_mul_packed` is two kernels and an [M, 2I] round trip; here one kernel reads the
stacked [2I, K] gate_up weight once and writes the [M, I] product:

    grid (cdiv(I, BLOCK_N),): CTA n multiplies x by W rows n (gate) and I + n (up) over all of K, then
    rounds where `gelu_tanh_mul_packed` rounds (the GEMM outputs, gelu, the product) and stores out[:, n]

One row is a multiply-and-sum GEMV; more rows go through tl.dot with the rows padded to 16 (compute is free
here, memory is not). The kernel is chained (programmatic dependent launch, `triton_support.pdl_start`).

bench/bench_skinny_gemm.py compares it with cuBLAS at every projection shape, with a tile sweep. On an H100
(E4B, weights from HBM) it beats cuBLAS + gelu only for gate_up: 1.11x at 8 rows, 1.01-1.02x at 1 and 32;
in the whole E4B decode step it gained at 1 row and lost 1% at 32, so `skinny_linear` runs it for gate_up
up to 16 rows where the MLP is wide enough for MIN_CTAS column blocks, and cuBLAS everywhere else.
q/o/qkv/down were no faster (0.9-1.03x: cuBLAS already streams them at 1.4-2.5 TB/s). `SRT_SKINNY_GEMM=0`
turns it off for A/B runs.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from srt.layers.fused_kernels import gelu_tanh_mul_packed, gelu_tanh_mul_rounded
from srt.layers.triton_support import (
    dot_options,
    jit,
    last_dim_contiguous,
    pdl_launch,
    pdl_start,
    round_to,
    runs_triton,
    tl,
    triton,
)

MAX_ROWS = 32  # decode batch sizes; prefill runs cuBLAS
MIN_CTAS = 128  # E4B's gate_up (I = 10240) runs 160 or 320 CTAs
ENABLED = os.environ.get("SRT_SKINNY_GEMM", "1") != "0"  # kill switch for A/B runs: 0 runs cuBLAS + gelu


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@jit
def _skinny_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
    VECTOR: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (cols + N).to(tl.int64)[:, None] * stride_wn  # GATED: the up half of gate_up
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    if VECTOR:  # one row: elementwise products, summed once at the end
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        up2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + ks).to(tl.float32)[None, :]
            acc2 += tl.load(w_rows + ks[None, :], mask=col_ok[:, None], other=0.0).to(tl.float32) * x
            if GATED:
                up2 += tl.load(up_rows + ks[None, :], mask=col_ok[:, None], other=0.0).to(tl.float32) * x
        acc = tl.sum(acc2, axis=1)[None, :]
        up = tl.sum(up2, axis=1)[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + ks[None, :], mask=(rows < M)[:, None], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None], other=0.0)
            if UPCAST:  # the interpreter multiplies 16-bit floats in tl.dot as integers
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if GATED:
                u = tl.load(up_rows + ks[None, :], mask=col_ok[:, None], other=0.0)
                if UPCAST:
                    u = u.to(tl.float32)
                up = tl.dot(x, tl.trans(u), up, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        out = gelu_tanh_mul_rounded(round_to(acc, dtype), round_to(up, dtype), dtype)
    else:
        out = round_to(acc, dtype)
    mask = (rows < M)[:, None] & col_ok[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], out.to(dtype), mask=mask)


def tuned_config(rows: int, n: int, k: int, gated: bool) -> SkinnyConfig | None:
    """The kernel's tiles where it beats cuBLAS (the H100 sweep of bench/bench_skinny_gemm.py), else None."""
    if not gated or rows > 16:  # 32 rows: 1.02x alone, yet the E4B decode step was 1% slower with it
        return None
    if rows == 1:
        config = SkinnyConfig(block_n=64, block_k=128, num_warps=4, num_stages=5)
    else:
        config = SkinnyConfig(block_n=32, block_k=128, num_warps=4, num_stages=3)
    # one CTA per column block: narrow MLPs (26B-A4B's 2112) would leave most SMs idle (its decode step was
    # 6% slower with them)
    return config if -(-n // config.block_n) >= MIN_CTAS else None  # (no triton.cdiv: CPU-only installs)


def supports(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig) -> bool:
    """Whether the kernel can run these operands with `config` (whole BLOCK_K steps over K)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype == weight.dtype
        and weight.stride(-1) == 1
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % config.block_k == 0
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    gated: bool = False,
    config: SkinnyConfig | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """x @ weight^T for x [M, K], weight [N, K] (an nn.Linear's); `gated`: gelu_tanh(gate) * up of the stacked
    gate_up weight [2I, K], an [M, I] output. `use_triton`: None runs the kernel on CUDA where `tuned_config`
    has tiles for the shape and cuBLAS (+ `gelu_tanh_mul_packed`) otherwise; True forces the kernel with
    `config` or default tiles (on the CPU only under TRITON_INTERPRET=1). Graph safe."""
    if gated and weight.shape[0] % 2:
        raise ValueError(f"skinny_linear: a gated weight stacks gate and up, got {weight.shape[0]} rows")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if use_triton is None:
        config = config or (tuned_config(x.shape[0], n, x.shape[-1], gated) if ENABLED else None)
        use_triton = None if config is not None and supports(x, weight, config) else False
    if not runs_triton(x.device, use_triton, _skinny_kernel):
        out = F.linear(x, weight)
        return gelu_tanh_mul_packed(out) if gated else out
    config = config or SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)
    if not supports(x, weight, config):
        raise ValueError(
            f"skinny_linear: x {list(x.shape)} {x.dtype}, weight {list(weight.shape)} unsupported by {config}"
        )
    rows, k = x.shape
    x = last_dim_contiguous(x)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    precision, upcast = dot_options(_skinny_kernel, x.dtype)
    launch = pdl_launch(x.device, _skinny_kernel)
    _skinny_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=1 if rows == 1 else max(16, triton.next_power_of_2(rows)), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GATED=gated, VECTOR=rows == 1,
        PRECISION=precision, UPCAST=upcast,
        USE_PDL=bool(launch), num_warps=config.num_warps, num_stages=config.num_stages, **launch,
    )  # fmt: skip
    return out
