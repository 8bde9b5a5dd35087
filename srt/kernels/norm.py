"""RMSNorm kernels of a Gemma 4 decoder layer: the plain norm, and the residual add + norm (+ the next norm).

- `rms_norm`: x / sqrt(mean(x^2) + eps) * weight over the last dim, one program per row. A Gemma 4 layer
  applies up to eight norms; as torch ops (~8 launches each) they dominated prefill kernel launches.
- `add_rms_norm`: a post-attention / post-feedforward norm, the residual add and the layer scalar in one
  launch; `add_rms_norm_then_norm` also returns the next RMSNorm of the sum (the next layer's input norm), and
  `add_rms_norm_then_moe_norms` an MoE layer's other norms of it too (the experts' input norm, and the router's
  norm * scale * scalar: four launches fewer a layer). All accept the float32 K-split partial sums of the
  projection before them (`layers/linear.py`) as x.

Each has its torch reference beside it (`rms_norm_reference`, `add_rms_norm_reference`): the math, the CPU
path and the tests' oracle. `use_triton`: None runs Triton on CUDA and the reference elsewhere; True forces
Triton (on the CPU only under Triton's interpreter, TRITON_INTERPRET=1 set before this module is imported, as
test/conftest.py does).

Rounding. The kernels compute in float32 and round to the tensor dtype where torch rounds, so they agree with
the references bit for bit up to float32 noise (1/sqrt vs pow(-0.5), summation order):

- the RMSNorm output is rounded to x's dtype before anything uses it, as `RMSNorm` returns it;
- `add_rms_norm` rounds the sum, then the product with the scale: torch's two ops, each exact in float32
  and rounded once.

Everything is CUDA-graph safe: no host syncs, and None weights/scales select a compile-time variant.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.kernels.triton_support import (
    jit,
    last_dim_contiguous,
    pdl_launch,
    pdl_start,
    round_to,
    runs_triton,
    tl,
    triton,
)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm in torch: float32 math, weight multiplied directly (no `1 + weight`), x's dtype out."""
    x32 = x.float()
    # pow(-0.5) rather than rsqrt, as transformers does, to stay bit-close to it
    normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        normed = normed * weight.float()
    return normed.type_as(x)


@jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, stride_x, stride_out, n_cols, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols
    y = x / tl.sqrt(mean_square + eps)
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, use_triton: bool | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` (any leading shape), output in x's dtype; weight None: the
    scale-free norm (Gemma 4's v norm and router norm)."""
    if not runs_triton(x.device, use_triton, _rms_norm_kernel):
        return rms_norm_reference(x, weight, eps)
    dim = x.shape[-1]
    rows = last_dim_contiguous(x.reshape(-1, dim))
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight if weight is not None else rows, out, rows.stride(0), out.stride(0), dim, eps,
            HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return out.view(x.shape)


@jit
def load_summed(ptrs, mask, split_stride, SPLITS: tl.constexpr, dtype: tl.constexpr):
    """float32 values at `ptrs` (any shape), zeros where `mask` (broadcast to their shape) is False; with
    SPLITS > 1, float32 K-split partial sums (`layers/linear.py`) `split_stride` elements apart, summed in split
    order and rounded to `dtype` as the GEMM rounds."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if SPLITS > 1:
        for split in tl.static_range(1, SPLITS):
            x += tl.load(ptrs + split * split_stride, mask=mask, other=0.0)
        x = round_to(x, dtype)
    return x


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[splits, tokens, hidden] float32 partial sums -> their sum in split order, rounded to `dtype`."""
    total = partials[0]
    for part in partials[1:]:
        total = total + part
    return total.to(dtype)


@jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, scale_ptr, out_ptr, next_weight_ptr, next_out_ptr,
    expert_weight_ptr, expert_out_ptr, router_scale_ptr, router_out_ptr, residual_weight_ptr,
    then_residual_ptr, then_weight_ptr,
    stride_x_split, stride_x, stride_residual, stride_residual_part, stride_out, stride_next_out, stride_then_residual,
    n_cols, eps, next_eps, router_scalar, residual_eps, then_eps,
    SPLITS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr, NEXT_NORM: tl.constexpr,
    MOE_NORMS: tl.constexpr, RESIDUAL_PARTS: tl.constexpr, THEN_ADD: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    # the constant weights come from HBM while the kernel ahead runs, not after the reductions
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
    if NEXT_NORM:
        next_weight = tl.load(next_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if MOE_NORMS:
        expert_weight = tl.load(expert_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        router_scale = tl.load(router_scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL_PARTS:
        residual_weight = tl.load(residual_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if THEN_ADD:
        then_weight = tl.load(then_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_start(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL_PARTS:  # the residual is RMSNorm(sum of parts): the parts summed in order and rounded, then normed
        for part in tl.static_range(1, RESIDUAL_PARTS):
            part_ptr = residual_ptr + row * stride_residual + part * stride_residual_part
            residual += tl.load(part_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        residual = round_to(residual, dtype)
        residual_rstd = 1.0 / tl.sqrt(tl.sum(residual * residual, axis=0) / n_cols + residual_eps)
        residual = round_to(residual * residual_rstd * residual_weight, dtype)
    if SPLITS > 1:  # float32 K-split partial sums of the GEMM before: their sum, rounded as the GEMM rounds
        for split in tl.static_range(1, SPLITS):
            x += tl.load(x_ptr + split * stride_x_split + row * stride_x + cols, mask=mask, other=0.0)
        x = round_to(x, dtype)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = x * rstd
    if HAS_WEIGHT:
        normed = normed * weight
    # round where torch does: the norm's output, the sum, the product with the scale
    normed = round_to(normed, dtype)
    out = round_to(residual + normed, dtype)
    if THEN_ADD:  # that sum is itself normed and added to a second residual stream (`moe_outputs_add_then_norm`)
        then_rstd = 1.0 / tl.sqrt(tl.sum(out * out, axis=0) / n_cols + then_eps)
        then_residual = tl.load(then_residual_ptr + row * stride_then_residual + cols, mask=mask, other=0.0)
        out = round_to(then_residual.to(tl.float32) + round_to(out * then_rstd * then_weight, dtype), dtype)
    if HAS_SCALE:
        out = round_to(out * scale, dtype)
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=mask)
    if NEXT_NORM:  # the next RMSNorm of the new residual stream, from the rounded sum still in registers
        next_rstd = 1.0 / tl.sqrt(tl.sum(out * out, axis=0) / n_cols + next_eps)
        next_normed = out * next_rstd * next_weight
        tl.store(next_out_ptr + row * stride_next_out + cols, round_to(next_normed, dtype).to(dtype), mask=mask)
        if MOE_NORMS:  # the experts' input norm and the router's scale-free norm * scale * scalar, as torch rounds
            expert_normed = round_to(out * next_rstd * expert_weight, dtype)
            tl.store(expert_out_ptr + row * stride_next_out + cols, expert_normed.to(dtype), mask=mask)
            router = round_to(round_to(round_to(out * next_rstd, dtype) * router_scale, dtype) * router_scalar, dtype)
            tl.store(router_out_ptr + row * stride_next_out + cols, router.to(dtype), mask=mask)


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`(residual + RMSNorm(x)) * scale` in torch, op by op (the math of `add_rms_norm`), in residual's dtype.

    The product is taken in float32 and rounded once, which is torch's `summed * scale` when scale has the
    residual's dtype (as the layer scalar buffer does), and keeps the residual's dtype when it is float32.
    """
    summed = residual + rms_norm_reference(x, weight, eps)
    if scale is None:
        return summed
    return (summed.float() * scale.float()).to(residual.dtype)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """(residual + RMSNorm(x) * weight) * scale as a new [tokens, hidden] tensor in residual's dtype.

    x, residual: [tokens, hidden] of one dtype, any row strides (contiguous last dim); x may instead be the
    [splits, tokens, hidden] float32 partial sums of a split-K projection (`layers/linear.py`), summed
    in split order and rounded to residual's dtype first. weight: [hidden] or None. scale: a 1-element tensor
    (the layer scalar, read on the device: graph-safe) or None. The norm output, the sum and the scaled sum
    are each rounded to the dtype, as the op-by-op torch code rounds them.
    """
    return _add_rms_norm(x, residual, weight, eps, scale, None, 0.0, use_triton)[0]


def add_rms_norm_then_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    next_weight: torch.Tensor,
    next_eps: float,
    scale: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` and the next RMSNorm (weight `next_weight`) of its result, in one kernel:
    (summed, RMSNorm(summed)). E.g. a layer's last residual add, then the next layer's input norm."""
    summed, normed, _ = _add_rms_norm(x, residual, weight, eps, scale, next_weight, next_eps, use_triton)
    assert normed is not None  # a next weight was given
    return summed, normed


class ThenAdd(NamedTuple):
    """A second residual add after the first sum: residual + RMSNorm(sum) * weight (eps `eps`)."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


