"""The one projection seam of the model: how weights are stored and which GEMM runs each projection.

Storage. Weights load under the checkpoint's names ([out, in] nn.Linear weights); `stack_linears` then joins
projections that read the same input (q/k/v, gate/up) into one matrix, and every projection weight is
stored transposed: a view of a contiguous [in, out] tensor (`store_transposed`). F.linear then runs x @ W^T on
a row-major W^T, which cuBLAS streams 2-8% faster at decode sizes on an H100 (gate_up 40.9 -> 38.9 us at 32
rows) with the same values.

GEMMs. At decode sizes (<= 32 rows, 16-bit, Hopper) projections run the chained Triton GEMM
(`kernels/decode_gemm.py`), which cuBLAS cannot replace inside a chained step. Outputs whose next reader is a
norm kernel come as float32 partial sums over K-chunks, [splits, T, N], which that kernel sums in split order
and rounds as the GEMM would (`kernels/norm.py`, `kernels/rope.py`, `kernels/qkv_store.py`):

- `project` (q / qkv): the chained GEMM's partials where it applies, else the plain product;
- `linear_partials` (o / down, read by the residual add + norm): the chained GEMM's partials where it
  applies, else cuBLAS's batched GEMM over SPLITS chunks on CUDA (it replaces cuBLAS's own split-K GEMM and
  reduction kernel: on an H100, E4B down 21.3 vs 24.0 us at 32 rows, o of full layers 10.7 vs 12.7), else
  the plain product.

FP8 projections (`Fp8Linear`, `layers/fp8_linear.py`) go through the same three functions: at decode sizes a
chained kernel over their FP8 weights with the same outputs and partial sums (one row: `kernels/decode_gemv_fp8.py`;
2-32 rows: `kernels/decode_gemm_fp16.py`; else `kernels/decode_gemm_fp8.py`), else their own GEMM (`fp8_linear`).
`stack_linears` stacks them (weights and scales) and `store_transposed` leaves them as they are: they are stored
the way their GEMMs read them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.kernels.decode_gemm import GATED, decode_gelu_mlp, decode_gemm_applies, decode_linear
from srt.kernels.decode_gemm_fp8 import decode_fp8_applies, decode_gelu_mlp_fp8, decode_linear_fp8
from srt.kernels.decode_gemm_fp16 import decode_fp16_applies, decode_gelu_mlp_fp16, decode_linear_fp16
from srt.kernels.decode_gemv_fp8 import decode_gelu_mlp_gemv, decode_gemv_applies, decode_linear_gemv, gemv_splits
from srt.kernels.gelu_mul import gelu_tanh_mul_packed
from srt.layers.fp8_linear import Fp8Linear, stack_fp8

SPLITS = 2
TRITON_SPLITS = 4  # the chained Triton GEMM's K-chunks (H100: 4 beat 2 and 8 for o and down)
MAX_ROWS = 32  # decode batch sizes (measured at 1 and 32 rows); prefill runs the plain GEMM


@torch.no_grad()
def stack_linears(*linears: nn.Linear | Fp8Linear) -> nn.Linear | Fp8Linear:
    """One bias-free Linear whose output is the given Linears' outputs side by side (one matmul, not several),
    its weight stored transposed; an Fp8Linear when all are. A mix (a checkpoint that quantizes q but not k, say)
    stacks in the 16-bit dtype of the others, the FP8 ones dequantized."""
    if all(isinstance(linear, Fp8Linear) for linear in linears):
        return stack_fp8(*linears)
    dtype = next(linear.weight.dtype for linear in linears if not isinstance(linear, Fp8Linear))
    weight_t = torch.cat([_weight(linear, dtype).t() for linear in linears], dim=1)
    stacked = nn.Linear(weight_t.shape[0], weight_t.shape[1], bias=False, device="meta")  # no init work
    stacked.weight = nn.Parameter(weight_t.t())
    return stacked


def _weight(linear: nn.Linear | Fp8Linear, dtype: torch.dtype) -> torch.Tensor:
    return linear.dequantized(dtype) if isinstance(linear, Fp8Linear) else linear.weight


@torch.no_grad()
def store_transposed(module: nn.Linear | nn.Embedding | Fp8Linear) -> None:
    """`module`'s 2-D weight, same values and shape, as a view of its contiguous transpose (no copy when it is
    one already); an Fp8Linear stays as it is (stored as its GEMMs read it)."""
    if isinstance(module, Fp8Linear):
        return
    module.weight = nn.Parameter(module.weight.t().contiguous().t())


def project(x: torch.Tensor, linear: nn.Linear | Fp8Linear) -> torch.Tensor:
    """x @ W^T for a projection that a norm kernel reads next: at decode sizes on Hopper the chained Triton
    GEMM's float32 K-chunk partial sums ([splits, rows, N], summed by that kernel), else the plain product."""
    if isinstance(linear, Fp8Linear):
        return _fp8_partials(x, linear)
    if decode_gemm_applies(x, linear.weight, TRITON_SPLITS):
        return decode_linear(x, linear.weight, TRITON_SPLITS)
    return linear(x)


