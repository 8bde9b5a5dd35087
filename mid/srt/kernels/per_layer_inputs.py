"""The model's per-layer inputs (PLE) in one kernel, once per forward (E2B, E4B).

Every decoder layer of E2B/E4B takes a per-layer input: the layer's slice of the projected embedding
(scaled, RMS-normed) plus the token's slice of the per-layer embedding table (scaled), their sum scaled by
1/sqrt(2). As torch ops that is six launches per forward (scale, norm, gather, scale, add, scale); here one
program per (token, layer) does all of it, rounding to the dtype after each op where the torch ops round.
`combine_per_layer_inputs_reference` is the math and the CPU path; `use_triton` as in kernels/norm.py.
"""

from __future__ import annotations

import torch

from srt.kernels.embedding import scale_in_dtype, scaled_embedding_reference
from srt.kernels.norm import rms_norm_reference
from srt.kernels.triton_support import jit, last_dim_contiguous, round_to, runs_triton, tl


@jit
def _combine_kernel(
    projected_ptr, table_ptr, ids_ptr, norm_weight_ptr, out_ptr, stride_projected, stride_table, stride_out,
    projected_scale, table_scale, eps,
    PLE_DIM: tl.constexpr,
):  # fmt: skip
    """Program (token, layer): the layer's slice of the projection, scaled, normed; plus the token's table
    slice, scaled; the sum over sqrt(2). Rounded to the dtype after each op, where the torch ops round."""
    tok = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * PLE_DIM + tl.arange(0, PLE_DIM)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(norm_weight_ptr + tl.arange(0, PLE_DIM)).to(tl.float32)
    row = tl.load(ids_ptr + tok).to(tl.int64)
    identity = tl.load(table_ptr + row * stride_table + offsets).to(tl.float32)
    projected = tl.load(projected_ptr + tok * stride_projected + offsets).to(tl.float32)
    projected = round_to(projected * projected_scale, dtype)
    normed = round_to(projected / tl.sqrt(tl.sum(projected * projected, axis=0) / PLE_DIM + eps) * weight, dtype)
    summed = round_to(normed + round_to(identity * table_scale, dtype), dtype)
    tl.store(out_ptr + tok * stride_out + offsets, round_to(summed * 0.7071067811865476, dtype).to(dtype))


def combine_per_layer_inputs_reference(
    projected: torch.Tensor,
    projected_scale: float,
    norm_weight: torch.Tensor,
    eps: float,
    table: torch.Tensor,
    table_scale: float,
    input_ids: torch.Tensor,
) -> torch.Tensor:
    """The torch ops of `combine_per_layer_inputs`."""
    tokens, ple_dim = projected.shape[0], norm_weight.shape[0]
    layers = projected.shape[1] // ple_dim  # the table may hold more: its leading layers' columns are used
    normed = rms_norm_reference((projected * projected_scale).view(tokens, layers, ple_dim), norm_weight, eps)
    rows = scaled_embedding_reference(table, input_ids, table_scale)[:, : layers * ple_dim]
    return (normed + rows.view(tokens, layers, ple_dim)) * 2.0**-0.5


def combine_per_layer_inputs(
    projected: torch.Tensor,
    projected_scale: float,
    norm_weight: torch.Tensor,
    eps: float,
    table: torch.Tensor,
    table_scale: float,
    input_ids: torch.Tensor,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """[tokens, layers, ple_dim] per-layer inputs: per layer slice, (RMSNorm(projected * projected_scale) +
    table[input_ids] * table_scale) / sqrt(2).

    projected: the [tokens, layers * ple_dim] model projection of the embeddings; norm_weight: [ple_dim] with
    `eps`; table: the [vocab, layers * ple_dim] per-layer embedding, its scale rounded to its dtype first (as
    the scaled embedding multiplies by it)."""
    tokens, ple_dim = projected.shape[0], norm_weight.shape[0]
    layers = projected.shape[1] // ple_dim
    plain = ple_dim & (ple_dim - 1) or table.stride(-1) != 1
    if not runs_triton(projected.device, use_triton, _combine_kernel) or plain:
        return combine_per_layer_inputs_reference(
            projected, projected_scale, norm_weight, eps, table, table_scale, input_ids
        )
    projected = last_dim_contiguous(projected)
    out = torch.empty((tokens, layers, ple_dim), dtype=projected.dtype, device=projected.device)
    if tokens:
        _combine_kernel[(tokens, layers)](
            projected, table, input_ids.contiguous(), norm_weight, out, projected.stride(0), table.stride(0),
            out.stride(0), projected_scale, scale_in_dtype(table_scale, table.dtype), eps,
            PLE_DIM=ple_dim, num_warps=max(1, ple_dim // 256),
        )  # fmt: skip
    return out
