"""Verify attention: a few query rows per request (speculative verify steps: the newest token and K drafts)
over paged KV, split-KV as decode, the rows of a request sharing every K/V block they load.

Decode's kernel takes one row at a time, so a verify step of K + 1 rows per request reads each request's KV
K + 1 times: E4B at batch 32, K = 3 on an H100, a layer's attention took 41 us in a verify step against 19 in a
decode step (docs/benchmarks.md), the extra reads of a memory-bound kernel. Here a program takes a tile of up
to `rows_per_tile` consecutive rows of one request (the extend kernel's tile table, `build_extend_tiles` with
block_q = rows_per_tile) and one KV head's GQA group, packed into the M dimension of the dot products as the
extend kernel packs them, and one split of the KV range the tile's rows see:

    M index m -> query row  tile_first_row + m // group,  head  kv_head * group + m % group
    tile's KV [start of its first row, end of its last row)  ->  splits as decode's (`kv_split_len`)
    grid = (tiles, kv_heads, num_splits)

Each row is masked per element by its own causal and window bounds. Every program writes each of its rows'
partial output and log-sum-exp, -inf where the row sees nothing of the split (or the split is empty), and
decode's combine merges the splits each row saw (`combine_splits(all_splits=True)`). With one split the output
is written directly. FP8 K/V as in decode: widened on load, k_scale on the scores, v_scale on the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.kernels.attention.decode import DecodeConfig, combine_splits, kv_split_len
from srt.kernels.attention.paged_kv import LOG2E, dot_precision, kv_slots, row_kv_bounds
from srt.kernels.kv_quant import is_fp8_kv
from srt.kernels.triton_support import as_dot_operand, fp8_dot_dtype, pdl_launch, pdl_start

# query rows x heads per program at most (the MMA's M): the float32 accumulator M x head_dim over 4 warps
# stays at 128 registers a thread up to head_dim 512
MAX_BLOCK_M = 32


def verify_tile_rows(rows_per_request: int, group: int) -> int:
    """Rows of a request per program: all of them where M = rows x group fits MAX_BLOCK_M (E4B at K = 3: 4 rows
    x 4 heads), else as many as fit (at least one)."""
    return max(1, min(rows_per_request, MAX_BLOCK_M // group))


# num_tiles changes with the batch: not specialised, so that batch shapes do not compile new variants
@triton.jit(do_not_specialize=["num_tiles"])
def _verify_split_kernel(
    q_ptr,
    o_ptr,
    part_o_ptr,
    part_lse_ptr,
    k_ptr,
    v_ptr,
    req_to_token_ptr,
    full_to_swa_ptr,
    tiles_ptr,
    req_pool_ptr,
    seq_lens_ptr,
    positions_ptr,
    num_tiles,
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
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_dtype = fp8_dot_dtype(q_ptr.dtype.element_ty) if KV_FP8 else k_ptr.dtype.element_ty
    score_scale = k_scale * LOG2E if KV_FP8 else LOG2E
    # before the wait: the tile table, positions, lengths and slot tables are laid out before the step's layers
    req = tl.load(tiles_ptr + tile)
    row_first = tl.load(tiles_ptr + num_tiles + tile)
    row_end = tl.load(tiles_ptr + 2 * num_tiles + tile)
    offs_m = tl.arange(0, BLOCK_M)
    rows = row_first + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    m_ok = (rows < row_end) & (offs_m < ROWS * GROUP)
    rows = rows.to(tl.int64)
    pos = tl.load(positions_ptr + rows, mask=m_ok, other=0)
    seq_len = tl.load(seq_lens_ptr + req)
    row_start, row_stop = row_kv_bounds(pos, seq_len, window, SLIDING)  # each row's own [start, end)
    # the tile's range: from its first row's start to its last row's end (nothing for a tile with no rows)
    pos_hi = tl.max(tl.where(m_ok, pos, -1))
    pos_lo = tl.min(tl.where(m_ok, pos, pos_hi))
    kv_start, _ = row_kv_bounds(pos_lo, seq_len, window, SLIDING)
    _, kv_end = row_kv_bounds(pos_hi, seq_len, window, SLIDING)
    split_len = kv_split_len(kv_start, kv_end, NUM_SPLITS, BLOCK_N)
    lo = kv_start + split * split_len
    hi = tl.minimum(lo + split_len, kv_end)
    req_to_token_row = req_to_token_ptr + tl.load(req_pool_ptr + req).to(tl.int64) * stride_req

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    slot = kv_slots(req_to_token_row, full_to_swa_ptr, lo + offs_n, lo + offs_n < hi, SLIDING)
    pdl_start(USE_PDL)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=m_ok[:, None], other=0.0
    )
    q = as_dot_operand(q, kv_dtype)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kv_pos = start + offs_n
        # K and V of this block, then the next block's slots: three loads in flight, none waiting on math
        k = tl.load(k_ptr + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]).to(kv_dtype)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]).to(kv_dtype)
        next_pos = kv_pos + BLOCK_N
        slot = kv_slots(req_to_token_row, full_to_swa_ptr, next_pos, next_pos < hi, SLIDING)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * score_scale
        seen = (kv_pos[None, :] >= row_start[:, None]) & (kv_pos[None, :] < row_stop[:, None])
        visible = (kv_pos < hi)[None, :] & seen
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet stays at zero
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    if NUM_SPLITS == 1:
        tl.store(
            o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=m_ok[:, None],
        )
    else:
        part = (rows * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=m_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=m_ok)


def verify_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa: torch.Tensor,
    tiles: torch.Tensor,
    rows_per_tile: int,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    sliding_window: int | None,
    num_splits: int,
    partials: tuple[torch.Tensor, torch.Tensor] | None,
    config: DecodeConfig,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write into `out` [rows, heads, head_dim] each row's attention over its request's KV up to its position.

    `tiles` comes from `build_extend_tiles(extend_seq_lens, rows, rows_per_tile)` (every row in one tile);
    requests are `req_pool_indices` / `seq_lens` (KV of every row of the step stored already); `partials`
    (`decode_partials`) is needed when num_splits > 1; `config`: decode's blocks for this head_dim.
    """
    _, num_heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    group = num_heads // kv_heads
    sliding = sliding_window is not None
    window = sliding_window or 0
    num_tiles = tiles.shape[1]
    part_o, part_lse = partials if num_splits > 1 else (out, out)
    launch = pdl_launch(q.device, _verify_split_kernel)
    _verify_split_kernel[(num_tiles, kv_heads, num_splits)](
        q, out, part_o, part_lse, k_buffer, v_buffer, req_to_token, full_to_swa, tiles, req_pool_indices, seq_lens,
        positions, num_tiles, window, num_heads, k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        GROUP=group,
        ROWS=rows_per_tile,
        BLOCK_M=max(16, triton.next_power_of_2(rows_per_tile * group)),
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
    )  # fmt: skip
    if num_splits > 1:  # every row's splits of its tile's range (the lengths are not read with all_splits)
        combine_splits(out, (part_o, part_lse), positions, positions, sliding_window, config.block_n, all_splits=True)
