"""Random request lifecycles against a reference model of the prefix cache; integrity checked after every step.

The reference is a dict {token prefix: full slot} of what the cache should hold. It predicts what insert
keeps, what a match returns (for SWARadixCache: the longest end whose last W-1 positions have SWA KV), and
constrains eviction (only unlocked, whole subtrees, the reported count). Requests are driven the way the
scheduler drives them: admit (match + lock), prefill chunks / decode steps with window freeing, cache an
unfinished request, finish, abort without caching, evict.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from srt import envs
from srt.mem_cache.allocator import SWATokenAllocator, TokenSlotAllocator
from srt.mem_cache.base_prefix_cache import MatchResult
from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.radix_cache import RadixCache
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.mem_cache.swa_radix_cache import SWARadixCache
from srt.mem_cache.swa_window import free_out_of_window

FULL, SWA, ROWS, CONTEXT = 40, 20, 4, 24
tokens_st = st.lists(st.integers(0, 2), min_size=2, max_size=14)  # tiny alphabet: many shared prefixes


@dataclass
class Req:
    tokens: list[int]  # prompt, then generated tokens
    row: int
    match: MatchResult
    kv_len: int  # tokens with KV in the pool
    freed_upto: int  # SWA freed (or cache-owned) below this position


def tree_contents(cache: RadixCache | ChunkCache) -> dict[tuple[int, ...], int]:
    """{prefix: slot of its last token} read off the tree without touching it (the chunk cache holds none)."""
    out: dict[tuple[int, ...], int] = {}
    if isinstance(cache, ChunkCache):
        return out
    stack = [((), child) for child in cache.root.children.values()]
    while stack:
        prefix, node = stack.pop()
        for token, slot in zip(node.key, node.slots.tolist(), strict=True):
            prefix = (*prefix, token)
            out[prefix] = slot
        stack.extend((prefix, child) for child in node.children.values())
    return out


@contextmanager
def host_known_swa(data: st.DataObject) -> Iterator[Callable[[Req], int | None]]:
    """Either way of caching a request: reading which of its slots hold SWA KV back from the pool, or told it
    by the request's freed_upto (as the scheduler does), then checked against the pool (SRT_DEBUG_KV_INDICES)."""
    if not data.draw(st.booleans(), label="SWA from the host"):
        yield lambda req: None
        return
    with mock.patch.dict(os.environ, {envs.SRT_DEBUG_KV_INDICES.name: "1"}):
        yield lambda req: req.freed_upto


