"""SWARadixCache on scripted scenarios: tombstones, the match-end rule, window locks, SWA eviction, revival.

Window W = 4 throughout: a query at position p reads p-3 .. p, so a prefix of length e is usable only if
positions e-3 .. e-1 (all of them when e < 4) still have SWA KV.
"""

from __future__ import annotations

import pytest
import torch

from srt.mem_cache.allocator import SWATokenAllocator
from srt.mem_cache.base_prefix_cache import CacheStats
from srt.mem_cache.swa_radix_cache import SWARadixCache
from srt.mem_cache.swa_window import free_out_of_window

W = 4
T = list(range(100, 110))
NONE = torch.tensor([], dtype=torch.int64)


def ids(t: torch.Tensor) -> list[int]:
    return t.tolist()


def keys(cache: SWARadixCache, tokens: list[int]) -> list[tuple[tuple[int, ...], bool]]:
    """(key, tombstone) of the nodes along `tokens`, without touching the tree."""
    out, node, pos = [], cache.root, 0
    while pos < len(tokens) and tokens[pos] in node.children:
        node = node.children[tokens[pos]]
        out.append((node.key, node.tombstone))
        pos += len(node)
    return out


def cache_with_tombstoned_request() -> tuple[SWATokenAllocator, SWARadixCache]:
    """A finished request of T (10 tokens, slots 1..10) that freed SWA of positions 0..6 while running.

    position   0   1   2   3   4   5   6 | 7   8   9
    tree       [ tombstone: slots 1..7  ]|[ live: 8 9 10 ]
    """
    alloc = SWATokenAllocator(full_size=32, swa_size=32)
    cache = SWARadixCache(alloc, sliding_window=W)
    row = alloc.alloc(10)
    assert free_out_of_window(alloc, row, 0, 10, W) == 7
    assert cache.insert(T, row) == 0
    return alloc, cache


def test_insert_splits_a_request_into_tombstone_and_live_runs() -> None:
    alloc, cache = cache_with_tombstoned_request()
    assert keys(cache, T) == [(tuple(T[:7]), True), (tuple(T[7:]), False)]
    assert cache.stats() == CacheStats(total=32, free=22, cached=10, evictable=10, in_use=0)
    assert cache.swa_stats() == CacheStats(total=32, free=29, cached=3, evictable=3, in_use=0)
    cache.check_integrity(request_slots=NONE)


def test_match_ends_only_where_the_window_before_it_has_swa_kv() -> None:
    alloc, cache = cache_with_tombstoned_request()
    # End 10: positions 7 8 9 are live -> the whole prefix is usable (full layers read 0..6 from the full pool).
    assert ids(cache.match_prefix(T + [1]).slots) == list(range(1, 11))
    # End 9: only 7 8 are live after the tombstone; the tombstone starts at 0 -> nothing is usable.
    assert ids(cache.match_prefix(T[:9] + [1]).slots) == []
    assert ids(cache.match_prefix(T[:5]).slots) == []
    # The same prefix without the SWA rule, as full-attention layers alone could reuse it:
    assert ids(cache.lookup(T[:9]).slots) == list(range(1, 10))
    cache.check_integrity(request_slots=NONE)


def test_match_falls_back_to_the_last_valid_end_before_a_tombstone() -> None:
    alloc = SWATokenAllocator(full_size=32, swa_size=32)
    cache = SWARadixCache(alloc, sliding_window=W)
    u = list(range(200, 209))
    row = alloc.alloc(9)  # slots 1..9
    alloc.free_swa(row[5:7])  # positions 5 6: live(5) tombstone(2) live(2)
    cache.insert(u, row)
    assert keys(cache, u) == [(tuple(u[:5]), False), (tuple(u[5:7]), True), (tuple(u[7:]), False)]
    m = cache.match_prefix(u + [209])
    assert ids(m.slots) == [1, 2, 3, 4, 5] and m.node.key == tuple(u[:5])
    # A request extends it: it computes positions 5..9 itself (slots 10..14) and finishes.
    cache.lock(m.node)
    row = torch.cat([m.slots, alloc.alloc(5)])
    cache.check_integrity(request_slots=row[5:])
    cache.cache_finished(u + [209], row, m)
    # The tombstone [205 206] was revived with the request's SWA KV; its duplicate full slots 10..13 went back.
    # (The request's lock had split [200..204] to pin its window [202 203 204].)
    assert keys(cache, u + [209]) == [
        (tuple(u[:2]), False),
        (tuple(u[2:5]), False),
        (tuple(u[5:7]), False),
        (tuple(u[7:]), False),
        ((209,), False),
    ]
    assert ids(alloc.full.free_slots()[-4:]) == [10, 11, 12, 13]
    assert ids(cache.match_prefix(u + [209, 0]).slots) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 14]
    cache.check_integrity(request_slots=NONE)


