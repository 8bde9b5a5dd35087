"""The chained decode GEMM (`decode_gemm.py`) over FP8 weights: weight-only FP8, the scales applied in the kernel.

The weight is an `Fp8Linear`'s (`layers/fp8_linear.py`): [N, K] float8_e4m3fn, row-major, with float32 scales
[N, K // block_k] (block_k = K: one scale per output column). Each CTA loads [BLOCK_N, BLOCK_K] FP8 tiles by TMA
(half the bytes of a bf16 tile), upcasts them to the activation dtype (exact: every e4m3 value is a bf16 and an
fp16 value) and multiplies x by them on the tensor cores in float32. Per-channel scales multiply the float32
product once, in the epilogue; block scales multiply each K-step's product inside the loop (a K-step never
straddles two blocks: BLOCK_K divides block_k and the K-chunks start at multiples of BLOCK_K).

Same outputs as `decode_gemm.py`: `decode_linear_fp8` gives the product in x's dtype (splits == 1) or
[splits, rows, N] float32 partial sums over K-chunks that the norm kernels sum; `decode_gelu_mlp_fp8` gives
gelu_tanh(gate) * up of the stacked gate/up weight with the same roundings. Chained (PDL) and graph-safe.
"""

from __future__ import annotations

import torch

from srt.kernels.decode_gemm import ENABLED, GATED, MAX_ROWS, GemmTiles, TensorDescriptor, tiles_for
from srt.kernels.gelu_mul import gelu_tanh_mul_rounded
from srt.kernels.triton_support import dot_options, has_pdl, jit, pdl_launch, pdl_start, round_to, tl, triton

SMEM_BUDGET = 4 * (MAX_ROWS * 64 * 2 + 2 * 128 * 64 * 2)  # bytes of the bf16 gate_up GEMM's 4 stages


