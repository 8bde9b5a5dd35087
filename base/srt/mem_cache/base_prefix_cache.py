"""The prefix-cache interface the scheduler programs against.

Three implementations: `RadixCache` (token-level radix tree over full-pool slots), `SWARadixCache` (the same
tree, aware that sliding-window KV of old tokens may be gone) and `ChunkCache` (`--disable-radix-cache`:
caches nothing across requests).

Ownership of a request's full-pool slots, as a request row reads them:

    req_to_token[row]:  [ 0 .......... prefix_len | prefix_len ........... kv_len ]
                          owned by the cache          owned by the request
                          (kept alive by lock(node))  (allocated by the scheduler)

Contracts (the scheduler is the caller; `cache` is any PrefixCache):

- Admission: `m = cache.match_prefix(ids[:-1])` (leave at least one token to compute: its logits are
  needed), `cache.lock(m.node)`, allocate slots for the rest, write `m.slots` + the new slots to the row.
  With an SWA allocator the request's SWA-freeing cursor starts at `m.prefix_len` (the cache owns the rest).
- Chunked prefill, after each chunk: `m = cache.cache_unfinished(ids[:kv_len], row[:kv_len], m)`, then
  write `m.slots` over row[:m.prefix_len] (duplicate slots were replaced by the cache's own), keep `m`, and
  move the SWA-freeing cursor up to `m.prefix_len`.
- Finish, abort or retract: `cache.cache_finished(ids[:kv_len], row[:kv_len], m)` keeps the computed KV
  for later requests; `cache.release(row[:kv_len], m)` drops it instead. Then free any slot allocated beyond
  kv_len (a token sampled but never run) and the request row. Afterwards the request owns nothing.
- Memory short: `cache.evict(n)` frees at least n full-pool slots if that many are evictable; retract
  requests when it cannot.

Only tokens whose KV is written may be inserted: `len(token_ids) == len(slots)` everywhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import torch

from srt.mem_cache.allocator import SWATokenAllocator, TokenSlotAllocator


class CacheHandle:
    """What a match hands out to lock and unlock the prefix it found: opaque to callers, each cache's own node
    (the radix tree's `TreeNode` subclasses it)."""

    __slots__ = ()


class MatchResult(NamedTuple):
    """A cached prefix: its full-pool slots and the handle that ends it (to lock / unlock)."""

    slots: torch.Tensor  # int64, one full-pool slot per matched token
    node: CacheHandle

    @property
    def prefix_len(self) -> int:
        return len(self.slots)


class CacheStats(NamedTuple):
    """Full-pool token counts. free + cached + in_use == total; evictable <= cached."""

    total: int  # slots in the pool (padding slot 0 excluded)
    free: int  # on the allocator's free list
    cached: int  # held by the cache (locked or not)
    evictable: int  # cached and locked by no request
    in_use: int  # held by requests and not (yet) by the cache


class PrefixCache(ABC):
    """A cache of KV for token prefixes, sharing full-pool slots between requests."""

    allocator: TokenSlotAllocator | SWATokenAllocator

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """The longest usable cached prefix of `token_ids`. Marks it recently used; locks nothing."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor, swa_from: int | None = None) -> int:
        """Hand the KV of `token_ids` (in `slots`) to the cache.

        Returns n, how many leading tokens were already cached. The cache keeps its own slots for those, so
        the caller frees its duplicates: `slots[prefix_len:n]`, where prefix_len is the length of the prefix
        the caller holds locked (those slots are the cache's own). The cache owns `slots[n:]` from now on.

        `swa_from` (a request's `swa_freed_upto`, >= prefix_len): its tokens from there on hold an SWA slot and
        those before hold none, so a cache that tracks SWA KV need not read the mapping back from the device (a
        read that waits for any step in flight). The duplicates' SWA slots are then freed here: the caller frees
        only their full slots (`_free_duplicates(..., swa_freed=True)`).
        """

    @abstractmethod
    def lock(self, node: CacheHandle) -> None:
        """Protect `node` and its ancestors from eviction (one lock per running request)."""

    @abstractmethod
    def unlock(self, node: CacheHandle) -> None:
        """Undo one `lock(node)`; raises ValueError if `node` is not locked."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` full-pool slots of unlocked leaves, least recently used first.

        Whole nodes are evicted, so the count returned may exceed `num_tokens`; it is smaller only when
        nothing more is evictable.
        """

    def evict_swa(self, num_tokens: int) -> int:
        """Free at least `num_tokens` sliding-window slots if that many are evictable; returns how many.

        Caches that hold no sliding-window KV of their own free none.
        """
        return 0

    def swa_stats(self) -> CacheStats:
        """Token counts of the sliding-window pool; here for caches that hold none of it themselves."""
        if not isinstance(self.allocator, SWATokenAllocator):
            raise ValueError("this cache's allocator has no sliding-window pool")
        swa = self.allocator.swa
        return CacheStats(swa.size, swa.available(), 0, 0, swa.size - swa.available())

    @abstractmethod
    def stats(self) -> CacheStats:
        """Token counts of the full pool."""

    @abstractmethod
    def check_integrity(self, request_slots: torch.Tensor | None = None) -> None:
        """Raise AssertionError unless every internal mapping and count is consistent.

        `request_slots`: the full-pool slots running requests hold outside the cache. When given, free +
        cached + requests must be exactly the pool: no slot lost, none held twice.
        """

    @abstractmethod
    def cache_unfinished(
        self, token_ids: Sequence[int], slots: torch.Tensor, match: MatchResult, swa_from: int | None = None
    ) -> MatchResult:
        """Cache a running request's tokens so far and move its lock from `match.node` to the new end.

        Returns the request's new cached prefix (locked): the caller writes its slots over
        row[:prefix_len] and keeps the result for the next call. `swa_from`: as in `insert`.
        """

    def cache_finished(
        self, token_ids: Sequence[int], slots: torch.Tensor, match: MatchResult, swa_from: int | None = None
    ) -> None:
        """Cache a request that finished (or was aborted / retracted) and drop its lock. `swa_from`: where the
        request's tokens that still hold SWA slots start (`Req.swa_freed_upto`), for a cache that frees them."""
        already_cached = self.insert(token_ids, slots, swa_from)
        self._free_duplicates(slots, match.prefix_len, already_cached, swa_freed=swa_from is not None)
        self.unlock(match.node)

    def release(self, slots: torch.Tensor, match: MatchResult) -> None:
        """Drop a request without caching anything: free the slots it owns and its lock."""
        self._free_duplicates(slots, match.prefix_len, len(slots))
        self.unlock(match.node)

    def total(self) -> int:
        return self.stats().total

    def cached(self) -> int:
        return self.stats().cached

    def evictable(self) -> int:
        return self.stats().evictable

    def in_use(self) -> int:
        return self.stats().in_use

    def _free_duplicates(self, slots: torch.Tensor, start: int, end: int, swa_freed: bool = False) -> None:
        """Return slots[start:end] (a request's copies of tokens the cache already had) to the allocator;
        `swa_freed`: `insert` freed their SWA slots already (it was given `swa_from`)."""
        if end > start:
            allocator = self.allocator
            if swa_freed and isinstance(allocator, SWATokenAllocator):
                allocator.full.free(slots[start:end])
            else:
                allocator.free(slots[start:end])


def full_pool_of(allocator: TokenSlotAllocator | SWATokenAllocator) -> TokenSlotAllocator:
    """The allocator of full-pool slots (the one prefix caches index by)."""
    return allocator.full if isinstance(allocator, SWATokenAllocator) else allocator


def check_partition(
    name: str, size: int, free: torch.Tensor, cached: torch.Tensor, in_use: torch.Tensor | None
) -> None:
    """Assert free, cached and (when given) in-use slots are disjoint subsets of 1..size covering it all."""
    parts = [("free", free), ("cached", cached)] + ([("in use", in_use)] if in_use is not None else [])
    # counted on the free list's device: a GPU pool of a million slots checks in milliseconds there
    seen = torch.zeros(size + 1, dtype=torch.int64, device=free.device)
    for label, slots in parts:
        slots = slots.to(free.device, torch.int64)
        if len(slots) and (int(slots.min()) < 1 or int(slots.max()) > size):
            raise AssertionError(f"{name} pool: a {label} slot is outside 1..{size}")
        seen.index_add_(0, slots, torch.ones_like(slots))
    twice = torch.nonzero(seen > 1).flatten().tolist()
    if twice:
        raise AssertionError(f"{name} pool: slots {twice[:8]} are held twice (free / cached / in use)")
    counts = " + ".join(f"{len(slots)} {label}" for label, slots in parts)
    if in_use is not None and int(seen.sum()) != size:
        lost = torch.nonzero(seen[1:] == 0).flatten().add(1).tolist()
        raise AssertionError(f"{name} pool: {counts} != {size} total; lost slots {lost[:8]}")
    if int(seen.sum()) > size:
        raise AssertionError(f"{name} pool: {counts} > {size} total")


def check_swa_partition(
    allocator: SWATokenAllocator, cached_full_slots: torch.Tensor, request_slots: torch.Tensor | None
) -> None:
    """`check_partition` of the SWA pool: free, the SWA slots of cached live tokens, those of requests' tokens."""
    to_swa = allocator.full_to_swa
    request_swa = None
    if request_slots is not None:
        request_swa = to_swa[request_slots.to(torch.int64)]
        request_swa = request_swa[request_swa != 0]
    swa = allocator.swa
    check_partition("swa", swa.size, swa.free_slots(), to_swa[cached_full_slots], request_swa)
