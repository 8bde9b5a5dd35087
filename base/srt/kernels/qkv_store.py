"""A KV-owning layer's attention inputs from its fused q/k/v projection, in one kernel on GPU.

After the qkv GEMM a Gemma 4 layer norms and ropes q and k, norms v (scale-free), translates the new tokens'
full-pool slots to the SWA pool on sliding layers, and writes k and v into the layer's cache. Op by op that is
six launches per layer (two norm+RoPE, one norm, one index, two index_puts); at decode each is a ~2 us
launch moving a few KB. `qkv_norm_rope_store` does all of it in one launch, one program per (BLOCK_T tokens,
head slot): the first `heads` slots are q heads, then `kv_heads` k heads, then `kv_heads` v heads. BLOCK_T
is 1 at decode and grows with the token count (`rope.head_tiling`): at prefill a grid of per-token programs
is bound by their latency, not by bytes.

    qkv row:  [ q heads ... | k heads ... | v heads ... ]     (no v part on k_eq_v layers: v is k's raw value)
    q slot  -> norm(q_weight), RoPE -> q_out[token, head]
    k slot  -> norm(k_weight), RoPE -> k_buffer[row, head]
    v slot  -> norm()                 -> v_buffer[row, head]
    row = slots[token], or full_to_swa[slots[token]] on sliding layers

Rounding is that of `rms_norm_rope` (kernels/rope.py): the norm's output is rounded to the
projection's dtype, RoPE then rounds once from float32; the cache stores that value cast to its dtype, or,
in FP8 buffers (`--kv-cache-dtype fp8_e4m3`), that value / the layer's scale, clamped to +-448 and rounded to
float8_e4m3fn (`kv_quant.py`; `round_to_e4m3` rounds as torch's cast does, also in the CPU interpreter).
The reference (`qkv_norm_rope_store_reference`) is the op-by-op path: the CPU path and the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.kernels.kv_quant import FP8_KV_MAX, is_fp8_kv, write_rows
from srt.kernels.norm import rms_norm_reference, sum_partials
from srt.kernels.rope import head_tiling, norm_rope_heads, rms_norm_rope
from srt.kernels.triton_support import (
    jit,
    last_dim_contiguous,
    pdl_launch,
    pdl_start,
    round_to_e4m3,
    runs_triton,
    tl,
    triton,
)


@dataclass(frozen=True)
class QKVLayout:
    """How one layer's fused projection output splits into heads."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    k_eq_v: bool  # no v projection: v is the k projection's raw output (before k's norm and RoPE)

    @property
    def sizes(self) -> list[int]:
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim] + [kv] * (1 if self.k_eq_v else 2)