def test_lock_pins_only_the_window_and_swa_eviction_tombstones_the_rest() -> None:
    alloc = SWATokenAllocator(full_size=32, swa_size=32)
    cache = SWARadixCache(alloc, sliding_window=W)
    a = list(range(1, 9))
    cache.insert(a, alloc.alloc(8))  # slots 1..8, all live
    m = cache.match_prefix(a + [50])
    cache.lock(m.node)  # full lock on all 8 tokens; SWA lock on the last 3 -> [1..8] split into [1..5] [6 7 8]
    assert keys(cache, a) == [((1, 2, 3, 4, 5), False), ((6, 7, 8), False)]
    assert cache.swa_stats() == CacheStats(total=32, free=24, cached=8, evictable=5, in_use=0)
    assert cache.evict(100) == 0  # everything is locked for full attention
    assert cache.evict_swa(1) == 5  # [1..5] becomes a tombstone under the running request
    assert keys(cache, a) == [((1, 2, 3, 4, 5), True), ((6, 7, 8), False)]
    assert ids(alloc.swa.free_slots()[-5:]) == [1, 2, 3, 4, 5]
    assert cache.evict_swa(1) == 0  # the window is pinned
    assert ids(cache.match_prefix(a + [50]).slots) == list(range(1, 9))  # still usable: 6 7 8 live
    assert ids(cache.match_prefix(a[:7] + [50]).slots) == []  # splits [6 7] off; only 2 live tokens
    cache.unlock(m.node)
    cache.check_integrity(request_slots=NONE)
    # LRU: leaf [8] (untouched by the last match) goes first, entirely; then [6 7], then the tombstone parent
    # [1..5] that became an unlocked leaf is dropped with it (a tombstone leaf can never end a match).
    assert cache.evict_swa(100) == 3
    assert ids(alloc.full.free_slots()[-8:]) == [8, 6, 7, 1, 2, 3, 4, 5]
    assert cache.stats().cached == 0 and cache.swa_stats().cached == 0
    cache.check_integrity(request_slots=NONE)


def test_chunked_prefill_revives_the_tombstone_inside_its_window() -> None:
    alloc, cache = cache_with_tombstoned_request()
    m = cache.match_prefix(T[:9])  # only 2 live tokens after the tombstone: no usable prefix
    assert m.prefix_len == 0
    cache.lock(m.node)
    row = alloc.alloc(9)  # chunk 1: T[0..8] computed again in slots 11..19
    freed_upto = free_out_of_window(alloc, row, m.prefix_len, 9, W)
    assert freed_upto == 6
    m = cache.cache_unfinished(T[:9], row, m)
    # The tree keeps its own slots 1..9; position 6 takes over the request's live SWA slot, so the window of
    # the next query (positions 6 7 8) has SWA KV and the lock succeeds.
    assert ids(m.slots) == list(range(1, 10))
    assert keys(cache, T) == [(tuple(T[:6]), True), ((T[6],), False), ((T[7], T[8]), False), ((T[9],), False)]
    assert bool((alloc.translate(m.slots[6:]) != 0).all())
    assert ids(alloc.full.free_slots()[-9:]) == list(range(11, 20))
    cache.check_integrity(request_slots=NONE)
    row = torch.cat([m.slots, alloc.alloc(1)])  # chunk 2: one more token
    cache.check_integrity(request_slots=row[9:])
    cache.cache_finished(T[:9] + [500], row, m)
    cache.check_integrity(request_slots=NONE)


def test_lock_refuses_a_prefix_whose_window_is_tombstoned() -> None:
    alloc, cache = cache_with_tombstoned_request()
    node = cache.lookup(T[:8]).node  # ends after [107]: window 105 106 107 has two tombstoned tokens
    with pytest.raises(ValueError, match="lack SWA KV"):
        cache.lock(node)
    cache.check_integrity(request_slots=NONE)  # nothing half-locked


def test_integrity_catches_an_swa_slot_both_free_and_cached() -> None:
    alloc, cache = cache_with_tombstoned_request()  # live tokens: full slots 8 9 10 -> SWA 8 9 10
    alloc.swa.alloc(1)  # SWA slot 11 handed out and never mapped: lost
    alloc.swa.free(alloc.translate(torch.tensor([8])))  # SWA slot 8 freed while the tree still maps it
    alloc.check_integrity()  # the allocator's own counts still add up
    with pytest.raises(AssertionError, match=r"swa pool: slots \[8\] are held twice"):
        cache.check_integrity(request_slots=NONE)
