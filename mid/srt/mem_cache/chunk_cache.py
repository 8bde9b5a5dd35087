"""`--disable-radix-cache`: the prefix-cache interface with nothing cached across requests.

Every match is empty, a finished request's slots go straight back to the allocator, and a chunked-prefill
request simply keeps the slots it has. Useful to measure what the radix cache buys, and as the simplest
correct cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from srt.mem_cache.allocator import SWATokenAllocator, TokenSlotAllocator
from srt.mem_cache.base_prefix_cache import (
    CacheHandle,
    CacheStats,
    MatchResult,
    PrefixCache,
    check_partition,
    check_swa_partition,
    full_pool_of,
)


class ChunkCache(PrefixCache):
    """A prefix cache that caches nothing; its only handle is an empty root every request locks."""

    def __init__(self, allocator: TokenSlotAllocator | SWATokenAllocator) -> None:
        self.allocator = allocator
        self._full = full_pool_of(allocator)
        self._empty = torch.empty(0, dtype=torch.int64, device=allocator.device)
        self.root = CacheHandle()
        self._locks = 0

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        return MatchResult(self._empty, self.root)

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor, swa_from: int | None = None) -> int:
        """Nothing is kept: the slots are freed at once and no token counts as already cached. With `swa_from`
        the sliding-window pool's share is known (tokens from there on hold a slot, those before hold none): the
        allocator frees it without reading a mask back, which on a GPU would wait for the step in flight."""
        if len(token_ids) != len(slots):
            raise ValueError(f"{len(token_ids)} tokens but {len(slots)} slots")
        slots = slots.to(torch.int64)
        if isinstance(self.allocator, SWATokenAllocator) and swa_from is not None:
            self.allocator.free(slots, swa_from)
        else:
            self.allocator.free(slots)
        return 0

    def lock(self, node: CacheHandle) -> None:
        self._check_root(node)
        self._locks += 1

    def unlock(self, node: CacheHandle) -> None:
        self._check_root(node)
        if self._locks <= 0:
            raise ValueError("unlock without a matching lock")
        self._locks -= 1

    def evict(self, num_tokens: int) -> int:
        return 0

    def cache_unfinished(
        self, token_ids: Sequence[int], slots: torch.Tensor, match: MatchResult, swa_from: int | None = None
    ) -> MatchResult:
        """Nothing is cached: the request keeps owning all its slots and its (empty) prefix stays as it is."""
        return match

    def stats(self) -> CacheStats:
        total, free = self._full.size, self._full.available()
        return CacheStats(total, free, 0, 0, total - free)

    def check_integrity(self, request_slots: torch.Tensor | None = None) -> None:
        self.allocator.check_integrity()
        if self._locks < 0:
            raise AssertionError(f"chunk cache holds {self._locks} locks")
        check_partition("full", self._full.size, self._full.free_slots(), self._empty, request_slots)
        if isinstance(self.allocator, SWATokenAllocator) and request_slots is not None:
            check_swa_partition(self.allocator, self._empty, request_slots)

    def _check_root(self, node: CacheHandle) -> None:
        if node is not self.root:
            raise ValueError(f"not a node of this chunk cache: {node!r}")
