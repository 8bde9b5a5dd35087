"""The radix cache for models with sliding-window layers: full KV for every cached token, SWA KV for some.

A node whose SWA slots were freed is a tombstone: full-attention layers can still read its KV, sliding layers
cannot. A query at position p with window W reads positions p-W+1 .. p (Hugging Face: kv > q - W), so a
prefix of length e is usable only if the W-1 tokens before e (all of them when e < W) still have SWA KV:
the request's first new query, at position e, reads exactly those.

    tokens   0 ........................................... e | e (first new token, computed now)
    tree     [ live ][ tombstone ][ live .................. ]
                                   |<------ >= W-1 ------->|   match may end at e
    tree     [ live ][ tombstone ][ live ...... ]  -> too short after the tombstone: the match ends where
                     ^                                the tombstone starts (if the live run before it is
                     e                                long enough, or nothing before it was a tombstone)

Locks: a request locks its whole prefix for full attention (`lock_ref`) but only the last W-1 tokens for
sliding attention (`swa_lock_ref`); SWA eviction may tombstone anything else, even under a running request.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from srt.forward.host_device import fill_at
from srt.mem_cache.allocator import SWATokenAllocator, debug_kv_indices
from srt.mem_cache.base_prefix_cache import CacheStats, check_swa_partition
from srt.mem_cache.radix_cache import RadixCache, TreeNode


class SWARadixCache(RadixCache):
    """Radix cache over full-pool slots that tracks which nodes still hold SWA KV."""

    def __init__(self, allocator: SWATokenAllocator, sliding_window: int) -> None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1; got {sliding_window}")
        super().__init__(allocator)
        self.allocator: SWATokenAllocator = allocator
        self.sliding_window = sliding_window
        self._window_tail = sliding_window - 1  # tokens before a prefix end that must keep SWA KV

    # ---- match-end rule ------------------------------------------------------------------------------
    def _usable(self, path: list[TreeNode]) -> list[TreeNode]:
        """Cut the path after its last node end that has `_window_tail` live tokens right before it.

        Within a live run the rule holds from W-1 tokens in onwards, so the best end is either the path's
        end or the start of some tombstone; both lie on node boundaries.
        """
        usable, pos, run_start = 0, 0, None  # run_start: end of the last tombstone, None before any
        for i, node in enumerate(path):
            pos += len(node)
            if node.tombstone:
                run_start = pos
            if run_start is None or pos - run_start >= self._window_tail:
                usable = i + 1
        return path[:usable]

    # ---- insertion -----------------------------------------------------------------------------------
    def _add_leaves(
        self, parent: TreeNode, key: tuple[int, ...], slots: torch.Tensor, live_from: int | None
    ) -> list[TreeNode]:
        """New tokens become a chain of nodes, one per run of tokens with / without SWA KV."""
        if live_from is None:
            live = self.allocator.full_to_swa[slots] != 0
            # one read: whether the first token is live, then where each run after the first starts
            run_starts = torch.nonzero(live[1:] != live[:-1]).flatten().add_(1)
            first_live, *starts = torch.cat([live[:1].long(), run_starts]).tolist()
        else:  # a request's own tokens: none holds SWA KV before live_from, all do from there
            self._check_live_from(slots, live_from, None)
            first_live, starts = live_from <= 0, [live_from] if 0 < live_from < len(key) else []
        nodes = []
        for i, (start, end) in enumerate(itertools.pairwise([0, *starts, len(key)])):
            parent = self._add_node(parent, key[start:end], slots[start:end])
            parent.tombstone = bool(first_live) == bool(i % 2)  # runs alternate live / tombstone
            nodes.append(parent)
        return nodes

    def _adopt(self, node: TreeNode, request_slots: torch.Tensor, live_from: int | None) -> TreeNode:
        """Revive a tombstone's tail with the request's SWA KV of the same tokens.

        The request computed these tokens itself and still holds their SWA slots; moving the mapping to the
        tree's full slots keeps that KV (the caller then frees only the duplicate full slots). Without this a
        chunked-prefill request could be handed back tree slots without SWA KV inside its own window.
        With `live_from` known (the request's tokens from there on hold SWA slots, its own slots, not the
        tree's), the request's SWA slots of a live node's tokens, duplicates, are freed here too.
        """
        if live_from is not None:
            tail = min(max(live_from, 0), len(node))
            self._check_live_from(request_slots, live_from, node.slots)
            if tail == len(node):
                return node
            if not node.tombstone:
                self.allocator.free_swa(request_slots[tail:], all_hold_swa=True)
                return node
        else:
            if not node.tombstone:
                return node
            to_swa = self.allocator.full_to_swa
            revivable = ((request_slots != node.slots) & (to_swa[request_slots] != 0)).tolist()
            tail = len(revivable)
            while tail > 0 and revivable[tail - 1]:
                tail -= 1
            if tail == len(revivable):
                return node
        if tail > 0:
            self._split(node, tail)  # `node` keeps the revivable tail
        to_swa = self.allocator.full_to_swa
        to_swa[node.slots] = to_swa[request_slots[tail:]]
        fill_at(to_swa, (request_slots[tail:],), 0)
        node.tombstone = False
        return node

    def _check_live_from(self, request_slots: torch.Tensor, live_from: int, tree_slots: torch.Tensor | None) -> None:
        """SRT_DEBUG_KV_INDICES=1: the request's own slots (not the tree's, which its locked prefix holds) hold SWA
        slots exactly from `live_from` on, and all of those are its own."""
        if not debug_kv_indices():
            return
        held = (self.allocator.full_to_swa[request_slots] != 0).tolist()
        own = [True] * len(held) if tree_slots is None else (request_slots != tree_slots).tolist()
        for i, (holds, is_own) in enumerate(zip(held, own, strict=True)):
            if (i >= live_from and not is_own) or (is_own and holds != (i >= live_from)):
                raise AssertionError(f"the request's SWA slots are not exactly those from {live_from} on: {held}")

    # ---- locks ---------------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Lock the whole prefix for full attention and its last W-1 tokens for sliding attention."""
        window = self._window_nodes(node)
        if any(cur.tombstone for cur in window):
            raise ValueError(f"cannot lock a prefix whose last W-1 tokens lack SWA KV: {node!r}")
        super().lock(node)
        if (over := sum(len(cur) for cur in window) - self._window_tail) > 0:
            self._split(window[-1], over)  # lock exactly the window, not a whole long node
        for cur in window:
            cur.swa_lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        super().unlock(node)
        for cur in self._locked_window(node):
            cur.swa_lock_ref -= 1

    def _window_nodes(self, node: TreeNode) -> list[TreeNode]:
        """Nodes holding the last W-1 tokens up to `node`, nearest first; the farthest may reach further back."""
        nodes, need = [], self._window_tail
        while need > 0 and node is not self.root:
            nodes.append(node)
            need -= len(node)
            node = node.parent
        return nodes

    def _locked_window(self, node: TreeNode) -> list[TreeNode]:
        """The nodes `lock(node)` SWA-locked: its window, which lock split to start on a node boundary."""
        nodes = self._window_nodes(node)
        if (over := sum(len(cur) for cur in nodes) - self._window_tail) > 0:
            raise AssertionError(f"SWA lock window does not end on a node boundary ({over} tokens over)")
        return nodes

    # ---- eviction ------------------------------------------------------------------------------------
    def evict_swa(self, num_tokens: int) -> int:
        """Free at least `num_tokens` SWA slots, least recently used nodes first; returns how many.

        An unlocked leaf goes entirely (a tombstone leaf could never end a match). Any other node outside
        every request's window becomes a tombstone: its full KV stays for full-attention layers.
        """
        candidates = [n for n in self._nodes() if not n.tombstone and not n.swa_lock_ref]
        heap = [(n.last_access, n.node_id, n) for n in candidates]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed += len(node)
            if node.children or node.lock_ref:
                self.allocator.free_swa(node.slots, all_hold_swa=True)  # a live node: each token holds one
                node.tombstone = True
                continue
            parent = node.parent
            self._delete_leaf(node)
            while parent is not self.root and parent.tombstone and not parent.children and not parent.lock_ref:
                grandparent = parent.parent
                self._delete_leaf(parent)
                parent = grandparent
        return freed

    def _delete_leaf(self, leaf: TreeNode) -> None:
        # a node's tokens all hold SWA slots or none (a tombstone): freed without reading the mapping back
        self.allocator.free(leaf.slots, len(leaf) if leaf.tombstone else 0)
        del leaf.parent.children[leaf.key[0]]

    # ---- accounting ----------------------------------------------------------------------------------
    def swa_stats(self) -> CacheStats:
        """Token counts of the SWA pool (cached = live tokens in the tree), counted over the tree."""
        swa = self.allocator.swa
        total, free = swa.size, swa.available()
        live = [node for node in self._nodes() if not node.tombstone]
        cached = sum(len(node) for node in live)
        evictable = sum(len(node) for node in live if not node.swa_lock_ref)
        return CacheStats(total, free, cached, evictable, total - free - cached)

    def _check_node(self, node: TreeNode) -> None:
        mapped = self.allocator.full_to_swa[node.slots] != 0
        if node.tombstone and bool(mapped.any()):
            raise AssertionError(f"tombstone still maps SWA slots: {node!r}")
        if not node.tombstone and not bool(mapped.all()):
            raise AssertionError(f"live node lost SWA slots: {node!r}")
        if node.tombstone and node.swa_lock_ref:
            raise AssertionError(f"tombstone inside a locked sliding window: {node!r}")

    def _check_pools(self, request_slots: torch.Tensor | None) -> None:
        by_id = {node.node_id: node for node in self._nodes()}
        by_id[self.root.node_id] = self.root
        expected: dict[int, int] = {}
        for node_id, count in self._locks.items():
            for cur in self._locked_window(by_id[node_id]):
                expected[cur.node_id] = expected.get(cur.node_id, 0) + count
        live_slots = []
        for node in self._nodes():
            if node.swa_lock_ref != expected.get(node.node_id, 0):
                raise AssertionError(
                    f"swa_lock_ref {node.swa_lock_ref} != {expected.get(node.node_id, 0)} windows: {node!r}"
                )
            if not node.tombstone:
                live_slots.append(node.slots)
        check_swa_partition(self.allocator, torch.cat(live_slots) if live_slots else self._empty, request_slots)
