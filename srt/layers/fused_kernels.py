"""Fused elementwise ops of a Gemma 4 decoder layer: fewer, larger kernels for launch-bound decode.

At batch 1 a decode step is bound by kernel launches (~2 us each), not by bytes; every op below replaces
2 to 6 torch kernels with one Triton launch:

- `rms_norm_rope`: the q/k norm and rotate-half RoPE (norm, cast, two muls, neg, cat, add).
- `add_rms_norm`: a post-attention / post-feedforward norm, the residual add and the layer scalar;
  `add_rms_norm_then_norm` also returns the next RMSNorm of the sum (e.g. the next layer's input norm).
- (the MLP's gelu(gate, tanh) * up is in `gelu_kernels.py`.)

Each op has a pure-torch `*_reference` next to it: the reference is the math (it is what `RMSNorm`,
`apply_rotary` and the MLP compute today, op by op) and the CPU path. The wrappers take `use_triton`:
None runs Triton on CUDA and the reference elsewhere; True forces Triton (on the CPU only under Triton's
interpreter, TRITON_INTERPRET=1 set before this module is imported, as test/conftest.py does).

Rounding. The kernels compute in float32 and round to the tensor dtype where torch would round, so that
they agree with the references bit for bit up to float32 noise (1/sqrt vs pow(-0.5), summation order, exp
vs tanh), which can flip the last bit of a rounded bf16 value now and then:

- the RMSNorm output is rounded to x's dtype before anything uses it, as `RMSNorm` returns it;
- `add_rms_norm` rounds the sum, then the product with the scale: torch's two ops, each exact in float32
  and rounded once;
- `rms_norm_rope` is the one exception: y * cos + rotate_half(y) * sin is computed in float32 from the
  rounded y, cos and sin and rounded once, where torch rounds y * cos, rotate_half(y) * sin and their sum
  each to bf16. The fused result is the more accurate one; the two differ by at most a couple of bf16 ulps
  (in float32 they are the same).

`norm_rope_head` (one head's norm + RoPE) is shared with `qkv_norm_rope_store.py`'s fused q/k/v kernel.

Everything is CUDA-graph safe: no host syncs, and None weights/scales select a compile-time variant.
"""

from __future__ import annotations

import torch

from srt.layers.triton_support import jit, last_dim_contiguous, pdl_launch, pdl_start, round_to, runs_triton, tl, triton


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # RMSNorm.reference, op for op (pow(-0.5), not rsqrt)
    x32 = x.float()
    normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        normed = normed * weight.float()
    return normed.type_as(x)


# ---------------------------------------------------------------------------------------------------------
# RMSNorm + RoPE (q and k heads)


@jit
def load_summed(ptrs, split_stride, SPLITS: tl.constexpr, dtype: tl.constexpr):
    """float32 values at `ptrs`; with SPLITS > 1, float32 K-split partial sums (`split_k.linear_partials`)
    `split_stride` elements apart, summed in split order and rounded to `dtype` as the GEMM rounds."""
    x = tl.load(ptrs).to(tl.float32)
    if SPLITS > 1:
        for split in tl.static_range(1, SPLITS):
            x += tl.load(ptrs + split * split_stride)
        x = round_to(x, dtype)
    return x


@jit
def norm_rope_head(
    x_row, split_stride, weight_ptr, cos_row, sin_row, eps, dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROPE: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """One head's RMSNorm (rounded to `dtype`, as RMSNorm returns it), then RoPE in float32 rounded once;
    float32 values of `dtype`. x is the projection's output or its SPLITS partial sums (`load_summed`).
    rotate_half pairs column c with (c + HEAD_DIM/2) % HEAD_DIM, loaded a second time (an L1 hit) rather
    than shuffled in registers."""
    HALF: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, HEAD_DIM)
    partner = (cols + HALF) % HEAD_DIM
    # every load before the reduction, so that none waits on it
    x = load_summed(x_row + cols, split_stride, SPLITS, dtype)
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols).to(tl.float32)
    if ROPE:
        x_partner = load_summed(x_row + partner, split_stride, SPLITS, dtype)
        cos = tl.load(cos_row + cols).to(tl.float32)
        sin = tl.load(sin_row + cols).to(tl.float32)
        if HAS_WEIGHT:
            weight_partner = tl.load(weight_ptr + partner).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    y = x * rstd
    if HAS_WEIGHT:
        y = y * weight
    y = round_to(y, dtype)
    if ROPE:
        y_partner = x_partner * rstd
        if HAS_WEIGHT:
            y_partner = y_partner * weight_partner
        y_partner = round_to(y_partner, dtype)
        rotated = tl.where(cols < HALF, -y_partner, y_partner)
        y = round_to(y * cos + rotated * sin, dtype)
    return y


@jit
def _rms_norm_rope_kernel(
    x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_x_split, stride_x_tok, stride_x_head, stride_cos_tok, stride_sin_tok, stride_out_tok, stride_out_head,
    eps,
    HEAD_DIM: tl.constexpr, HAS_WEIGHT: tl.constexpr, SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    # one program per (token, head)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    out = norm_rope_head(
        x_ptr + tok * stride_x_tok + head * stride_x_head, stride_x_split, weight_ptr, cos_ptr + tok * stride_cos_tok,
        sin_ptr + tok * stride_sin_tok, eps, dtype, HEAD_DIM, HAS_WEIGHT, True, SPLITS,
    )  # fmt: skip
    cols = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + tok * stride_out_tok + head * stride_out_head + cols, out.to(dtype))


