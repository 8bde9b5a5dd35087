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


def dot_precision(dtype_is_fp32: bool) -> str:
    """fp32 inputs get exact fp32 products (the reference checks at 1e-4); others the tensor-core path."""
    return "ieee" if dtype_is_fp32 else "tf32"