class CacheMachine(RuleBasedStateMachine):
    kind = "swa"

    def __init__(self) -> None:
        super().__init__()
        self.window = 3
        self.pool = ReqToTokenPool(ROWS, CONTEXT)
        self.reqs: list[Req] = []
        self.ref: dict[tuple[int, ...], int] = {}
        self.alloc = SWATokenAllocator(FULL, SWA) if self.kind == "swa" else TokenSlotAllocator(FULL)
        self.cache = ChunkCache(self.alloc) if self.kind == "chunk" else RadixCache(self.alloc)

    @initialize(window=st.integers(1, 5))
    def choose_window(self, window: int) -> None:
        if self.kind == "swa":
            self.window = window
            self.cache = SWARadixCache(self.alloc, window)

    # ---- reference predictions ----------------------------------------------------------------------
    def live_now(self) -> dict[tuple[int, ...], bool]:
        return {p: self.live(s) for p, s in self.ref.items()}

    def live(self, slot: int) -> bool:
        return self.kind != "swa" or bool(self.alloc.full_to_swa[slot] != 0)

    def expected_match(self, tokens: list[int]) -> list[int]:
        cached = 0
        while cached < len(tokens) and tuple(tokens[: cached + 1]) in self.ref:
            cached += 1
        slots = [self.ref[tuple(tokens[: i + 1])] for i in range(cached)]
        if self.kind != "swa":
            return slots
        for end in range(cached, -1, -1):  # the latest end whose last W-1 positions have SWA KV
            if all(self.live(s) for s in slots[max(0, end - self.window + 1) : end]):
                event(f"match cut short by the SWA rule: {end < cached}")
                return slots[:end]
        raise AssertionError("end 0 is always usable")

    def allocate(self, count: int) -> torch.Tensor | None:
        """Slots for `count` tokens, evicting if needed; None when memory is short (the caller backs off)."""
        full_pool = self.alloc.full if self.kind == "swa" else self.alloc
        short = count - full_pool.available()
        if short > 0:
            self.evict(short)
        if self.kind == "swa" and count > self.alloc.swa.available():
            self.evict_swa(count - self.alloc.swa.available())
        return self.alloc.alloc(count) if self.alloc.available() >= count else None

    def request_slots(self) -> torch.Tensor:
        own = [self.pool.req_to_token[r.row, r.match.prefix_len : r.kv_len] for r in self.reqs]
        return torch.cat(own).to(torch.int64) if own else torch.empty(0, dtype=torch.int64)

    # ---- request lifecycle --------------------------------------------------------------------------
    @rule(prompt=tokens_st, chunk=st.integers(1, 8))
    @precondition(lambda self: self.pool.available() > 0)
    def admit(self, prompt: list[int], chunk: int) -> None:
        match = self.cache.match_prefix(prompt[:-1])
        assert match.slots.tolist() == self.expected_match(prompt[:-1])
        event(f"admitted with a prefix hit: {match.prefix_len > 0}")
        self.cache.lock(match.node)
        row = self.pool.alloc()
        self.pool.write(row, 0, match.slots)
        req = Req(list(prompt), row, match, match.prefix_len, match.prefix_len)
        self.reqs.append(req)
        self.advance(req, min(chunk, len(prompt) - req.kv_len))

    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=3), chunk=st.integers(1, 8))
    @precondition(lambda self: self.pool.available() > 0 and self.ref)
    def admit_cached(self, data: st.DataObject, extra: list[int], chunk: int) -> None:
        """A prompt that repeats a cached sequence (a follow-up turn, a retried request), maybe extended."""
        prefix = data.draw(st.sampled_from(sorted(self.ref)))
        self.admit(list(prefix) + extra + [0], chunk)

    @rule(data=st.data(), chunk=st.integers(1, 8), token=st.integers(0, 2))
    @precondition(lambda self: self.reqs)
    def step(self, data: st.DataObject, chunk: int, token: int) -> None:
        """A prefill chunk of the prompt, or a decode step (the sampled token becomes the next input)."""
        req = data.draw(st.sampled_from(self.reqs))
        if req.kv_len == len(req.tokens) and len(req.tokens) < CONTEXT:
            req.tokens.append(token)
        if req.kv_len < len(req.tokens):
            self.advance(req, min(chunk, len(req.tokens) - req.kv_len))

    def advance(self, req: Req, count: int) -> None:
        slots = self.allocate(count)
        if slots is None:
            return
        self.pool.write(req.row, req.kv_len, slots)
        req.kv_len += count
        if self.kind == "swa":
            row = self.pool.req_to_token[req.row]
            req.freed_upto = free_out_of_window(self.alloc, row, req.freed_upto, req.kv_len, self.window)
            assert all(self.live(int(s)) for s in row[max(req.freed_upto, req.kv_len - self.window + 1) : req.kv_len])

    @rule(data=st.data())
    @precondition(lambda self: self.reqs)
    def cache_unfinished(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.reqs))
        row = self.pool.req_to_token[req.row, : req.kv_len].to(torch.int64).clone()
        expected = self.expected_tree(req, row)
        with host_known_swa(data) as swa_from:
            req.match = self.cache.cache_unfinished(req.tokens[: req.kv_len], row, req.match, swa_from(req))
        self.pool.write(req.row, 0, req.match.slots)  # row[:prefix_len] now holds the cache's own slots
        req.freed_upto = max(req.freed_upto, req.match.prefix_len)
        self.check_insert(expected)

    @rule(data=st.data(), keep=st.booleans())
    @precondition(lambda self: self.reqs)
    def finish(self, data: st.DataObject, keep: bool) -> None:
        req = data.draw(st.sampled_from(self.reqs))
        self.reqs.remove(req)
        row = self.pool.req_to_token[req.row, : req.kv_len].to(torch.int64).clone()
        if keep:  # finished, or aborted / retracted with its KV kept
            expected = self.expected_tree(req, row)
            with host_known_swa(data) as swa_from:
                self.cache.cache_finished(req.tokens[: req.kv_len], row, req.match, swa_from(req))
            self.check_insert(expected)
        else:  # aborted without caching
            self.cache.release(row, req.match)
        self.pool.free(req.row)

    def expected_tree(self, req: Req, row: torch.Tensor) -> tuple[dict, dict]:
        tokens, ref = req.tokens[: req.kv_len], dict(self.ref)
        live = self.live_now()
        if self.kind == "chunk":
            return ref, live
        for i, slot in enumerate(row.tolist()):
            prefix = tuple(tokens[: i + 1])
            if prefix not in ref:
                ref[prefix], live[prefix] = slot, i >= req.freed_upto
            elif i >= max(req.match.prefix_len, req.freed_upto) and not live[prefix]:
                live[prefix] = True  # a tombstone revived with the request's own SWA KV
                event("insert revives tombstoned tokens")
        return ref, live

    def check_insert(self, expected: tuple[dict, dict]) -> None:
        ref, live = expected
        assert tree_contents(self.cache) == ref
        if self.kind == "swa":
            assert {p: self.live(s) for p, s in ref.items()} == live
        self.ref = ref

    # ---- eviction -----------------------------------------------------------------------------------
    @rule(num=st.integers(1, 12))
    def evict(self, num: int) -> None:
        before = dict(self.ref)
        evicted = self.cache.evict(num)
        event(f"evict freed: {min(evicted, 1)}")
        self.check_eviction(before, evicted, num, full=True)

    @rule(num=st.integers(1, 12))
    @precondition(lambda self: self.kind == "swa")
    def evict_swa(self, num: int) -> None:
        before = dict(self.ref)
        live_before = self.live_now()
        freed = self.cache.evict_swa(num)
        event(f"evict_swa freed: {min(freed, 1)}")
        after = self.check_eviction(before, None, num, full=False)
        newly_dead = sum(live_before[p] and not self.live(s) for p, s in after.items())
        assert freed == newly_dead + sum(live_before[p] for p in before if p not in after)
        assert freed >= num or self.cache.swa_stats().evictable == 0

    def check_eviction(self, before: dict, evicted: int | None, num: int, full: bool) -> dict:
        after = tree_contents(self.cache)
        assert after.items() <= before.items()
        gone = before.keys() - after.keys()
        assert not any(p[: len(q)] == q for p in after for q in gone)  # whole subtrees only
        for req in self.reqs:  # locked prefixes stay, with the slots the request reads
            prefix = tuple(req.tokens[: req.match.prefix_len])
            assert all(prefix[: i + 1] in after for i in range(len(prefix)))
        if evicted is not None:
            assert evicted == len(gone)
            assert evicted >= num or self.cache.evictable() == 0
        self.ref = after
        return after

    @rule(tokens=tokens_st)
    def match(self, tokens: list[int]) -> None:
        assert self.cache.match_prefix(tokens).slots.tolist() == self.expected_match(tokens)

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity(request_slots=self.request_slots())
        self.pool.check_integrity()
        stats = self.cache.stats()
        assert stats.cached == len(self.ref) and stats.free + stats.cached + stats.in_use == stats.total
        assert stats.in_use == len(self.request_slots())
        for req in self.reqs:  # the KV of every window a running request will read still exists
            row = self.pool.req_to_token[req.row]
            assert all(self.live(int(s)) for s in row[max(0, req.kv_len - self.window + 1) : req.kv_len])


_SETTINGS = settings(
    max_examples=120, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class SWAMachine(CacheMachine):
    kind = "swa"


class RadixMachine(CacheMachine):
    kind = "radix"


class ChunkMachine(CacheMachine):
    kind = "chunk"


TestSWARadixCache = SWAMachine.TestCase
TestSWARadixCache.settings = _SETTINGS
TestRadixCache = RadixMachine.TestCase
TestRadixCache.settings = settings(_SETTINGS, max_examples=50)
TestChunkCache = ChunkMachine.TestCase
TestChunkCache.settings = settings(_SETTINGS, max_examples=15)