def rms_norm_rope_reference(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """`apply_rotary(RMSNorm(x), cos, sin)` in torch, op by op in x's dtype (the math of `rms_norm_rope`)."""
    y = _rms_norm_reference(x, weight, eps)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = y.shape[-1] // 2
    return y * cos + torch.cat((-y[..., half:], y[..., :half]), dim=-1) * sin


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """RMSNorm over head_dim, then rotate-half RoPE: a new contiguous [tokens, heads, head_dim] in x's dtype.

    x: [tokens, heads, head_dim], any float dtype, any strides with a contiguous last dim (e.g. a split of the
    fused qkv GEMM viewed per head); or [splits, tokens, heads, head_dim] float32 partial sums of a split-K
    projection (`split_k.linear_partials`), summed and rounded to cos's dtype first. head_dim a power of two.
    weight: [head_dim] or None (scale-free norm). cos, sin: [tokens, head_dim] in x's dtype (the activation
    dtype). The norm output is rounded to that dtype before RoPE; the fused RoPE then rounds once from float32
    (see the module docstring).
    """
    partials = x.dim() == 4
    if partials and x.dtype != torch.float32:
        raise ValueError(f"rms_norm_rope: partial sums come in float32, got {x.dtype}")
    if not runs_triton(x.device, use_triton, _rms_norm_rope_kernel):
        return rms_norm_rope_reference(sum_partials(x, cos.dtype) if partials else x, weight, cos, sin, eps)
    tokens, heads, dim = x.shape[-3:]
    if dim & (dim - 1):
        raise ValueError(f"rms_norm_rope needs a power-of-two head_dim, got {dim}")
    x, cos, sin = last_dim_contiguous(x), last_dim_contiguous(cos), last_dim_contiguous(sin)
    out = torch.empty((tokens, heads, dim), dtype=cos.dtype if partials else x.dtype, device=x.device)
    if tokens and heads:
        launch = pdl_launch(x.device, _rms_norm_rope_kernel)
        _rms_norm_rope_kernel[(tokens, heads)](
            x, weight if weight is not None else x, cos, sin, out,
            x.stride(0) if partials else 0, x.stride(-3), x.stride(-2), cos.stride(0), sin.stride(0),
            out.stride(0), out.stride(1), eps,
            HEAD_DIM=dim, HAS_WEIGHT=weight is not None, SPLITS=x.shape[0] if partials else 1, USE_PDL=bool(launch),
            num_warps=max(1, min(4, dim // 128)), **launch,
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------
# residual + RMSNorm (* layer scalar)


@jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, scale_ptr, out_ptr, next_weight_ptr, next_out_ptr,
    stride_x_split, stride_x, stride_residual, stride_out, stride_next_out, n_cols, eps, next_eps,
    SPLITS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr, NEXT_NORM: tl.constexpr,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
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
    pdl_start(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
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
    if HAS_SCALE:
        out = round_to(out * scale, dtype)
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=mask)
    if NEXT_NORM:  # the next RMSNorm of the new residual stream, from the rounded sum still in registers
        next_rstd = 1.0 / tl.sqrt(tl.sum(out * out, axis=0) / n_cols + next_eps)
        next_normed = out * next_rstd * next_weight
        tl.store(next_out_ptr + row * stride_next_out + cols, round_to(next_normed, dtype).to(dtype), mask=mask)


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
    summed = residual + _rms_norm_reference(x, weight, eps)
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
    [splits, tokens, hidden] float32 partial sums of a split-K projection (`split_k.linear_partials`), summed
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
    summed, normed = _add_rms_norm(x, residual, weight, eps, scale, next_weight, next_eps, use_triton)
    assert normed is not None  # a next weight was given
    return summed, normed


def _add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None,
    next_weight: torch.Tensor | None,
    next_eps: float,
    use_triton: bool | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    partials = x.dim() == 3
    if x.shape[-2:] != residual.shape or x.dtype != (torch.float32 if partials else residual.dtype):
        raise ValueError(f"add_rms_norm: x {x.dtype}{list(x.shape)} vs residual {residual.dtype}{list(residual.shape)}")
    if not runs_triton(x.device, use_triton, _add_rms_norm_kernel):
        if partials:
            x = sum_partials(x, residual.dtype)
        summed = add_rms_norm_reference(x, residual, weight, eps, scale)
        return summed, None if next_weight is None else _rms_norm_reference(summed, next_weight, next_eps)
    x, residual = last_dim_contiguous(x), last_dim_contiguous(residual)
    tokens, hidden = residual.shape
    out = torch.empty((tokens, hidden), dtype=residual.dtype, device=x.device)
    next_out = None if next_weight is None else torch.empty_like(out)
    if tokens:
        block = triton.next_power_of_2(hidden)
        launch = pdl_launch(x.device, _add_rms_norm_kernel)
        _add_rms_norm_kernel[(tokens,)](
            x, residual, weight if weight is not None else x, scale if scale is not None else x, out,
            next_weight if next_weight is not None else x, next_out if next_out is not None else out,
            x.stride(0) if partials else 0, x.stride(-2), residual.stride(0), out.stride(0), out.stride(0),
            hidden, eps, next_eps,  # next_out: as out
            SPLITS=x.shape[0] if partials else 1, HAS_WEIGHT=weight is not None, HAS_SCALE=scale is not None,
            NEXT_NORM=next_weight is not None, BLOCK=block, USE_PDL=bool(launch), num_warps=add_norm_warps(block),
            **launch,
        )  # fmt: skip
    return out, next_out


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[splits, tokens, hidden] float32 partial sums -> their sum in split order, rounded to `dtype`."""
    total = partials[0]
    for part in partials[1:]:
        total = total + part
    return total.to(dtype)


def add_norm_warps(block: int) -> int:
    """Warps of the add + norm kernel for a row of `block` (a power of two) columns."""
    return min(16, max(1, block // 256))
