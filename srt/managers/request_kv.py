"""What a running request's KV does between steps: prompt KV handed to the cache, sliding-window KV freed once no
query can see it, everything handed back when the request leaves, and room made by evicting the cache.

The scheduler decides when; these functions keep the pools, the request's `req_to_token` row and the prefix
cache consistent (`Scheduler.check_integrity`).
"""

from __future__ import annotations

import torch

from srt.forward.host_device import host_to_device
from srt.managers.schedule_batch import Req
from srt.mem_cache.allocator import SWATokenAllocator
from srt.mem_cache.base_prefix_cache import PrefixCache
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.mem_cache.swa_window import out_of_window_upto


def cache_prefill(req: Req, req_to_token_pool: ReqToTokenPool, cache: PrefixCache) -> None:
    """After a prefill forward: the request's tokens so far go to the cache; it keeps them locked."""
    row = req_to_token_pool.req_to_token[req.req_pool_idx]
    req.prefix = cache.cache_unfinished(req.cache_tokens(req.kv_len), row[: req.kv_len].long(), req.prefix)
    req_to_token_pool.write(req.req_pool_idx, 0, req.prefix.slots)
    req.swa_freed_upto = max(req.swa_freed_upto, req.prefix.prefix_len)


def free_windows(reqs: list[Req], req_to_token_pool: ReqToTokenPool, allocator: SWATokenAllocator, window: int) -> None:
    """Free the sliding-window KV the requests' next queries can no longer see: one gather, one free, and
    nothing read back (the positions are the requests' own from `swa_freed_upto` on: each holds an SWA slot)."""
    rows, positions = [], []
    for req in reqs:
        new_upto = out_of_window_upto(req.swa_freed_upto, req.kv_len, window)
        rows += [req.req_pool_idx] * (new_upto - req.swa_freed_upto)
        positions += range(req.swa_freed_upto, new_upto)
        req.swa_freed_upto = new_upto
    if positions:
        table = req_to_token_pool.req_to_token
        index = host_to_device([rows, positions], table.device)
        allocator.free_swa(table[index[0], index[1]].to(torch.int64), all_hold_swa=True)


def release(req: Req, req_to_token_pool: ReqToTokenPool, cache: PrefixCache) -> None:
    """Hand the request's KV to the cache and free its row; afterwards it holds nothing."""
    row = req_to_token_pool.req_to_token[req.req_pool_idx]
    cache.cache_finished(req.cache_tokens(req.kv_len), row[: req.kv_len].long(), req.prefix)
    req_to_token_pool.free(req.req_pool_idx)
    req.req_pool_idx, req.prefix, req.kv_len, req.swa_freed_upto = None, None, 0, 0


def make_room(num_tokens: int, allocator: SWATokenAllocator, cache: PrefixCache) -> bool:
    """Ensure `num_tokens` slots can be allocated, evicting unlocked cache entries if needed."""
    full_short = num_tokens - allocator.full.available()
    if full_short > 0:
        cache.evict(full_short)
    swa_short = num_tokens - allocator.swa.available()
    if swa_short > 0:
        cache.evict_swa(swa_short)  # tombstones cached prompts' sliding-window KV, LRU first
    return allocator.available() >= num_tokens
