"""RadixCache and ChunkCache on scripted scenarios: exact slot ids, exact eviction order, exact counts."""

from __future__ import annotations

import pytest
import torch

from srt.mem_cache.allocator import SWATokenAllocator, TokenSlotAllocator
from srt.mem_cache.base_prefix_cache import CacheStats
from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.radix_cache import COMPARE_BLOCK, RadixCache, common_prefix_len


def ids(t: torch.Tensor) -> list[int]:
    return t.tolist()


def new_cache(size: int = 16) -> tuple[TokenSlotAllocator, RadixCache]:
    alloc = TokenSlotAllocator(size)
    return alloc, RadixCache(alloc)


def test_insert_match_and_split() -> None:
    alloc, cache = new_cache()
    assert cache.insert([1, 2, 3, 4, 5], alloc.alloc(5)) == 0  # slots 1..5
    m = cache.match_prefix([1, 2, 3, 9])
    assert ids(m.slots) == [1, 2, 3] and m.prefix_len == 3
    assert m.node.key == (1, 2, 3)  # the edge [1 2 3 4 5] was split at the match end
    assert [c.key for c in m.node.children.values()] == [(4, 5)]
    assert ids(cache.match_prefix([1, 2, 3, 4, 5, 6]).slots) == [1, 2, 3, 4, 5]
    assert ids(cache.match_prefix([7]).slots) == [] and cache.match_prefix([7]).node is cache.root
    # A second branch under the split node: only the new token's slot is taken.
    assert cache.insert([1, 2, 3, 6], torch.cat([m.slots, alloc.alloc(1)])) == 3
    assert ids(cache.match_prefix([1, 2, 3, 6]).slots) == [1, 2, 3, 6]
    assert cache.stats() == CacheStats(total=16, free=10, cached=6, evictable=6, in_use=0)
    cache.check_integrity(request_slots=torch.tensor([], dtype=torch.int64))


def test_lock_protects_the_path_and_eviction_is_lru_over_unlocked_leaves() -> None:
    alloc, cache = new_cache()
    cache.insert([1, 1], alloc.alloc(2))  # slots 1 2
    cache.insert([2, 2], alloc.alloc(2))  # slots 3 4
    cache.insert([3, 3, 3], alloc.alloc(3))  # slots 5 6 7
    cache.match_prefix([1, 1])  # [1 1] is now the most recently used
    locked = cache.match_prefix([3, 3])  # splits [3 3 3] into [3 3] + [3]
    cache.lock(locked.node)
    assert cache.stats() == CacheStats(total=16, free=9, cached=7, evictable=5, in_use=0)
    # LRU order: [2 2] (untouched since insert), then the leaf [3] (its split-off head is locked), then [1 1].
    assert cache.evict(1) == 2
    assert ids(alloc.free_slots()[-2:]) == [3, 4]
    assert cache.evict(1) == 1
    assert ids(alloc.free_slots()[-1:]) == [7]
    assert cache.evict(100) == 2  # [1 1]; the locked [3 3] stays
    assert ids(alloc.free_slots()[-2:]) == [1, 2]
    assert ids(cache.match_prefix([3, 3, 3]).slots) == [5, 6]
    assert cache.stats() == CacheStats(total=16, free=14, cached=2, evictable=0, in_use=0)
    cache.unlock(locked.node)
    assert cache.evict(1) == 2 and cache.stats().cached == 0
    cache.check_integrity(request_slots=torch.tensor([], dtype=torch.int64))


def test_eviction_walks_up_to_parents_that_become_leaves() -> None:
    alloc, cache = new_cache()
    cache.insert([1, 2, 3], alloc.alloc(3))  # 1 2 3
    cache.insert([1, 2, 4], torch.cat([torch.tensor([1, 2]), alloc.alloc(1)]))  # leaf [4] -> slot 4
    cache.insert([5], alloc.alloc(1))  # slot 5, newest
    # Leaves [3] and [4] go first (oldest), then their parent [1 2] became an older leaf than [5].
    assert cache.evict(4) == 4
    assert ids(alloc.free_slots()[-4:]) == [3, 4, 1, 2]
    assert ids(cache.match_prefix([5]).slots) == [5]
    cache.check_integrity()


