"""Rotary position embeddings: the cos/sin tables, and a head's RMSNorm + RoPE in one kernel.

- `rope_cos_sin`: [tokens, head_dim] cos and sin of positions * inverse frequencies (rotate-half layout), one
  kernel per layer type instead of seven torch ops (cast, multiply, cat, cos, sin and two casts): ~20 us less
  per E4B decode step, whose other kernels are chained. The same math: float32 position * inverse frequency,
  cos and sin in float32, each rounded once to the dtype.
- `rms_norm_rope`: the q/k norm and rotate-half RoPE of attention heads (norm, cast, two muls, neg, cat, add):
  one launch for the q of KV-shared layers. `norm_rope_heads` is its math on one head of BLOCK_T tokens,
  shared with the q/k/v kernel of KV-owning layers (`kernels/qkv_store.py`); `head_tiling` picks BLOCK_T by
  token count for both: 1 at decode, a [BLOCK_T, head_dim] tile per program at prefill.

References beside them: `rope_cos_sin_reference`, `apply_rotary`, `rms_norm_rope_reference`; `use_triton` as in
`kernels/norm.py`.

Rounding of `rms_norm_rope`: the norm output is rounded to the dtype (as RMSNorm returns it); then
y * cos + rotate_half(y) * sin is computed in float32 from the rounded y, cos and sin and rounded once, where
torch rounds y * cos, rotate_half(y) * sin and their sum each to bf16. The fused result is the more accurate
one; the two differ by at most a couple of bf16 ulps (in float32 they are the same).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.kernels.norm import load_summed, rms_norm_reference, sum_partials
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


class HeadTiling(NamedTuple):
    """How many tokens of one head a norm + RoPE program takes (BLOCK_T), and its warps."""

    block_tokens: int
    num_warps: int


# A prefill-sized grid of one program per (token, head) is bound by program latency, not bytes (E4B's q/k/v
# kernel at 8192 tokens: 98K programs, 3.6x its memory floor on an H100), so larger calls give each program
# BLOCK_T tokens of a head: as many as keep >= 256 token blocks per head (a few waves over an H100's SMs),
# up to a 4096-value tile. Decode sizes keep one token per program.
_MIN_TOKEN_BLOCKS = 256
_MAX_TILE = 4096


def head_tiling(tokens: int, head_dim: int, block_tokens: int | None = None) -> HeadTiling:
    """The BLOCK_T and num_warps of a norm + RoPE kernel over `tokens` tokens of `head_dim`-wide heads:
    `block_tokens` (a power of two) if given, else by token count (see _MIN_TOKEN_BLOCKS). Warps give each
    thread >= 4 values of the [BLOCK_T, head_dim] tile: 1-4 at one token (as per-token programs always had),
    up to 8 for a tile."""
    if block_tokens is None:
        block_tokens = 1
        while 2 * block_tokens * _MIN_TOKEN_BLOCKS <= tokens and 2 * block_tokens * head_dim <= _MAX_TILE:
            block_tokens *= 2
    elif block_tokens < 1 or block_tokens & (block_tokens - 1):
        raise ValueError(f"block_tokens must be a power of two, got {block_tokens}")
    max_warps = 4 if block_tokens == 1 else 8
    return HeadTiling(block_tokens, max(1, min(max_warps, block_tokens * head_dim // 128)))


@jit
def norm_rope_heads(
    x_rows, split_stride, weight_ptr, cos_rows, sin_rows, live, eps, dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROPE: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """One head of BLOCK_T tokens as a [BLOCK_T, HEAD_DIM] tile: each token's RMSNorm (rounded to `dtype`, as
    RMSNorm returns it), then RoPE in float32 rounded once; float32 values of `dtype`.

    x_rows, cos_rows, sin_rows: [BLOCK_T] pointers to each token's head and its cos and sin rows; live:
    [BLOCK_T], False for the tokens past the last (the tail block), whose rows read nothing and must not be
    stored. x is the projection's output or its SPLITS partial sums (`load_summed`). rotate_half pairs column
    c with (c + HEAD_DIM/2) % HEAD_DIM, loaded a second time (an L1 hit) rather than shuffled in registers."""
    HALF: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, HEAD_DIM)[None, :]
    partner = (cols + HALF) % HEAD_DIM
    live = live[:, None]
    # every load before the reduction, so that none waits on it
    x = load_summed(x_rows[:, None] + cols, live, split_stride, SPLITS, dtype)
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols).to(tl.float32)
    if ROPE:
        x_partner = load_summed(x_rows[:, None] + partner, live, split_stride, SPLITS, dtype)
        cos = tl.load(cos_rows[:, None] + cols, mask=live, other=0.0).to(tl.float32)
        sin = tl.load(sin_rows[:, None] + cols, mask=live, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            weight_partner = tl.load(weight_ptr + partner).to(tl.float32)
    # the tail's zero rows give finite values (1 / sqrt(eps)) that nobody stores
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1)[:, None] / HEAD_DIM + eps)
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
    x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, n_tokens,
    stride_x_split, stride_x_tok, stride_x_head, stride_cos_tok, stride_sin_tok, stride_out_tok, stride_out_head,
    eps,
    HEAD_DIM: tl.constexpr, HAS_WEIGHT: tl.constexpr, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    # one program per (BLOCK_T tokens, head)
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    live = toks < n_tokens
    dtype = out_ptr.dtype.element_ty
    out = norm_rope_heads(
        x_ptr + toks * stride_x_tok + head * stride_x_head, stride_x_split, weight_ptr, cos_ptr + toks * stride_cos_tok,
        sin_ptr + toks * stride_sin_tok, live, eps, dtype, HEAD_DIM, HAS_WEIGHT, True, SPLITS,
    )  # fmt: skip
    out_rows = out_ptr + toks * stride_out_tok + head * stride_out_head
    tl.store(out_rows[:, None] + tl.arange(0, HEAD_DIM)[None, :], out.to(dtype), mask=live[:, None])


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
    block_tokens: int | None = None,
) -> torch.Tensor:
    """RMSNorm over head_dim, then rotate-half RoPE: a new contiguous [tokens, heads, head_dim] in x's dtype.

    x: [tokens, heads, head_dim], any float dtype, any strides with a contiguous last dim (e.g. a split of the
    fused qkv GEMM viewed per head); or [splits, tokens, heads, head_dim] float32 partial sums of a split-K
    projection (`layers/linear.py`), summed and rounded to cos's dtype first. head_dim a power of two.
    weight: [head_dim] or None (scale-free norm). cos, sin: [tokens, head_dim] in x's dtype (the activation
    dtype). The norm output is rounded to that dtype before RoPE; the fused RoPE then rounds once from float32
    (see the module docstring). block_tokens: the kernel's tokens per program (`head_tiling`; None: by count).
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
    tiling = head_tiling(tokens, dim, block_tokens)
    if tokens and heads:
        launch = pdl_launch(x.device, _rms_norm_rope_kernel)
        _rms_norm_rope_kernel[(triton.cdiv(tokens, tiling.block_tokens), heads)](
            x, weight if weight is not None else x, cos, sin, out, tokens,
            x.stride(0) if partials else 0, x.stride(-3), x.stride(-2), cos.stride(0), sin.stride(0),
            out.stride(0), out.stride(1), eps,
            HEAD_DIM=dim, HAS_WEIGHT=weight is not None, SPLITS=x.shape[0] if partials else 1,
            BLOCK_T=tiling.block_tokens, USE_PDL=bool(launch), num_warps=tiling.num_warps, **launch,
        )  # fmt: skip
    return out