@jit
def _qkv_norm_rope_store_kernel(
    qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, slots_ptr, full_to_swa_ptr,
    q_out_ptr, k_buffer_ptr, v_buffer_ptr, n_tokens,
    stride_split, stride_qkv, stride_cos, stride_sin, stride_q_tok, stride_q_head, stride_k_row, stride_k_head,
    stride_v_row, stride_v_head, q_eps, k_eps, v_eps, k_scale, v_scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, K_EQ_V: tl.constexpr,
    SLIDING: tl.constexpr, SPLITS: tl.constexpr, KV_FP8: tl.constexpr, BLOCK_T: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    # one head slot of BLOCK_T tokens, a [BLOCK_T, HEAD_DIM] tile; `live` masks the last block's tail
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.program_id(1)
    live = toks < n_tokens
    qkv_rows = qkv_ptr + toks * stride_qkv
    cos_rows = cos_ptr + toks * stride_cos
    sin_rows = sin_ptr + toks * stride_sin
    dtype = q_out_ptr.dtype.element_ty  # the activation dtype (qkv may be float32 partial sums)
    cols = tl.arange(0, HEAD_DIM)[None, :]
    if slot < NUM_HEADS:
        q = norm_rope_heads(
            qkv_rows + slot * HEAD_DIM, stride_split, q_weight_ptr, cos_rows, sin_rows, live, q_eps, dtype,
            HEAD_DIM, True, True, SPLITS,
        )  # fmt: skip
        q_dst = q_out_ptr + toks[:, None] * stride_q_tok + slot * stride_q_head + cols
        tl.store(q_dst, q.to(dtype), mask=live[:, None])
    else:
        rows = tl.load(slots_ptr + toks, mask=live, other=0).to(tl.int64)
        if SLIDING:
            rows = tl.load(full_to_swa_ptr + rows, mask=live, other=0).to(tl.int64)
        if slot < NUM_HEADS + NUM_KV_HEADS:
            head = slot - NUM_HEADS
            k = norm_rope_heads(
                qkv_rows + slot * HEAD_DIM, stride_split, k_weight_ptr, cos_rows, sin_rows, live, k_eps, dtype,
                HEAD_DIM, True, True, SPLITS,
            )  # fmt: skip
            k_dst = k_buffer_ptr + rows[:, None] * stride_k_row + head * stride_k_head + cols
            tl.store(k_dst, _to_cache(k, k_scale, k_buffer_ptr.dtype.element_ty, KV_FP8), mask=live[:, None])
        else:
            head = slot - NUM_HEADS - NUM_KV_HEADS
            source = NUM_HEADS + head if K_EQ_V else slot
            v = norm_rope_heads(
                qkv_rows + source * HEAD_DIM, stride_split, v_buffer_ptr, cos_rows, sin_rows, live, v_eps, dtype,
                HEAD_DIM, False, False, SPLITS,
            )  # fmt: skip
            v_dst = v_buffer_ptr + rows[:, None] * stride_v_row + head * stride_v_head + cols
            tl.store(v_dst, _to_cache(v, v_scale, v_buffer_ptr.dtype.element_ty, KV_FP8), mask=live[:, None])


FP8_MAX = tl.constexpr(FP8_KV_MAX) if tl is not None else FP8_KV_MAX


@jit
def _to_cache(x, scale, cache_dtype, KV_FP8: tl.constexpr):
    """x (float32, rounded to the activation dtype by norm_rope_heads) as the cache stores it; FP8: divided by
    the scale and clamped to +-448 (torch's cast, the reference, does not saturate)."""
    if KV_FP8:
        x = round_to_e4m3(tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX))
    return x.to(cache_dtype)