def test_lock_counts_nest_and_unlock_without_lock_is_an_error() -> None:
    alloc, cache = new_cache()
    cache.insert([1, 2], alloc.alloc(2))
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    cache.lock(node)
    cache.unlock(node)
    assert cache.evict(2) == 0 and cache.evictable() == 0
    cache.unlock(node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(node)
    assert cache.evict(2) == 2
    with pytest.raises(ValueError, match="no longer in the cache"):
        cache.lock(node)
    cache.check_integrity()


def test_request_lifecycle_frees_duplicates_of_a_concurrent_twin() -> None:
    alloc, cache = new_cache()
    a, b = cache.match_prefix([7, 8, 9]), cache.match_prefix([7, 8, 9])
    cache.lock(a.node)
    cache.lock(b.node)
    a_slots, b_slots = alloc.alloc(3), alloc.alloc(3)  # both compute the same prompt: 1 2 3 and 4 5 6
    cache.check_integrity(request_slots=torch.cat([a_slots, b_slots]))
    assert cache.in_use() == 6
    cache.cache_finished([7, 8, 9], a_slots, a)
    cache.cache_finished([7, 8, 9], b_slots, b)  # already cached: b's copies go back
    assert ids(alloc.free_slots()[-3:]) == [4, 5, 6]
    assert ids(cache.match_prefix([7, 8, 9]).slots) == [1, 2, 3]
    assert cache.stats() == CacheStats(total=16, free=13, cached=3, evictable=3, in_use=0)
    cache.check_integrity(request_slots=torch.tensor([], dtype=torch.int64))


def test_chunked_prefill_moves_the_lock_to_the_new_end() -> None:
    alloc, cache = new_cache()
    tokens = [1, 2, 3, 4, 5, 6]
    m = cache.match_prefix(tokens[:-1])
    cache.lock(m.node)
    row = alloc.alloc(3)  # chunk 1: tokens 1 2 3 in slots 1 2 3
    m = cache.cache_unfinished(tokens[:3], row, m)
    assert ids(m.slots) == [1, 2, 3] and m.node.key == (1, 2, 3) and m.node.lock_ref == 1
    assert cache.evict(10) == 0  # the running request's prefix is locked
    row = torch.cat([m.slots, alloc.alloc(3)])  # chunk 2: slots 4 5 6
    cache.check_integrity(request_slots=row[3:])
    cache.cache_finished(tokens, row, m)
    assert cache.stats() == CacheStats(total=16, free=10, cached=6, evictable=6, in_use=0)
    assert cache.evict(1) == 3  # one leaf [4 5 6]
    cache.check_integrity(request_slots=torch.tensor([], dtype=torch.int64))


def test_integrity_catches_lost_and_doubly_held_slots_and_bad_lock_counts() -> None:
    alloc, cache = new_cache(8)
    cache.insert([1, 2], alloc.alloc(2))
    held = alloc.alloc(2)  # slots 3 4, a running request's
    with pytest.raises(AssertionError, match=r"lost slots \[3, 4\]"):
        cache.check_integrity(request_slots=torch.tensor([], dtype=torch.int64))
    cache.check_integrity(request_slots=held)
    alloc.free(torch.tensor([1]))  # freed while the tree still holds it
    with pytest.raises(AssertionError, match=r"slots \[1\] are held twice"):
        cache.check_integrity()
    _, cache = new_cache(8)
    cache.insert([1, 2], cache.allocator.alloc(2))
    cache.match_prefix([1, 2]).node.lock_ref = 1
    with pytest.raises(AssertionError, match="lock_ref 1 != 0 locks"):
        cache.check_integrity()


def test_chunk_cache_caches_nothing() -> None:
    alloc = TokenSlotAllocator(8)
    cache = ChunkCache(alloc)
    m = cache.match_prefix([1, 2, 3])
    assert ids(m.slots) == [] and m.node is cache.root
    cache.lock(m.node)
    chunk = alloc.alloc(2)  # slots 1 2
    m = cache.cache_unfinished([1, 2], chunk, m)
    assert ids(m.slots) == [] and m.node is cache.root  # nothing cached: the request keeps owning 1 2
    row = torch.cat([chunk, alloc.alloc(1)])
    cache.check_integrity(request_slots=row)
    cache.cache_finished([1, 2, 3], row, m)
    assert ids(alloc.free_slots()[-3:]) == [1, 2, 3]
    assert ids(cache.match_prefix([1, 2, 3]).slots) == []
    assert cache.evict(5) == 0
    assert cache.stats() == CacheStats(total=8, free=8, cached=0, evictable=0, in_use=0)
    cache.check_integrity(request_slots=torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="without a matching lock"):
        cache.unlock(cache.root)


def test_release_drops_a_request_without_caching_it() -> None:
    alloc, cache = new_cache(8)
    cache.insert([1, 2], alloc.alloc(2))
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    row = torch.cat([m.slots, alloc.alloc(2)])  # slots 1 2 | 3 4
    cache.release(row, m)
    assert ids(alloc.free_slots()[-2:]) == [3, 4]
    assert ids(cache.match_prefix([1, 2, 3]).slots) == [1, 2] and cache.evictable() == 2
    cache.check_integrity(request_slots=torch.tensor([], dtype=torch.int64))


def test_chunk_cache_integrity_covers_the_swa_pool() -> None:
    alloc = SWATokenAllocator(full_size=8, swa_size=8)
    cache = ChunkCache(alloc)
    row = alloc.alloc(3)  # full 1 2 3 -> SWA 1 2 3, held by a running request
    cache.check_integrity(request_slots=row)
    alloc.swa.alloc(1)  # SWA slot 4 handed out and never mapped: lost
    alloc.swa.free(alloc.translate(row[:1]))  # SWA slot 1 freed while full slot 1 still maps to it
    alloc.check_integrity()  # the allocator's own counts still add up
    with pytest.raises(AssertionError, match=r"swa pool: slots \[1\] are held twice"):
        cache.check_integrity(request_slots=row)


def test_common_prefix_len_finds_the_first_difference_across_compare_blocks() -> None:
    """Compared a block at a time: the first differing token, wherever it falls (inside, at and across block
    edges, past the shorter side), as an element-by-element scan finds it."""
    key = tuple(range(3 * COMPARE_BLOCK + 5))
    for start in (0, 3):
        tokens = [-1] * start + list(key)
        for at in (0, 1, COMPARE_BLOCK - 1, COMPARE_BLOCK, COMPARE_BLOCK + 1, 2 * COMPARE_BLOCK, len(key) - 1):
            changed = tokens.copy()
            changed[start + at] = -2
            assert common_prefix_len(key, changed, start) == at
        assert common_prefix_len(key, tokens, start) == len(key)
        assert common_prefix_len(key, tokens[: start + 10], start) == 10
        assert common_prefix_len(key[:7], tokens, start) == 7