@jit
def _decode_gemm_fp8_kernel(
    x_desc, w_desc, scale_ptr, out_ptr, rows, n, k_per_split, up_offset, scale_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr,
    PER_CHANNEL: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out[split, :, N-block] = x[:, K-chunk] @ (w * scale)[N-block, K-chunk]^T with w [N, K] FP8 row-major and
    scale [N, scale_cols] float32 (SCALE_K columns share one); GATED as in `_decode_gemm_kernel`, with the up
    rows at up_offset. UPCAST: float32 operands (Triton's interpreter, `triton_support.dot_options`)."""
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    k_start = split * k_per_split
    offs_n = n0 + tl.arange(0, BLOCK_N)
    pdl_start(USE_PDL)  # x comes from the kernel ahead
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_start, k_start + k_per_split, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([0, k])
        w = w_desc.load([n0, k]).to(x.dtype)  # exact: e4m3 values are bf16 and fp16 values
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if PER_CHANNEL:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        else:  # this K-step's block scales, one per output column
            scale = tl.load(scale_ptr + offs_n * scale_cols + k // SCALE_K)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION) * scale[None, :]
        if GATED:
            w_up = w_desc.load([up_offset + n0, k]).to(x.dtype)
            if PER_CHANNEL:
                acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PRECISION)
            else:
                scale_up = tl.load(scale_ptr + (up_offset + offs_n) * scale_cols + k // SCALE_K)
                acc_up += tl.dot(x, tl.trans(w_up), input_precision=PRECISION) * scale_up[None, :]
    if PER_CHANNEL:
        acc = acc * tl.load(scale_ptr + offs_n)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scale_ptr + up_offset + offs_n)[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    out = out_ptr + (split * rows + offs_m)[:, None] * n + offs_n[None, :]
    out_dtype = out_ptr.dtype.element_ty
    if GATED:  # the GEMM's two rounded outputs, then gelu_tanh_mul's rounding
        acc = gelu_tanh_mul_rounded(round_to(acc, out_dtype), round_to(acc_up, out_dtype), out_dtype)
    tl.store(out, acc.to(out_dtype), mask=(offs_m < rows)[:, None])


def decode_fp8_tiles(splits: int | str, n: int, k: int, block_k: int) -> GemmTiles | None:
    """The bf16 GEMM's tiles for `splits` and width n (`decode_gemm.tiles_for`) with BLOCK_K doubled where the
    K-chunks allow it, so that a pipeline stage holds as many weight bytes as the bf16 GEMM's (FP8 tiles are
    half as big; untuned otherwise); None where BLOCK_K does not divide the scale blocks' width."""
    tiles = tiles_for(splits, n)
    if tiles is None:
        return None
    chunk = k if splits == GATED else k // splits
    wide_k = 2 * tiles.block_k
    if chunk % wide_k == 0 and block_k % wide_k == 0:
        # shared memory: the stages' x and weight tiles within the bf16 gate_up GEMM's (which compiles), leaving
        # room for the upcast tiles the tensor cores read
        stage_bytes = MAX_ROWS * wide_k * 2 + tiles.block_n * wide_k * (2 if splits == GATED else 1)
        return tiles._replace(block_k=wide_k, stages=min(tiles.stages, SMEM_BUDGET // stage_bytes))
    return None if block_k % tiles.block_k else tiles


def chained_fp8_possible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a chained FP8 decode GEMM can take x @ w^T at all: CUDA with TMA (Hopper), <= 32 rows of bf16 or
    fp16, a contiguous weight (whether its tiles fit the shape is each kernel's own test)."""
    if not (ENABLED and TensorDescriptor is not None and x.is_cuda and has_pdl(x.device)):
        return False
    return 0 < x.shape[0] <= MAX_ROWS and weight.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16)


def decode_fp8_applies(x: torch.Tensor, weight: torch.Tensor, block_k: int, splits: int | str) -> bool:
    """Whether `decode_linear_fp8` (splits 1 or 4) or `decode_gelu_mlp_fp8` (GATED) runs x @ w^T for an
    Fp8Linear's [N, K] `weight` with `block_k` columns per scale: `chained_fp8_possible`, N (each half for GATED)
    and the K-chunks multiples of the tiles."""
    if not chained_fp8_possible(x, weight):
        return False
    k = x.shape[1]
    n = weight.shape[0] // 2 if splits == GATED else weight.shape[0]
    tiles = decode_fp8_tiles(splits, n, k, block_k)
    chunks = 1 if splits == GATED else splits
    return tiles is not None and n % tiles.block_n == 0 and k % (chunks * tiles.block_k) == 0


def decode_linear_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_k: int,
    splits: int = 1,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """x @ (weight * scale)^T for x [rows, K], an Fp8Linear's weight [N, K] and scale [N, K // block_k]:
    [rows, N] in x's dtype (splits == 1) or [splits, rows, N] float32 partial sums. Call where
    `decode_fp8_applies` (or on CPU tensors under TRITON_INTERPRET=1 with `tiles` given)."""
    rows, n = x.shape[0], weight.shape[0]
    shape = (rows, n) if splits == 1 else (splits, rows, n)
    out = torch.empty(shape, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    tiles = tiles or decode_fp8_tiles(splits, n, x.shape[1], block_k)
    _launch(x, weight, scale, block_k, out, splits, n, tiles, gated=False)
    return out


def decode_gelu_mlp_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int, tiles: GemmTiles | None = None
) -> torch.Tensor:
    """gelu_tanh(x @ gate^T) * (x @ up^T) [rows, I] in x's dtype for a stacked gate/up Fp8Linear's weight [2I, K]
    and scale; call where `decode_fp8_applies(x, weight, block_k, GATED)`."""
    rows, n = x.shape[0], weight.shape[0] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _launch(x, weight, scale, block_k, out, 1, n, tiles or decode_fp8_tiles(GATED, n, x.shape[1], block_k), gated=True)
    return out


def tma_operands(x: torch.Tensor, weight: torch.Tensor, tiles: GemmTiles) -> tuple[int, object, object]:
    """BLOCK_M for x's rows, and the TMA descriptors of x [rows, K] (contiguous) and of an FP8 weight [N, K] in
    `tiles`' blocks: what every chained FP8 decode kernel loads."""
    block_m = max(16, triton.next_power_of_2(x.shape[0]))
    x_desc = TensorDescriptor.from_tensor(x, [block_m, tiles.block_k])
    return block_m, x_desc, TensorDescriptor.from_tensor(weight, [tiles.block_n, tiles.block_k])


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int, out: torch.Tensor,
            splits: int, n: int, tiles: GemmTiles, gated: bool) -> None:  # fmt: skip
    x = x.contiguous()
    rows, k = x.shape
    block_m, x_desc, w_desc = tma_operands(x, weight, tiles)
    launch = pdl_launch(x.device, _decode_gemm_fp8_kernel)
    precision, upcast = dot_options(_decode_gemm_fp8_kernel, x.dtype)
    _decode_gemm_fp8_kernel[(n // tiles.block_n, splits)](
        x_desc, w_desc, scale, out, rows, n, k // splits, n if gated else 0, scale.shape[1],
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SCALE_K=block_k,
        PER_CHANNEL=block_k >= k, STAGES=tiles.stages, GATED=gated, USE_PDL=bool(launch),
        UPCAST=upcast, PRECISION=precision, num_warps=tiles.warps, **launch,
    )  # fmt: skip
