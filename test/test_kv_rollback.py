"""KV rollback (`managers/kv_rollback.py`): a request gives back its last tokens' KV, checked with exact slot ids.

Window W = 4; allocators hand out slots from the front of their free lists and take freed ones at the back,
so every slot id below is known. `check_integrity` (the cache's, with the request's own slots, and the
allocators') holds after every scenario.
"""

from __future__ import annotations

import pytest
import torch

from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.kv_rollback import give_back_kv
from srt.managers.schedule_batch import Req
from srt.mem_cache.allocator import SWATokenAllocator
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.mem_cache.swa_radix_cache import SWARadixCache
from srt.mem_cache.swa_window import out_of_window_upto
from srt.sampling.sampling_params import SamplingParams

W = 4
PROMPT = list(range(100, 110))


class Pools:
    def __init__(self) -> None:
        self.allocator = SWATokenAllocator(full_size=24, swa_size=24)
        self.req_to_token = ReqToTokenPool(max_requests=2, max_context=32)
        self.cache = SWARadixCache(self.allocator, sliding_window=W)

    def admit(self, tokens: list[int], computed: int) -> Req:
        """A running request with KV for its first `computed` tokens: the cached prefix, then its own slots."""
        req = Req.from_request(TokenizedGenerateReq("r", tokens, SamplingParams(max_new_tokens=4)), torch.device("cpu"))
        match = self.cache.match_prefix(tokens[: computed - 1])
        self.cache.lock(match.node)
        req.req_pool_idx = self.req_to_token.alloc()
        own = self.allocator.alloc(computed - match.prefix_len)
        self.req_to_token.write(req.req_pool_idx, 0, torch.cat([match.slots, own]))
        req.prefix, req.kv_len, req.swa_freed_upto = match, computed, match.prefix_len
        return req

    def row(self, req: Req) -> list[int]:
        return self.req_to_token.req_to_token[req.req_pool_idx, : req.kv_len + 2].tolist()

    def check(self, req: Req) -> None:
        own = self.req_to_token.req_to_token[req.req_pool_idx, req.prefix.prefix_len : req.kv_len].long()
        self.cache.check_integrity(own)
        self.req_to_token.check_integrity()


def test_gives_back_full_and_swa_slots_and_the_row_entries() -> None:
    pools = Pools()
    req = pools.admit(PROMPT, computed=10)  # full slots 1..10, SWA slots 1..10
    given = give_back_kv(req, 3, pools.req_to_token, pools.allocator, W)
    assert given.tolist() == [8, 9, 10] and req.kv_len == 7
    assert pools.row(req) == [1, 2, 3, 4, 5, 6, 7, 0, 0]
    assert pools.allocator.full.free_slots().tolist()[-3:] == [8, 9, 10]
    assert pools.allocator.swa.free_slots().tolist()[-3:] == [8, 9, 10]
    assert pools.allocator.full_to_swa[7:12].tolist() == [7, 0, 0, 0, 0]  # slot 11 was never handed out
    pools.check(req)
    # the freed slots are handed out again, last: the next 14 + 3 allocations end with them
    assert pools.allocator.alloc(17).tolist()[-3:] == [8, 9, 10]


def test_at_the_window_boundary_only_kv_the_next_query_still_has_can_go() -> None:
    """kv_len 10, W 4. With the cursor where the scheduler leaves it (positions 0..6 freed, 7 8 9 kept), giving
    back even one token would put the next query at 9, reading 6..9: position 6 has no SWA KV. With the cursor
    one behind (0..5 freed), one token can go; two cannot."""
    pools = Pools()
    req = pools.admit(PROMPT, computed=10)
    row = pools.req_to_token.req_to_token[req.req_pool_idx]
    req.swa_freed_upto = out_of_window_upto(0, 10, W)
    pools.allocator.free_swa(row[:7].long())
    with pytest.raises(ValueError, match="positions 6..6 have no sliding-window KV"):
        give_back_kv(req, 1, pools.req_to_token, pools.allocator, W)
    assert req.kv_len == 10 and pools.row(req)[:10] == list(range(1, 11))  # nothing changed

    pools = Pools()
    req = pools.admit(PROMPT, computed=10)
    row = pools.req_to_token.req_to_token[req.req_pool_idx]
    req.swa_freed_upto = out_of_window_upto(0, 9, W)  # a cursor one token behind: positions 0..5 freed
    pools.allocator.free_swa(row[:6].long())
    with pytest.raises(ValueError, match="positions 5..5"):
        give_back_kv(req, 2, pools.req_to_token, pools.allocator, W)
    assert give_back_kv(req, 1, pools.req_to_token, pools.allocator, W).tolist() == [10]
    assert pools.allocator.full_to_swa[[6, 7, 8, 9, 10]].tolist() == [0, 7, 8, 9, 0]
    pools.check(req)


def test_after_a_prefix_hit_the_cached_prefix_stays() -> None:
    """A finished request cached PROMPT[:6] (slots 1..6); the next one hits those 6 tokens and adds 4 of its
    own (slots 7..10). Its own 4 can go back, not one more; the cache keeps its 6 locked, then gets them back
    unlocked when the request ends."""
    pools = Pools()
    first = pools.allocator.alloc(6)
    pools.cache.insert(PROMPT[:6], first)
    req = pools.admit(PROMPT, computed=10)
    assert req.prefix.prefix_len == 6 and pools.row(req)[:10] == list(range(1, 11))
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        give_back_kv(req, 5, pools.req_to_token, pools.allocator, W)
    assert give_back_kv(req, 4, pools.req_to_token, pools.allocator, W).tolist() == [7, 8, 9, 10]
    assert req.kv_len == 6 and pools.row(req) == [1, 2, 3, 4, 5, 6, 0, 0]
    pools.check(req)
    pools.cache.cache_finished(PROMPT[:6], pools.req_to_token.req_to_token[req.req_pool_idx, :6].long(), req.prefix)
    pools.req_to_token.free(req.req_pool_idx)
    pools.cache.check_integrity(torch.empty(0, dtype=torch.int64))
    assert pools.cache.stats().cached == 6 and pools.cache.stats().evictable == 6


def test_nothing_to_give_back() -> None:
    pools = Pools()
    req = pools.admit(PROMPT, computed=5)
    assert give_back_kv(req, 0, pools.req_to_token, pools.allocator, W).tolist() == []
    assert req.kv_len == 5
    pools.check(req)
    with pytest.raises(ValueError, match="num_tokens"):
        give_back_kv(req, -1, pools.req_to_token, pools.allocator, W)