def qkv_norm_rope_store_reference(
    qkv: torch.Tensor,
    layout: QKVLayout,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    full_to_swa: torch.Tensor | None,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The op-by-op path: split, q and k norm + RoPE, scale-free v norm, K/V written at the slots' rows
    (quantized with the scales into FP8 buffers)."""
    tokens, dim = qkv.shape[0], layout.head_dim
    q_raw, k_raw, *v_part = qkv.split(layout.sizes, dim=-1)
    # the torch math (use_triton=False): the kernel under test shares `norm_rope_heads` with rms_norm_rope's
    q = rms_norm_rope(q_raw.view(tokens, -1, dim), q_weight, cos, sin, eps, use_triton=False)
    k_raw = k_raw.view(tokens, -1, dim)
    v_raw = v_part[0].view(tokens, -1, dim) if v_part else k_raw
    k = rms_norm_rope(k_raw, k_weight, cos, sin, eps, use_triton=False)
    rows = slots if full_to_swa is None else full_to_swa[slots]
    write_rows(k_buffer, rows, k, k_scale)
    write_rows(v_buffer, rows, rms_norm_reference(v_raw, None, eps).to(q.dtype), v_scale)
    return q


def qkv_norm_rope_store(
    qkv: torch.Tensor,
    layout: QKVLayout,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    full_to_swa: torch.Tensor | None,
    slots: torch.Tensor,
    use_triton: bool | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    block_tokens: int | None = None,
) -> torch.Tensor:
    """q [tokens, heads, head_dim] normed and roped; k (normed, roped) and v (scale-free norm) of the new
    tokens written to the layer's K/V buffers [rows, kv_heads, head_dim] at the rows of their full-pool `slots`
    [tokens] (int64): the slots themselves, or `full_to_swa[slots]` on sliding layers.

    qkv: [tokens, sum(layout.sizes)] with a contiguous last dim, or the projection's [splits, tokens, ...]
    float32 partial sums (`layers/linear.py`), summed and rounded to cos's dtype first; q_weight, k_weight:
    [head_dim] norm weights (v's norm is scale-free), all three norms with `eps`; cos, sin: [tokens, head_dim]
    in the activation dtype. The caller checks the slots (`SRT_DEBUG_KV_INDICES`): the kernel trusts them.
    `use_triton` as in kernels/norm.py: None runs Triton on CUDA and the reference elsewhere. FP8 buffers
    store value / scale (`k_scale`, `v_scale`: the layer's per-tensor scales, `HybridKVPool.kv_scales`).
    block_tokens: the kernel's tokens per program (`rope.head_tiling`; None: by token count).
    """
    partials = qkv.dim() == 3
    tokens, dim = qkv.shape[-2], layout.head_dim
    if qkv.shape[-1] != sum(layout.sizes):
        raise ValueError(f"qkv has {qkv.shape[-1]} columns; the layout needs {sum(layout.sizes)}")
    if partials and qkv.dtype != torch.float32:
        raise ValueError(f"qkv_norm_rope_store: partial sums come in float32, got {qkv.dtype}")
    if not runs_triton(qkv.device, use_triton, _qkv_norm_rope_store_kernel):
        if partials:
            qkv = sum_partials(qkv, cos.dtype)
        return qkv_norm_rope_store_reference(
            qkv, layout, q_weight, k_weight, eps, cos, sin, k_buffer, v_buffer, full_to_swa, slots, k_scale, v_scale
        )
    if dim & (dim - 1):
        raise ValueError(f"qkv_norm_rope_store needs a power-of-two head_dim, got {dim}")
    qkv, cos, sin = last_dim_contiguous(qkv), last_dim_contiguous(cos), last_dim_contiguous(sin)
    q = torch.empty((tokens, layout.num_heads, dim), dtype=cos.dtype if partials else qkv.dtype, device=qkv.device)
    # the kernel trusts these shapes and strides with raw pointers: a mismatch would write anywhere
    head_shape = (layout.num_kv_heads, dim)
    if k_buffer.shape[1:] != head_shape or v_buffer.shape[1:] != head_shape:
        raise ValueError(f"K/V buffers {list(k_buffer.shape)}, {list(v_buffer.shape)} do not hold {head_shape} heads")
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1 or slots.shape != (tokens,) or slots.stride(0) != 1:
        raise ValueError("qkv_norm_rope_store needs contiguous K/V head rows and one contiguous slot per token")
    tiling = head_tiling(tokens, dim, block_tokens)
    if tokens:
        sliding = full_to_swa is not None
        launch = pdl_launch(qkv.device, _qkv_norm_rope_store_kernel)
        grid = (triton.cdiv(tokens, tiling.block_tokens), layout.num_heads + 2 * layout.num_kv_heads)
        _qkv_norm_rope_store_kernel[grid](
            qkv, q_weight, k_weight, cos, sin, slots, full_to_swa if sliding else slots,
            q, k_buffer, v_buffer, tokens,
            qkv.stride(0) if partials else 0, qkv.stride(-2), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
            k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
            eps, eps, eps, k_scale, v_scale,
            NUM_HEADS=layout.num_heads, NUM_KV_HEADS=layout.num_kv_heads, HEAD_DIM=dim, K_EQ_V=layout.k_eq_v,
            SLIDING=sliding, SPLITS=qkv.shape[0] if partials else 1, KV_FP8=is_fp8_kv(k_buffer.dtype),
            BLOCK_T=tiling.block_tokens, USE_PDL=bool(launch), num_warps=tiling.num_warps, **launch,
        )  # fmt: skip
    return q
