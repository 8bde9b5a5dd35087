"""Extend attention: many query rows per request over paged KV (prefill, prefix hits, chunks, YOCO subsets).

The query rows of a request are cut into tiles of BLOCK_Q consecutive rows. One program computes a tile for
HEADS_PER_PROG query heads of one KV-head group, packed into the M dimension of the dot products so that
each K/V block it loads serves all of them (GQA):

    M index m -> query row  tile_first_row + m // HEADS_PER_PROG,  head  first_head + m % HEADS_PER_PROG

    grid = (tiles, kv_heads * head_splits, value_splits)        head_splits = group / HEADS_PER_PROG

It walks the KV positions its rows can see, [min over rows of the window start, max over rows of the
position], in blocks of BLOCK_N, with an online softmax; per element it masks what each row may not see
(causal and window bounds from each row's own position, so rows need not be prefix .. seq_len - 1).
Image rows of checkpoints whose image tokens attend both ways (26B-A4B, 31B: sliding layers only) see up to
the last position of their image instead of their own (`last_visible`, per row), the window still counted
from their own position: transformers' AND(window, OR(causal, same image)).
head_dim 512 splits the output columns over value_splits programs per tile (each recomputes the
M x N scores over the full head_dim), so that the fp32 accumulator M x head_dim / value_splits fits.

FP8 K/V (`--kv-cache-dtype fp8_e4m3`): blocks load as float8_e4m3fn and are widened to the query's dtype in
registers; k_scale multiplies the scores and v_scale the output, the same sums as dequantizing every element.

The tile table's length is an upper bound (`extend_tile_count`: min(cdiv(rows, BLOCK_Q) + requests, rows), as
every tile holds a row); surplus tiles cover no rows and do no work. A captured step builds it on the device from
its tensors, reading nothing back (`build_extend_tiles`); an eager step from the host's lists, copied in one go
(`build_extend_tiles_host`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from srt.kernels.attention.paged_kv import LOG2E, dot_precision, kv_slots, row_kv_bounds
from srt.kernels.kv_quant import is_fp8_kv
from srt.kernels.triton_support import as_dot_operand, fp8_dot_dtype


@dataclass(frozen=True)
class ExtendConfig:
    """Block shape of the extend kernel; BLOCK_M = block_q * heads_per_prog."""

    block_q: int
    heads_per_prog: int
    block_n: int
    num_warps: int
    num_stages: int
    value_splits: int = 1  # programs that share a tile, each computing head_dim / value_splits output columns


def default_extend_config(head_dim: int, group: int, on_gpu: bool, element_size: int = 2) -> ExtendConfig:
    """Blocks for one layer shape and KV element size (bytes). On the CPU interpreter: small blocks, so that
    tests cross many block edges."""
    per_prog = min(triton.next_power_of_2(group), 4)  # query heads of a KV group per program
    if not on_gpu:
        return ExtendConfig(block_q=max(16 // per_prog, 1), heads_per_prog=per_prog, block_n=16, num_warps=4,
                            num_stages=1)  # fmt: skip
    if head_dim <= 128:
        return ExtendConfig(block_q=max(64 // per_prog, 1), heads_per_prog=per_prog, block_n=64, num_warps=4,
                            num_stages=2)  # fmt: skip
    if element_size > 2:  # fp32 K/V at head_dim 256/512 (not a serving path): blocks that fit shared memory
        return ExtendConfig(block_q=max(32 // per_prog, 1), heads_per_prog=per_prog, block_n=32, num_warps=8,
                            num_stages=1, value_splits=2)  # fmt: skip
    # head_dim 256 and 512 on H100: M = 128 rows x heads (wgmma). At 512 each program computes half of the
    # output columns (the QK product is done twice, but the M x 256 fp32 accumulator fits the registers next to
    # the pipelined K/V blocks: a full 128 x 512 one would not, and M = 32 leaves the tensor cores idle); a
    # 128 x 256 one fits whole (bench/tune/tune_extend_attention.py, H100, 8192-token prefills: sliding layers
    # 1.40-1.43x faster than with two value splits; no 512 tiles beat these by more than 2%)
    return ExtendConfig(
        block_q=max(128 // per_prog, 1),
        heads_per_prog=per_prog,
        block_n=64 if head_dim <= 256 else 32,
        num_warps=8,
        num_stages=2,
        value_splits=1 if head_dim <= 256 else 2,
    )


def extend_tile_count(num_rows: int, block_q: int, requests: int) -> int:
    """The tile table's length: each request's tiles hold block_q rows but its last, and every tile a row (a
    padded verify step's many empty requests must not widen the grid)."""
    return min(triton.cdiv(num_rows, block_q) + requests, num_rows)


def build_extend_tiles(
    extend_seq_lens: torch.Tensor, num_rows: int, block_q: int, skip: torch.Tensor | None = None
) -> torch.Tensor:
    """[3, n] int32 device table: per tile its request, first row and the request's end row (exclusive).

    Tiles of a request are listed last first (the last rows see the most KV, so they start first). Requests
    with no rows get no tile, nor do those where `skip` ([requests] bool) is set (their rows are left to
    another kernel). n = `extend_tile_count`; tiles past the real count have first row == end row.
    """
    lens = extend_seq_lens.to(torch.int64)
    device = lens.device
    tiles = (lens + block_q - 1) // block_q
    if skip is not None:
        tiles = tiles.masked_fill(skip, 0)
    tiles_end = torch.cumsum(tiles, 0)
    rows_end = torch.cumsum(lens, 0)
    n = extend_tile_count(num_rows, block_q, lens.shape[0])
    index = torch.arange(n, device=device)
    req = torch.searchsorted(tiles_end, index, right=True).clamp_(max=lens.shape[0] - 1)
    k = index - (tiles_end - tiles)[req]  # tile index inside its request
    first = rows_end[req] - lens[req] + (tiles[req] - 1 - k) * block_q
    end = rows_end[req]
    first = torch.where(k < tiles[req], first, end)
    return torch.stack([req, first, end]).to(torch.int32)


def build_extend_tiles_host(
    extend_seq_lens: list[int], num_rows: int, block_q: int, skip: list[bool] | None = None
) -> list[int]:
    """`build_extend_tiles`' table from the host's lists, flattened (requests, first rows, end rows): the same
    values with no kernel, for a step whose lengths the host knows and that no CUDA graph captures. On an H100
    the device build's ~28 small kernels cost an eager 8k prompt step ~1.5 ms of host launches before its first
    attention, GPU idle where no step ran before it (docs/benchmarks.md)."""
    reqs: list[int] = []
    firsts: list[int] = []
    ends: list[int] = []
    end = 0
    for req, length in enumerate(extend_seq_lens):
        start, end = end, end + length
        if length == 0 or (skip is not None and skip[req]):
            continue
        count = -(-length // block_q)
        reqs += [req] * count
        firsts += range(start + (count - 1) * block_q, start - 1, -block_q)  # last tile first
        ends += [end] * count
    # surplus tiles: the last request's, empty (first row == end row)
    pad = extend_tile_count(num_rows, block_q, len(extend_seq_lens)) - len(reqs)
    return reqs + [len(extend_seq_lens) - 1] * pad + firsts + [end] * pad + ends + [end] * pad


@triton.jit
def _attend(
    q, pos, last, window, m_i, l_i, acc, kv, start, end, offs_n, offs_d, offs_v,
    MASK: tl.constexpr, SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax of the tile's rows over kv positions [start, end), in blocks of len(offs_n).

    With MASK, each row's bounds (up to `last`, its last visible position; the window back from `pos`) and the
    range end are applied per element; without it every row must see every position of whole blocks.
    """
    (k_ptr, v_ptr, req_to_token_row, full_to_swa_ptr, kv_head, stride_kt, stride_kh, stride_vt, stride_vh,
     score_scale) = kv  # fmt: skip
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    for block in range(start, end, BLOCK_N):
        kv_pos = block + offs_n
        if MASK:
            kv_ok = kv_pos < end
            slot = kv_slots(req_to_token_row, full_to_swa_ptr, kv_pos, kv_ok, SLIDING)
        else:
            slot = kv_slots(req_to_token_row, full_to_swa_ptr, kv_pos, None, SLIDING)
        k = tl.load(k_ptr + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]).to(q.dtype)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * score_scale
        if MASK:
            visible = kv_ok[None, :] & (kv_pos[None, :] <= last[:, None])
            if SLIDING:
                visible &= kv_pos[None, :] > pos[:, None] - window
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet stays at zero
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kv_head * stride_vh + offs_v[None, :]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# num_tiles changes with every batch: specialised (== 1, a multiple of 16), each new kind of batch would compile
# the kernel again while requests wait
@triton.jit(do_not_specialize=["num_tiles"])
def _extend_kernel(
    q_ptr,
    o_ptr,
    k_ptr,
    v_ptr,
    req_to_token_ptr,
    full_to_swa_ptr,
    tiles_ptr,
    req_pool_ptr,
    seq_lens_ptr,
    positions_ptr,
    last_visible_ptr,
    num_tiles,
    window,
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
    HEAD_SPLITS: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    IMAGES: tl.constexpr,
):
    tile = tl.program_id(0)
    # the dtype of the dot products: the cache's; with an FP8 cache, float16 (or float32 queries' float32)
    kv_dtype = fp8_dot_dtype(q_ptr.dtype.element_ty) if KV_FP8 else k_ptr.dtype.element_ty
    kv_head = tl.program_id(1) // HEAD_SPLITS
    first_head = kv_head * GROUP + (tl.program_id(1) % HEAD_SPLITS) * HEADS_PER_PROG
    offs_v = tl.program_id(2) * VALUE_DIM + tl.arange(0, VALUE_DIM)  # the output columns of this program
    req = tl.load(tiles_ptr + tile)
    row_first = tl.load(tiles_ptr + num_tiles + tile)
    row_end = tl.load(tiles_ptr + 2 * num_tiles + tile)

    offs_m = tl.arange(0, BLOCK_Q * HEADS_PER_PROG)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = row_first + offs_m // HEADS_PER_PROG
    heads = first_head + offs_m % HEADS_PER_PROG
    m_ok = (rows < row_end) & (heads < (kv_head + 1) * GROUP)
    rows = rows.to(tl.int64)
    pos = tl.load(positions_ptr + rows, mask=m_ok, other=0)
    last = tl.load(last_visible_ptr + rows, mask=m_ok, other=0) if IMAGES else pos
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )
    q = as_dot_operand(q, kv_dtype)

    seq_len = tl.load(seq_lens_ptr + req)
    req_to_token_row = req_to_token_ptr + tl.load(req_pool_ptr + req).to(tl.int64) * stride_req
    # KV positions some row of the tile sees: [kv_start, kv_end); those every row sees: [all_start, all_end)
    # (the window starts from the rows' positions, the causal ends from their last visible positions)
    pos_hi = tl.max(tl.where(m_ok, pos, -1))
    pos_lo = tl.min(tl.where(m_ok, pos, pos_hi))
    last_hi = tl.max(tl.where(m_ok, last, -1))
    last_lo = tl.min(tl.where(m_ok, last, last_hi))
    kv_start, _ = row_kv_bounds(pos_lo, seq_len, window, SLIDING)
    all_start, _ = row_kv_bounds(pos_hi, seq_len, window, SLIDING)
    _, lo_end = row_kv_bounds(last_lo, seq_len, window, SLIDING)
    _, kv_end = row_kv_bounds(last_hi, seq_len, window, SLIDING)
    all_end = tl.maximum(lo_end, all_start)
    all_end = all_start + (all_end - all_start) // BLOCK_N * BLOCK_N  # whole blocks only: no bounds mask

    m_i = tl.full([BLOCK_Q * HEADS_PER_PROG], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * HEADS_PER_PROG], tl.float32)
    acc = tl.zeros([BLOCK_Q * HEADS_PER_PROG, VALUE_DIM], tl.float32)
    score_scale = k_scale * LOG2E if KV_FP8 else LOG2E
    kv = (k_ptr, v_ptr, req_to_token_row, full_to_swa_ptr, kv_head, stride_kt, stride_kh, stride_vt, stride_vh,
          score_scale)  # fmt: skip
    # masked blocks before (window edge), unmasked blocks in the middle, masked blocks after (causal edge)
    m_i, l_i, acc = _attend(q, pos, last, window, m_i, l_i, acc, kv, kv_start, all_start, offs_n, offs_d, offs_v,
                            True, SLIDING, DOT_PRECISION)  # fmt: skip
    m_i, l_i, acc = _attend(q, pos, last, window, m_i, l_i, acc, kv, all_start, all_end, offs_n, offs_d, offs_v,
                            False, SLIDING, DOT_PRECISION)  # fmt: skip
    m_i, l_i, acc = _attend(q, pos, last, window, m_i, l_i, acc, kv, tl.maximum(all_end, kv_start), kv_end,
                            offs_n, offs_d, offs_v, True, SLIDING, DOT_PRECISION)  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    tl.store(
        o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_v[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=m_ok[:, None],
    )


def extend_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa: torch.Tensor,
    tiles: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    sliding_window: int | None,
    config: ExtendConfig,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    last_visible: torch.Tensor | None = None,
) -> None:
    """Write into `out` [rows, heads, head_dim] the attention of q over each request's KV.

    `tiles` comes from `build_extend_tiles(..., config.block_q)`; K/V buffers are [slots, kv_heads, head_dim]
    (a sliding layer's are indexed by SWA slots, reached through `full_to_swa`). FP8 buffers hold
    value / scale (`k_scale`, `v_scale`: the layer's per-tensor scales); other buffers ignore the scales.
    `last_visible` [rows]: the last kv position each row sees where it is past the row's position (image rows
    of a sliding layer); None: each row's own position.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_buffer.shape[1]
    group = num_heads // kv_heads
    head_splits = triton.cdiv(group, config.heads_per_prog)
    num_tiles = tiles.shape[1]
    grid = (num_tiles, kv_heads * head_splits, config.value_splits)
    _extend_kernel[grid](
        q,
        out,
        k_buffer,
        v_buffer,
        req_to_token,
        full_to_swa,
        tiles,
        req_pool_indices,
        seq_lens,
        positions,
        positions if last_visible is None else last_visible,
        num_tiles,
        sliding_window or 0,
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
        HEAD_SPLITS=head_splits,
        HEADS_PER_PROG=config.heads_per_prog,
        HEAD_DIM=head_dim,
        VALUE_DIM=head_dim // config.value_splits,
        BLOCK_Q=config.block_q,
        BLOCK_N=config.block_n,
        SLIDING=sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype == torch.float32),
        KV_FP8=is_fp8_kv(k_buffer.dtype),
        IMAGES=last_visible is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
