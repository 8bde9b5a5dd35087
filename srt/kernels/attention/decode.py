"""Decode attention: one query row per request, split-KV (flash decoding) so that long contexts fill the GPU.

Stage 1, grid = (rows, kv_heads, num_splits): a program takes one row's whole GQA group (the group's query
heads are the M dimension of the dot products, padded to 16) and one contiguous split of the row's visible
KV range, and writes the split's normalised partial output and its log-sum-exp:

    visible KV of row r:  [start, end)  ->  split s covers [start + s * L, start + (s + 1) * L) ∩ [start, end)
    L = cdiv(cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N

Stage 2, grid = (rows, heads): combines the splits that hold KV. With num_splits == 1 stage 1 writes the
output itself and there is no stage 2.

num_splits is chosen on the host from the number of rows and KV heads only (never from sequence lengths), so
the launch shapes are fixed for a batch size and nothing is read back: the kernels can be captured in CUDA
graphs. Blocks (`default_decode_config`): 64 tokens at head_dim 256, 32 at 512, so a K or V block is 32 KB
of bf16 at most, next to an M x head_dim float32 accumulator (16 x 512 at most) over 4 warps.

FP8 K/V (`--kv-cache-dtype fp8_e4m3`): blocks are loaded as float8_e4m3fn (half the bytes) and widened to the
query's dtype in registers; the per-tensor scales are applied outside the dot products, to the scores
(k_scale) and to the split's output (v_scale), which is the same sum as scaling every element.

Chained launch: a program reads its row's position, length and first KV slots before it waits for the kernel
ahead (`pdl_start`); no kernel of the layers writes them. The query, and on KV-owning layers the new K/V,
come after the wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from srt.kernels.attention.paged_kv import LOG2E, dot_precision, kv_slots, row_kv_bounds
from srt.kernels.kv_quant import is_fp8_kv
from srt.kernels.triton_support import as_dot_operand, fp8_dot_dtype, pdl_launch, pdl_start

MAX_KV_SPLITS = 64


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int


def default_decode_config(head_dim: int, on_gpu: bool, num_splits: int = 0, fp8_kv: bool = False) -> DecodeConfig:
    if not on_gpu:
        return DecodeConfig(block_n=16, num_warps=4, num_stages=1)
    # from H100 sweeps of chained calls over distinct layers' KV (bench/bench_attention.py --chain --sweep):
    # head_dim 256 takes 64-token blocks (E4B sliding, batch 32: 18.2 vs 19.9 us a call with 32-token ones;
    # batch 1 with 8 splits: 5.2 vs 5.4); 512 keeps 32-token blocks and 2 stages
    if head_dim == 256:
        # one split walks a row's whole range, where a second stage hides the loads (FP8 KV, 26B-A4B sliding,
        # batch 32: 41.6 vs 45.9 us, tune-decode-attention-fp8kv-h100.json); with many splits it does not pay
        stages = 2 if fp8_kv and num_splits == 1 else 1
        return DecodeConfig(block_n=64, num_warps=4, num_stages=stages)
    if head_dim >= 512:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=3)


def num_kv_splits(num_rows: int, kv_heads: int, num_sms: int) -> int:
    """Splits per row: enough programs for about one wave of the GPU, a power of two, at most 64 (the H100
    sweep of bench/tune/tune_decode_attention.py: two waves' worth of splits was 6-17% slower at batch 8 and 32)."""
    wanted = triton.cdiv(num_sms, max(num_rows * kv_heads, 1))
    return min(triton.next_power_of_2(wanted), MAX_KV_SPLITS)


@triton.jit
def kv_split_len(kv_start, kv_end, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions per split of [kv_start, kv_end): whole blocks, so that every split but the last is full."""
    kv_len = tl.maximum(kv_end - kv_start, 0)
    return tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_split_kernel(
    q_ptr,
    o_ptr,
    part_o_ptr,
    part_lse_ptr,
    k_ptr,
    v_ptr,
    req_to_token_ptr,
    full_to_swa_ptr,
    row_pool_ptr,
    row_seq_lens_ptr,
    positions_ptr,
    window,
    num_heads,
    k_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_req,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # the dtype of the dot products: the cache's; with an FP8 cache, float16 (or float32 queries' float32)
    kv_dtype = fp8_dot_dtype(q_ptr.dtype.element_ty) if KV_FP8 else k_ptr.dtype.element_ty
    score_scale = k_scale * LOG2E if KV_FP8 else LOG2E
    # before the wait: no kernel of the layers writes positions, lengths or slot tables (module docstring)
    pos = tl.load(positions_ptr + row)
    kv_start, kv_end = row_kv_bounds(pos, tl.load(row_seq_lens_ptr + row), window, SLIDING)
    split_len = kv_split_len(kv_start, kv_end, NUM_SPLITS, BLOCK_N)
    lo = kv_start + split * split_len
    hi = tl.minimum(lo + split_len, kv_end)
    req_to_token_row = req_to_token_ptr + tl.load(row_pool_ptr + row).to(tl.int64) * stride_req

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    h_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    slot = kv_slots(req_to_token_row, full_to_swa_ptr, lo + offs_n, lo + offs_n < hi, SLIDING)
    pdl_start(USE_PDL)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=h_ok[:, None], other=0.0)
    q = as_dot_operand(q, kv_dtype)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kv_ok = start + offs_n < hi
        # K and V of this block, then the next block's slots: three loads in flight, none waiting on math
        k = tl.load(k_ptr + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]).to(kv_dtype)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]).to(kv_dtype)
        next_pos = start + BLOCK_N + offs_n
        slot = kv_slots(req_to_token_row, full_to_swa_ptr, next_pos, next_pos < hi, SLIDING)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * score_scale
        qk = tl.where(kv_ok[None, :], qk, float("-inf"))
        # every block holds at least one visible position, so the running max is finite from the first on
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    if NUM_SPLITS == 1:
        tl.store(
            o_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=h_ok[:, None],
        )
    else:
        part = (row * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=h_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_ok)


@triton.jit
def _decode_combine_kernel(
    o_ptr,
    part_o_ptr,
    part_lse_ptr,
    row_seq_lens_ptr,
    positions_ptr,
    window,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING: tl.constexpr,
    USE_PDL: tl.constexpr,
    ALL_SPLITS: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (row * num_heads + head) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    if ALL_SPLITS:
        # splits of a tile of rows (`verify.py`): every split wrote the row's partial, -inf where the row saw
        # nothing; those it saw are contiguous, and the loop below reads only them (a tile's range may hold many)
        pdl_start(USE_PDL)
        lse = tl.load(part_lse_ptr + base + offs_s)
        seen = lse > float("-inf")
        first = tl.min(tl.where(seen, offs_s, NUM_SPLITS))
        stop = tl.max(tl.where(seen, offs_s + 1, 0))
    else:
        pos, seq_len = tl.load(positions_ptr + row), tl.load(row_seq_lens_ptr + row)
        kv_start, kv_end = row_kv_bounds(pos, seq_len, window, SLIDING)
        split_len = kv_split_len(kv_start, kv_end, NUM_SPLITS, BLOCK_N)
        # splits past the last one that holds KV wrote nothing worth reading
        first = 0
        stop = tl.cdiv(tl.maximum(kv_end - kv_start, 0), tl.maximum(split_len, 1))
        pdl_start(USE_PDL)  # the partials come from the kernel ahead; the metadata above does not
        lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < stop, other=float("-inf"))
    m = tl.max(lse)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m))
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s in range(first, stop):
        weight = tl.exp2(tl.load(part_lse_ptr + base + s) - m)
        acc += weight * tl.load(part_o_ptr + (base + s) * HEAD_DIM + offs_d)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + row * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty))


# for bench/bench_attention.py's register and shared-memory report of the compiled variants
KERNELS = (_decode_split_kernel, _decode_combine_kernel)


def decode_partials(num_rows: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device):
    """Scratch of stage 1: partial outputs [rows, heads, splits, head_dim] and their log2-sum-exp."""
    part_o = torch.empty((num_rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    part_lse = torch.empty((num_rows, num_heads, num_splits), dtype=torch.float32, device=device)
    return part_o, part_lse


def decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa: torch.Tensor,
    row_pool_indices: torch.Tensor,
    row_seq_lens: torch.Tensor,
    positions: torch.Tensor,
    sliding_window: int | None,
    num_splits: int,
    partials: tuple[torch.Tensor, torch.Tensor] | None,
    config: DecodeConfig,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write into `out` [rows, heads, head_dim] the attention of each row's single query over its KV.

    Row r belongs to the request in req_to_token row `row_pool_indices[r]` with `row_seq_lens[r]` tokens of
    KV; `partials` (from `decode_partials`) is needed when num_splits > 1. FP8 K/V buffers hold value / scale
    (`k_scale`, `v_scale`: the layer's per-tensor scales); other buffers ignore the scales.
    """
    num_rows, num_heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    group = num_heads // kv_heads
    sliding = sliding_window is not None
    window = sliding_window or 0
    part_o, part_lse = partials if num_splits > 1 else (out, out)
    launch = pdl_launch(q.device, _decode_split_kernel)
    _decode_split_kernel[(num_rows, kv_heads, num_splits)](
        q,
        out,
        part_o,
        part_lse,
        k_buffer,
        v_buffer,
        req_to_token,
        full_to_swa,
        row_pool_indices,
        row_seq_lens,
        positions,
        window,
        num_heads,
        k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_N=config.block_n,
        NUM_SPLITS=num_splits,
        SLIDING=sliding,
        DOT_PRECISION=dot_precision(q.dtype == torch.float32),
        KV_FP8=is_fp8_kv(k_buffer.dtype),
        USE_PDL=bool(launch),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch,
    )
    if num_splits > 1:
        combine_splits(out, (part_o, part_lse), row_seq_lens, positions, sliding_window, config.block_n)


def combine_splits(
    out: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor],
    row_seq_lens: torch.Tensor,
    positions: torch.Tensor,
    sliding_window: int | None,
    block_n: int,
    all_splits: bool = False,
) -> None:
    """Stage 2: each row's output from its splits' partials (`decode_partials`). The splits a row read are found
    from its bounds and the split kernel's block size, or, with `all_splits` (the verify kernel's splits of a
    tile's range), from the partials themselves: every split wrote a log-sum-exp, -inf where the row saw nothing."""
    part_o, part_lse = partials
    _, num_heads, num_splits, head_dim = part_o.shape
    launch = pdl_launch(out.device, _decode_combine_kernel)
    _decode_combine_kernel[(out.shape[0], num_heads)](
        out,
        part_o,
        part_lse,
        row_seq_lens,
        positions,
        sliding_window or 0,
        num_heads,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        SLIDING=sliding_window is not None,
        USE_PDL=bool(launch),
        ALL_SPLITS=all_splits,
        num_warps=4,
        **launch,
    )
