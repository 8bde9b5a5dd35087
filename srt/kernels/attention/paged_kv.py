"""Helpers shared by the extend and decode kernels: which KV positions a query row sees, and where they live.

A query row at position p of a request with seq_len tokens of KV sees kv positions

    full layer:     0 .. min(p, seq_len - 1)
    sliding layer:  max(0, p - window + 1) .. min(p, seq_len - 1)      (HF's inclusive bound: kv > p - window)

KV of position j of the request sits in buffer row `req_to_token[pool_row, j]` of a full layer, and in row
`full_to_swa[req_to_token[pool_row, j]]` of a sliding layer (0, the padding slot, once the token left every
window: such rows are masked, never used).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def kv_slots(req_to_token_row, full_to_swa_ptr, kv_pos, kv_ok, SLIDING: tl.constexpr):
    """Buffer rows (int64) of kv positions `kv_pos` of one request; 0 where `kv_ok` is false (None: all ok)."""
    if kv_ok is None:
        slot = tl.load(req_to_token_row + kv_pos).to(tl.int64)
    else:
        slot = tl.load(req_to_token_row + kv_pos, mask=kv_ok, other=0).to(tl.int64)
    if SLIDING:
        slot = tl.load(full_to_swa_ptr + slot).to(tl.int64)  # masked positions have slot 0, a valid index
    return slot


@triton.jit
def row_kv_bounds(pos, seq_len, window, SLIDING: tl.constexpr):
    """[start, end) of the kv positions a query row at `pos` sees (empty when end <= start)."""
    end = tl.minimum(pos + 1, seq_len)
    if SLIDING:
        start = tl.maximum(pos - window + 1, 0)
    else:
        start = pos * 0
    return start, end


@triton.constexpr_function
def fp8_kv_dot_dtype(q_dtype: tl.dtype) -> tl.dtype:
    """The dtype FP8 K/V blocks widen to for the dot products with a `q_dtype` query: float16 for a 16-bit
    query, float32 for a float32 one. sm90 widens e4m3 pairs to float16 in one instruction, and to bfloat16
    only through float16 and then one scalar F2F per element (256 a thread per 64-token block of head_dim 256
    in the decode kernel; H100, FP8 weights + KV, batch 32: E4B 4.50 -> 4.45 ms/step, 26B-A4B 13.20 -> 13.02).
    Every e4m3 value is exact in float16, and so is a bf16 query within float16's normal range (`dot_query`
    saturates it beyond)."""
    return tl.float32 if q_dtype == tl.float32 else tl.float16


@triton.jit
def dot_query(q, DOT_DTYPE: tl.constexpr):
    """The query as the dot products' operand: float16 saturates at its largest finite value instead of
    overflowing to inf (a normed query is orders of magnitude below it)."""
    if DOT_DTYPE == tl.float16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0)
    return q.to(DOT_DTYPE)


def dot_precision(dtype_is_fp32: bool) -> str:
    """fp32 inputs get exact fp32 products (the reference checks at 1e-4); others the tensor-core path."""
    return "ieee" if dtype_is_fp32 else "tf32"
