"""Free the sliding-window KV of tokens that no future query of their request can see.

A query at position p with window W reads positions p-W+1 .. p (Hugging Face's bound: kv > q - W). After a
step the request has KV for positions 0 .. seq_len-1 and its next query sits at position seq_len, so every
position <= seq_len - W is out of every window for good. Example, W = 4, seq_len = 10:

    position   0   1   2 | 3   4   5   6 | 7   8   9 | 10
    SWA KV     c   c   c | x   x   x   x | k   k   k | next query: reads 7 8 9 10
                         ^ freed_upto    ^ returned: seq_len - W + 1
    c = prefix cache's (not freed here), x = freed now, k = kept (the W-1 tokens the next query reads)

The cache's slots (positions < prefix_len) are not the request's to free: the prefix cache tombstones them on
its own when SWA memory runs short, so the scheduler starts `freed_upto` at the request's prefix length.
"""

from __future__ import annotations

import torch

from srt.mem_cache.allocator import SWATokenAllocator


def out_of_window_upto(freed_upto: int, seq_len: int, window: int) -> int:
    """Where freeing stops: positions below max(freed_upto, seq_len - W + 1) are out of every window."""
    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}")
    if not 0 <= freed_upto <= seq_len:
        raise ValueError(f"need 0 <= freed_upto ({freed_upto}) <= seq_len ({seq_len})")
    return max(freed_upto, seq_len - window + 1)


def free_out_of_window(
    allocator: SWATokenAllocator, req_row: torch.Tensor, freed_upto: int, seq_len: int, window: int
) -> int:
    """Free SWA slots of positions freed_upto .. seq_len-W of one request; returns the new `freed_upto`.

    `req_row` is the request's req_to_token row; `seq_len` counts the tokens whose KV is in the pool (the
    next query is at position seq_len); `freed_upto` is where the previous call stopped (positions below it
    were freed already, or belong to the prefix cache). Calling it again with the same seq_len frees nothing.
    The scheduler frees a whole decode batch at once with `out_of_window_upto` and one `free_swa`.
    """
    if seq_len > len(req_row):
        raise ValueError(f"seq_len ({seq_len}) is longer than the request row ({len(req_row)})")
    new_freed_upto = out_of_window_upto(freed_upto, seq_len, window)
    if new_freed_upto > freed_upto:
        allocator.free_swa(req_row[freed_upto:new_freed_upto].to(torch.int64))
    return new_freed_upto