def moe_outputs_add_then_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    parts: torch.Tensor,
    parts_weight: torch.Tensor,
    parts_eps: float,
    then_add: ThenAdd,
    next_weight: torch.Tensor | None,
    next_eps: float,
    scale: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An MoE layer's end in one kernel: RMSNorm(sum of parts) + RMSNorm(x), then `add_rms_norm_then_norm` of that
    sum onto `then_add`'s residual, scaled: (summed, next norm or None). x is the dense MLP's output (or its K-split
    partials), `parts` [tokens, P, hidden] the expert slots unsummed (summed over P in float32 and rounded as
    torch's sum rounds, then normed with `parts_weight`). Two kernels before (26B-A4B, 32 rows: 7.6 + 2.1 us a
    layer), three in torch."""
    if parts.dim() != 3:
        raise ValueError(f"moe_outputs_add_then_norm: parts must be [tokens, P, hidden], got {list(parts.shape)}")
    if then_add.residual.shape != parts[:, 0].shape:
        raise ValueError(
            f"moe_outputs_add_then_norm: residual {list(then_add.residual.shape)} vs parts {list(parts.shape)}"
        )
    summed, normed, _ = _add_rms_norm(
        x, parts, weight, eps, scale, next_weight, next_eps, use_triton, parts_norm=(parts_weight, parts_eps),
        then_add=then_add,
    )  # fmt: skip
    return summed, normed


class MoeNorms(NamedTuple):
    """The norms a Gemma 4 MoE layer takes of its residual stream besides the dense MLP's: the experts' input norm
    (weight `expert_weight`) and the router's scale-free norm times `router_scale` times `router_scalar`."""

    expert_weight: torch.Tensor
    router_scale: torch.Tensor
    router_scalar: float


