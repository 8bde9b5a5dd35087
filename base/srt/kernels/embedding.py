"""A scaled embedding lookup in one Triton kernel: the rows of `ids`, times a constant, for any table layout.

Gemma 4 multiplies its embeddings by sqrt(hidden) (and the per-layer table by sqrt(ple_dim)). srt stores a tied
embedding transposed (the LM head streams it faster so, `Gemma4ForCausalLM.fuse_projections`), and torch's
lookup on that strided table is a general gather kernel plus a multiply: ~13 us of an E4B decode step at batch
32 on an H100. Here one kernel gathers each token's row in blocks of columns and scales it, rounding the
product to the table's dtype as the torch multiply does. `scaled_embedding_reference` is the math and the CPU
path; `use_triton` as in kernels/norm.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from srt.kernels.triton_support import jit, round_to, runs_triton, tl, triton

BLOCK = 256


@jit
def _scaled_lookup_kernel(
    weight_ptr, ids_ptr, out_ptr, stride_row, stride_col, dim, scale,
    BLOCK: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    row = tl.load(ids_ptr + tok).to(tl.int64)
    values = tl.load(weight_ptr + row * stride_row + cols.to(tl.int64) * stride_col, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + tok * dim + cols, round_to(values.to(tl.float32) * scale, dtype).to(dtype), mask=mask)


@functools.cache
def scale_in_dtype(scale: float, dtype: torch.dtype) -> float:
    """`scale` rounded to `dtype` (what the reference multiplies by), computed once per (scale, dtype)."""
    return float(torch.tensor(scale, dtype=dtype))


def scaled_embedding_reference(weight: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """`F.embedding(ids, weight)` times `scale` rounded to the weight's dtype (the reference's multiply)."""
    return F.embedding(ids, weight) * torch.tensor(scale, dtype=weight.dtype)


def scaled_embedding(
    weight: torch.Tensor, ids: torch.Tensor, scale: float, use_triton: bool | None = None
) -> torch.Tensor:
    """[*ids.shape, dim] rows of `weight` [vocab, dim] (any strides) times `scale`, in the weight's dtype."""
    if not runs_triton(weight.device, use_triton, _scaled_lookup_kernel):
        return scaled_embedding_reference(weight, ids, scale)
    flat = ids.reshape(-1).contiguous()
    dim = weight.shape[1]
    out = torch.empty((flat.shape[0], dim), dtype=weight.dtype, device=weight.device)
    if flat.shape[0]:
        _scaled_lookup_kernel[(flat.shape[0], triton.cdiv(dim, BLOCK))](
            weight, flat, out, weight.stride(0), weight.stride(1), dim, scale_in_dtype(scale, weight.dtype),
            BLOCK=BLOCK, num_warps=2,
        )  # fmt: skip
    return out.view(*ids.shape, dim)