def gelu_mlp(x: torch.Tensor, gate_up: nn.Linear | Fp8Linear) -> torch.Tensor:
    """gelu_tanh(x @ gate^T) * (x @ up^T) of the stacked gate/up projection: at decode sizes on Hopper in the
    chained GEMM's epilogue, else the GEMM then the fused gelu * mul kernel."""
    if isinstance(gate_up, Fp8Linear):
        if decode_gemv_applies(x, gate_up.weight, gate_up.block_k, GATED):
            return decode_gelu_mlp_gemv(x, gate_up.weight, gate_up.weight_scale)
        if decode_fp16_applies(x, gate_up.weight, gate_up.block_k, gated=True):
            return decode_gelu_mlp_fp16(x, gate_up.weight, gate_up.weight_scale, gate_up.block_k)
        if decode_fp8_applies(x, gate_up.weight, gate_up.block_k, GATED):
            return decode_gelu_mlp_fp8(x, gate_up.weight, gate_up.weight_scale, gate_up.block_k)
        return gelu_tanh_mul_packed(gate_up(x))
    if decode_gemm_applies(x, gate_up.weight, GATED):
        return decode_gelu_mlp(x, gate_up.weight)
    return gelu_tanh_mul_packed(gate_up(x))


def linear_partials(
    x: torch.Tensor, weight: torch.Tensor | nn.Linear | Fp8Linear, splits: int | None = None
) -> torch.Tensor:
    """x @ weight^T for x [T, K] and an nn.Linear weight [N, K] (or the Linear) stored transposed (a view of a
    contiguous [K, N]): [splits, T, N] float32 partial sums over K-chunks on CUDA for T <= MAX_ROWS rows, else the plain
    [T, N] product. Only for outputs that the residual add + norm kernel reads next. Graph safe.
    `splits`: None takes the chained Triton GEMM's TRITON_SPLITS where it applies, else cuBLAS's batched GEMM
    over SPLITS chunks; a number always takes cuBLAS with that many (bench comparisons). An Fp8Linear (in place
    of the weight): the chained FP8 GEMM's partials where it applies, else its own GEMM's product."""
    if isinstance(weight, Fp8Linear):
        return _fp8_partials(x, weight)
    if isinstance(weight, nn.Linear):
        weight = weight.weight
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


def _fp8_partials(x: torch.Tensor, linear: Fp8Linear) -> torch.Tensor:
    """The chained FP8 GEMM's partial sums where it applies: for one row the CUDA-core kernel (weight-only, over
    `gemv_splits` K-chunks; on an H100 1.15-1.3x faster than the tensor cores there), else the weight-only float16
    product with the weight tile as wgmma's operand (`kernels/decode_gemm_fp16.py`), else weight-only over
    TRITON_SPLITS (bf16 operands); else the FP8 layer's plain product."""
    gemv_chunks = gemv_splits(*linear.weight.shape)
    if decode_gemv_applies(x, linear.weight, linear.block_k, gemv_chunks):
        return decode_linear_gemv(x, linear.weight, linear.weight_scale, gemv_chunks)
    if decode_fp16_applies(x, linear.weight, linear.block_k):
        return decode_linear_fp16(x, linear.weight, linear.weight_scale, linear.block_k)
    if decode_fp8_applies(x, linear.weight, linear.block_k, TRITON_SPLITS):
        return decode_linear_fp8(x, linear.weight, linear.weight_scale, linear.block_k, TRITON_SPLITS)
    return linear(x)