def add_rms_norm_then_moe_norms(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    next_weight: torch.Tensor,
    next_eps: float,
    moe: MoeNorms,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm_then_norm` and the MoE norms (`MoeNorms`, eps `next_eps`) of its sum, in one kernel:
    (summed, RMSNorm(summed), the experts' input, the router's input), each rounded where the torch ops round."""
    summed, normed, (expert, router) = _add_rms_norm(
        x, residual, weight, eps, None, next_weight, next_eps, use_triton, moe
    )
    return summed, normed, expert, router


def _add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None,
    next_weight: torch.Tensor | None,
    next_eps: float,
    use_triton: bool | None,
    moe: MoeNorms | None = None,
    parts_norm: tuple[torch.Tensor, float] | None = None,
    then_add: ThenAdd | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """(summed, the next norm of it or None, the MoE norms of it or None). With `parts_norm` (weight, eps) the
    residual comes as parts [tokens, P, hidden] whose normed sum is the residual (`moe_outputs_add_then_norm`); with
    `then_add` the sum is normed and added to a second residual before the scale and the next norm."""
    partials = x.dim() == 3
    parts = residual if parts_norm is not None else None
    if parts is not None:
        residual = parts[:, 0]
    if x.shape[-2:] != residual.shape or x.dtype != (torch.float32 if partials else residual.dtype):
        raise ValueError(f"add_rms_norm: x {x.dtype}{list(x.shape)} vs residual {residual.dtype}{list(residual.shape)}")
    if moe is not None and next_weight is None:
        raise ValueError("add_rms_norm: the MoE norms come with a next norm")
    if not runs_triton(x.device, use_triton, _add_rms_norm_kernel):
        if partials:
            x = sum_partials(x, residual.dtype)
        if parts is not None:
            residual = rms_norm_reference(parts.sum(dim=1), parts_norm[0], parts_norm[1])
        if then_add is None:
            summed = add_rms_norm_reference(x, residual, weight, eps, scale)
        else:
            inner = add_rms_norm_reference(x, residual, weight, eps)
            summed = add_rms_norm_reference(inner, then_add.residual, then_add.weight, then_add.eps, scale)
        normed = None if next_weight is None else rms_norm_reference(summed, next_weight, next_eps)
        return summed, normed, None if moe is None else moe_norms_reference(summed, moe, next_eps)
    x = last_dim_contiguous(x)
    residual = residual if parts is None else parts
    residual = last_dim_contiguous(residual)
    tokens, hidden = residual.shape[0], residual.shape[-1]
    out = torch.empty((tokens, hidden), dtype=residual.dtype, device=x.device)
    next_out = None if next_weight is None else torch.empty_like(out)
    moe_out = None if moe is None else (torch.empty_like(out), torch.empty_like(out))
    if tokens:
        block = triton.next_power_of_2(hidden)
        launch = pdl_launch(x.device, _add_rms_norm_kernel)
        expert_weight, router_scale, router_scalar = moe if moe is not None else (x, x, 0.0)
        residual_weight, residual_eps = parts_norm if parts_norm is not None else (x, 0.0)
        then_residual, then_weight, then_eps = then_add if then_add is not None else (out, x, 0.0)
        _add_rms_norm_kernel[(tokens,)](
            x, residual, weight if weight is not None else x, scale if scale is not None else x, out,
            next_weight if next_weight is not None else x, next_out if next_out is not None else out,
            expert_weight, moe_out[0] if moe_out else out, router_scale, moe_out[1] if moe_out else out,
            residual_weight, then_residual, then_weight, x.stride(0) if partials else 0, x.stride(-2),
            residual.stride(0), residual.stride(1) if parts is not None else 0, out.stride(0), out.stride(0),
            then_residual.stride(0),  # next_out and the MoE norms: as out
            hidden, eps, next_eps, router_scalar, residual_eps, then_eps,
            SPLITS=x.shape[0] if partials else 1, HAS_WEIGHT=weight is not None, HAS_SCALE=scale is not None,
            NEXT_NORM=next_weight is not None, MOE_NORMS=moe is not None,
            RESIDUAL_PARTS=parts.shape[1] if parts is not None else 0, THEN_ADD=then_add is not None,
            BLOCK=block, USE_PDL=bool(launch),
            num_warps=add_norm_warps(block, tokens), **launch,
        )  # fmt: skip
    return out, next_out, moe_out


def moe_norms_reference(summed: torch.Tensor, moe: MoeNorms, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the experts' input, the router's input) of `summed` in torch, op by op as the MoE layer's modules run."""
    router = rms_norm_reference(summed, None, eps) * moe.router_scale * moe.router_scalar
    return rms_norm_reference(summed, moe.expert_weight, eps), router


# From this many rows (prefill sizes) the add + norm kernel runs 8 warps a row rather than 16: more rows share an
# SM (H100, bench/tune/tune_add_rms_norm.py --rows 1024 2048 4096 8192: hidden 2560 at 8192 rows 79 -> 68 us,
# 5376 153 -> 147); decode's few rows keep 16 (the same sweep at 1-32 rows)
PREFILL_ROWS = 1024


def add_norm_warps(block: int, rows: int) -> int:
    """Warps of the add + norm kernel for `rows` rows of `block` (a power of two) columns."""
    return min(16 if rows < PREFILL_ROWS else 8, max(1, block // 256))
