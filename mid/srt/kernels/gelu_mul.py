"""The MLP's gelu(gate, approximate="tanh") * up in one Triton kernel, straight from the gate_up GEMM.

`gelu_tanh_mul` / `gelu_tanh_mul_packed` replace torch's gelu and product kernels with one launch;
`gelu_tanh_mul_rounded` is the in-kernel math that the PLE kernels share. As in kernels/norm.py the kernel
computes in float32 and rounds where torch rounds: gelu(gate), then the product. `gelu_tanh_mul_reference` is
the math and the CPU path; `use_triton` as in kernels/norm.py. CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.kernels.triton_support import jit, last_dim_contiguous, round_to, runs_triton, tl, triton


@jit
def gelu_tanh_f32(x):
    """gelu(x, approximate="tanh") of float32 `x`: 0.5 * (1 + tanh(z)) == sigmoid(2z), so no tanh is needed
    and there is no cancellation for negative z (the clamp only keeps exp finite: gelu is ~1e-35 * x there
    either way)."""
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2 / pi) * (...)
    return x / (1.0 + tl.exp(tl.minimum(-2.0 * inner, 80.0)))


@jit
def gelu_tanh_mul_rounded(gate, up, DTYPE: tl.constexpr):
    """gelu_tanh(gate) * up of float32 values already rounded to DTYPE, rounded where torch rounds: gelu's
    output, then the product. Shared by every kernel that computes the MLP's or the PLE block's gelu * mul."""
    return round_to(round_to(gelu_tanh_f32(gate), DTYPE) * up, DTYPE)


@jit
def _gelu_tanh_mul_kernel(
    gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, stride_out, n_cols,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out = gelu_tanh_mul_rounded(gate, up, dtype)
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=mask)


def gelu_tanh_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.gelu(gate, approximate="tanh") * up` (the math of `gelu_tanh_mul`)."""
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up as a new contiguous [tokens, n] tensor in gate's dtype.

    gate, up: [tokens, n] of one dtype with any row strides and a contiguous last dim, e.g. the two column
    halves of one [tokens, 2n] GEMM output. gelu(gate) is rounded to the dtype before the product, as torch
    rounds it.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gelu_tanh_mul: gate {gate.dtype}{list(gate.shape)} vs up {up.dtype}{list(up.shape)}")
    if not runs_triton(gate.device, use_triton, _gelu_tanh_mul_kernel):
        return gelu_tanh_mul_reference(gate, up)
    gate, up = last_dim_contiguous(gate), last_dim_contiguous(up)
    tokens, n = gate.shape
    out = torch.empty((tokens, n), dtype=gate.dtype, device=gate.device)
    if tokens and n:
        block = min(1024, triton.next_power_of_2(n))
        _gelu_tanh_mul_kernel[(tokens, triton.cdiv(n, block))](
            gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n,
            BLOCK=block, num_warps=max(1, min(4, block // 256)),
        )  # fmt: skip
    return out


def gelu_tanh_mul_packed(gate_up: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """`gelu_tanh_mul` of a [tokens, 2n] tensor whose first n columns are gate and last n are up."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gelu_tanh_mul_packed needs an even number of columns, got {gate_up.shape[-1]}")
    gate, up = gate_up.chunk(2, dim=-1)
    return gelu_tanh_mul(gate, up, use_triton=use_triton)
