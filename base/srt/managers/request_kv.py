"""What a running request's KV does between steps: prompt KV handed to the cache, sliding-window KV freed once no
query can see it, everything handed back when the request leaves, and room made by evicting the cache.

The scheduler decides when; these functions keep the pools, the request's `req_to_token` row and the prefix
cache consistent (`Scheduler.check_integrity`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from srt.forward.host_device import fill_at, host_to_device
from srt.managers.schedule_batch import Req
from srt.mem_cache.allocator import SWATokenAllocator
from srt.mem_cache.base_prefix_cache import PrefixCache
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.mem_cache.swa_window import out_of_window_upto


def cache_prefill(req: Req, req_to_token_pool: ReqToTokenPool, cache: PrefixCache) -> None:
    """After a prefill forward: the request's tokens so far go to the cache; it keeps them locked."""
    row = req_to_token_pool.req_to_token[req.req_pool_idx]
    tokens, slots = req.cache_tokens(req.kv_len), row[: req.kv_len].long()
    req.prefix = cache.cache_unfinished(tokens, slots, req.prefix, req.swa_freed_upto)
    req_to_token_pool.write(req.req_pool_idx, 0, req.prefix.slots)
    req.swa_freed_upto = max(req.swa_freed_upto, req.prefix.prefix_len)


@dataclass
class TokenPositions:
    """Entries of `req_to_token` (request row, token position) as two host lists, for one gather."""

    rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def add(self, row: int, start: int, stop: int) -> None:
        """Positions start .. stop - 1 of the request at `row`."""
        self.rows += [row] * (stop - start)
        self.positions += range(start, stop)


def out_of_window(reqs: list[Req], window: int) -> TokenPositions:
    """The positions whose sliding-window KV the requests' next queries can no longer see (the requests' own from
    `swa_freed_upto` on: each holds an SWA slot); moves each `swa_freed_upto` past them. `free_kv` frees them."""
    freed = TokenPositions()
    for req in reqs:
        new_upto = out_of_window_upto(req.swa_freed_upto, req.kv_len, window)
        freed.add(req.req_pool_idx, req.swa_freed_upto, new_upto)
        req.swa_freed_upto = new_upto
    return freed


def free_kv(
    given_back: TokenPositions,
    swa_only: TokenPositions,
    req_to_token_pool: ReqToTokenPool,
    allocator: SWATokenAllocator,
) -> torch.Tensor:
    """Free the full and SWA slots of `given_back` (their `req_to_token` entries back to 0, the padding slot) and
    the SWA slots of `swa_only` (their full slots stay), every one holding an SWA slot: one copy, one gather,
    nothing read back. Returns the full slots given back."""
    table = req_to_token_pool.req_to_token
    rows, positions = given_back.rows + swa_only.rows, given_back.positions + swa_only.positions
    if not rows:
        return torch.empty(0, dtype=torch.int64, device=table.device)
    row_index, position_index = host_to_device([rows, positions], table.device)
    slots = table[row_index, position_index].to(torch.int64)  # a copy: the given-back entries are zeroed below
    whole = len(given_back.rows)
    allocator.free_whole_and_swa(slots, whole)
    if whole:
        fill_at(table, (row_index[:whole], position_index[:whole]), 0)
    return slots[:whole]


def release(req: Req, req_to_token_pool: ReqToTokenPool, cache: PrefixCache) -> None:
    """Hand the request's KV to the cache and free its row; afterwards it holds nothing."""
    row = req_to_token_pool.req_to_token[req.req_pool_idx]
    cache.cache_finished(req.cache_tokens(req.kv_len), row[: req.kv_len].long(), req.prefix, req.swa_freed_upto)
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
