"""Rotary position embeddings: the cos/sin tables, and a head's RMSNorm + RoPE in one kernel.

- `rope_cos_sin`: [tokens, head_dim] cos and sin of positions * inverse frequencies (rotate-half layout), one
  kernel per layer type instead of seven torch ops (cast, multiply, cat, cos, sin and two casts): ~20 us less
  per E4B decode step, whose other kernels are chained. The same math: float32 position * inverse frequency,
  cos and sin in float32, each rounded once to the dtype.
- `rms_norm_rope`: the q/k norm and rotate-half RoPE of attention heads (norm, cast, two muls, neg, cat, add):
  one launch for the q of KV-shared layers. `norm_rope_head` is its per-head math, shared with the q/k/v
  kernel of KV-owning layers (`kernels/qkv_store.py`).

References beside them: `rope_cos_sin_reference`, `apply_rotary`, `rms_norm_rope_reference`; `use_triton` as in
`kernels/norm.py`.

Rounding of `rms_norm_rope`: the norm output is rounded to the dtype (as RMSNorm returns it); then
y * cos + rotate_half(y) * sin is computed in float32 from the rounded y, cos and sin and rounded once, where
torch rounds y * cos, rotate_half(y) * sin and their sum each to bf16. The fused result is the more accurate
one; the two differ by at most a couple of bf16 ulps (in float32 they are the same).
"""

from __future__ import annotations

import torch

from srt.kernels.norm import load_summed, rms_norm_reference, sum_partials
from srt.kernels.triton_support import jit, last_dim_contiguous, pdl_launch, pdl_start, round_to, runs_triton, tl

# ---------------------------------------------------------------------------------------------------------
# cos / sin tables


@jit
def _cos_sin_kernel(positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr):
    """Row t: cos/sin of positions[t] * inv_freq, [HALF] values written twice (the rotate-half layout)."""
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HALF)
    freqs = tl.load(positions_ptr + tok).to(tl.float32) * tl.load(inv_freq_ptr + cols)
    dtype = cos_ptr.dtype.element_ty
    cos = round_to(tl.cos(freqs), dtype).to(dtype)
    sin = round_to(tl.sin(freqs), dtype).to(dtype)
    row = tok * 2 * HALF + cols
    tl.store(cos_ptr + row, cos)
    tl.store(cos_ptr + row + HALF, cos)
    tl.store(sin_ptr + row, sin)
    tl.store(sin_ptr + row + HALF, sin)


def rope_cos_sin_reference(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops of `rope_cos_sin`."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, 2 * len(inv_freq)] cos and sin of `positions` [tokens] times the float32 `inv_freq` (on the
    positions' device), in `dtype`."""
    half = inv_freq.shape[0]
    if not runs_triton(positions.device, use_triton, _cos_sin_kernel) or half & (half - 1):
        return rope_cos_sin_reference(positions, inv_freq, dtype)
    positions, tokens = positions.contiguous(), positions.shape[0]
    cos = torch.empty((tokens, 2 * half), dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if tokens:
        _cos_sin_kernel[(tokens,)](positions, inv_freq, cos, sin, HALF=half, num_warps=max(1, half // 128))
    return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by per-token cos/sin [tokens, head_dim] (rotate-half layout)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------------------
# RMSNorm + RoPE of attention heads


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
    return apply_rotary(rms_norm_reference(x, weight, eps), cos, sin)


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
    projection (`layers/linear.py`), summed and rounded to cos's dtype first. head_dim a power of two.
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
