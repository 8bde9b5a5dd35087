"""Token-level radix tree over full-pool slots: shared prefixes keep one copy of their KV.

Each edge holds a run of token ids and their full-pool slots. A request that matches a prefix locks the node
where the match ends; a lock protects the node and all its ancestors. Eviction frees unlocked leaves, least
recently used first, and walks up as parents become unlocked leaves.

    root ── [1 2 3] ──┬── [4 5]        insert(1 2 3 4 5), insert(1 2 3 6) split [1 2 3 4 5] at 3
                      └── [6]          match(1 2 3 6 7) -> slots of 1 2 3 6, node [6]
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator, Sequence

import torch

from srt.mem_cache.allocator import SWATokenAllocator, TokenSlotAllocator
from srt.mem_cache.base_prefix_cache import (
    CacheHandle,
    CacheStats,
    MatchResult,
    PrefixCache,
    check_partition,
    full_pool_of,
)


class TreeNode(CacheHandle):
    """One edge of the tree: `key` tokens whose KV sits in full-pool `slots`."""

    __slots__ = (
        "key",
        "slots",
        "parent",
        "children",
        "lock_ref",
        "swa_lock_ref",
        "tombstone",
        "last_access",
        "node_id",
    )
    _ids = itertools.count()

    def __init__(self, key: tuple[int, ...], slots: torch.Tensor, parent: TreeNode | None) -> None:
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = 0  # locks on this node or a descendant
        self.swa_lock_ref = 0  # SWARadixCache: locks whose sliding window covers this node
        self.tombstone = False  # SWARadixCache: the SWA KV of these tokens is freed
        self.last_access = 0
        self.node_id = next(TreeNode._ids)  # creation order; breaks LRU ties deterministically

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode({list(self.key)}, slots={self.slots.tolist()}, lock={self.lock_ref})"


COMPARE_BLOCK = 256  # tokens compared per tuple comparison (C speed) before the element-wise search


def common_prefix_len(key: tuple[int, ...], token_ids: Sequence[int], start: int) -> int:
    """How many leading tokens of `key` equal token_ids[start:].

    Compared a block at a time as tuples (an 8k-token prompt walks its own node on every insert: an element-wise
    Python loop took ~0.5 ms), then element by element inside the first block that differs."""
    n = min(len(key), len(token_ids) - start)
    for block in range(0, n, COMPARE_BLOCK):
        end = min(block + COMPARE_BLOCK, n)
        if key[block:end] != tuple(token_ids[start + block : start + end]):
            return next(i for i in range(block, end) if key[i] != token_ids[start + i])
    return n


class RadixCache(PrefixCache):
    """Prefix cache over full-pool slots with lock references and LRU eviction of unlocked leaves."""

    def __init__(self, allocator: TokenSlotAllocator | SWATokenAllocator) -> None:
        self.allocator = allocator
        self._full = full_pool_of(allocator)
        self._empty = torch.empty(0, dtype=torch.int64, device=allocator.device)  # slots of an empty match
        self.root = TreeNode((), self._empty, None)
        self._locks: Counter[int] = Counter()  # node_id -> lock() calls not yet undone
        self._clock = 0  # logical time of the last access; LRU order without wall-clock ties

    # ---- lookups -------------------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        path = self._usable(self._walk(token_ids))
        self._touch(path)
        return self._result(path)

    def lookup(self, token_ids: Sequence[int]) -> MatchResult:
        """The longest cached prefix regardless of any SWA rule (what full-attention layers could reuse)."""
        path = self._walk(token_ids)
        self._touch(path)
        return self._result(path)

    def _walk(self, token_ids: Sequence[int]) -> list[TreeNode]:
        """Nodes along the longest cached prefix; splits the last one so the prefix ends on a node."""
        node, pos, path = self.root, 0, []
        while pos < len(token_ids) and (child := node.children.get(token_ids[pos])) is not None:
            matched = common_prefix_len(child.key, token_ids, pos)
            if matched < len(child):
                path.append(self._split(child, matched))
                break
            path.append(child)
            node, pos = child, pos + matched
        return path

    def _usable(self, path: list[TreeNode]) -> list[TreeNode]:
        """The part of a matched path a request may reuse (all of it here; SWA narrows it)."""
        return path

    def _touch(self, path: list[TreeNode]) -> None:
        self._clock += 1
        for node in path:
            node.last_access = self._clock

    def _result(self, path: list[TreeNode]) -> MatchResult:
        slots = torch.cat([node.slots for node in path]) if path else self._empty
        return MatchResult(slots, path[-1] if path else self.root)

    # ---- insertion -----------------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor, swa_from: int | None = None) -> int:
        if len(token_ids) != len(slots):
            raise ValueError(f"{len(token_ids)} tokens but {len(slots)} slots")
        slots = slots.to(dtype=torch.int64)
        path = self._walk(token_ids)
        pos = 0
        for i, node in enumerate(path):
            length = len(node)  # before _adopt, which may split `node` and leave it the tail
            live_from = None if swa_from is None else swa_from - pos
            path[i] = self._adopt(node, slots[pos : pos + length], live_from)
            pos += length
        if pos < len(token_ids):
            parent = path[-1] if path else self.root
            live_from = None if swa_from is None else swa_from - pos
            path += self._add_leaves(parent, tuple(token_ids[pos:]), slots[pos:], live_from)
        self._touch(path)
        return pos

    def _adopt(self, node: TreeNode, request_slots: torch.Tensor, live_from: int | None) -> TreeNode:
        """Hook for a node the inserted tokens already had (SWA revives tombstones); returns its deepest part.
        `live_from`: where the request's tokens holding SWA slots start, relative to the node (`insert`)."""
        return node

    def _add_leaves(
        self, parent: TreeNode, key: tuple[int, ...], slots: torch.Tensor, live_from: int | None
    ) -> list[TreeNode]:
        return [self._add_node(parent, key, slots)]

    def _add_node(self, parent: TreeNode, key: tuple[int, ...], slots: torch.Tensor) -> TreeNode:
        node = TreeNode(key, slots, parent)
        parent.children[key[0]] = node
        return node

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node` after `at` tokens; the new parent takes the head, `node` keeps the tail (and its identity,
        so lock handles stay valid). Both halves inherit lock counts and state."""
        head = TreeNode(node.key[:at], node.slots[:at], node.parent)
        head.lock_ref, head.swa_lock_ref = node.lock_ref, node.swa_lock_ref
        head.tombstone, head.last_access = node.tombstone, node.last_access
        node.parent.children[node.key[0]] = head
        node.key, node.slots, node.parent = node.key[at:], node.slots[at:], head
        head.children[node.key[0]] = node
        return head

    # ---- locks ---------------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        self._check_attached(node)
        self._locks[node.node_id] += 1
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        if self._locks[node.node_id] <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        self._locks[node.node_id] -= 1
        if not self._locks[node.node_id]:
            del self._locks[node.node_id]
        while node is not self.root:
            node.lock_ref -= 1
            node = node.parent

    def _check_attached(self, node: TreeNode) -> None:
        cur = node
        while cur.parent is not None:
            if cur.parent.children.get(cur.key[0]) is not cur:
                raise ValueError(f"node is no longer in the cache (evicted?): {node!r}")
            cur = cur.parent
        if cur is not self.root:
            raise ValueError(f"node belongs to another cache: {node!r}")

    # ---- eviction ------------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if not n.children and not n.lock_ref]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            evicted += len(leaf)
            self._delete_leaf(leaf)
            if parent is not self.root and not parent.children and not parent.lock_ref:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return evicted

    def _delete_leaf(self, leaf: TreeNode) -> None:
        """Unhook an unlocked leaf and return its slots (full, and SWA where still held) to the allocator."""
        self.allocator.free(leaf.slots)
        del leaf.parent.children[leaf.key[0]]

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- chunked prefill -----------------------------------------------------------------------------
    def cache_unfinished(
        self, token_ids: Sequence[int], slots: torch.Tensor, match: MatchResult, swa_from: int | None = None
    ) -> MatchResult:
        already_cached = self.insert(token_ids, slots, swa_from)
        self._free_duplicates(slots, match.prefix_len, already_cached, swa_freed=swa_from is not None)
        new = self.lookup(token_ids)
        if new.prefix_len != len(token_ids):
            raise AssertionError(f"inserted {len(token_ids)} tokens but found {new.prefix_len}")
        self.lock(new.node)
        self.unlock(match.node)
        return new

    # ---- accounting ----------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """Counted over the tree (stats serve logs and checks, not the scheduling loop)."""
        total, free = self._full.size, self._full.available()
        cached = evictable = 0
        for node in self._nodes():
            cached += len(node)
            evictable += 0 if node.lock_ref else len(node)
        return CacheStats(total, free, cached, evictable, total - free - cached)

    def check_integrity(self, request_slots: torch.Tensor | None = None) -> None:
        self.allocator.check_integrity()
        ids, tree_slots = {self.root.node_id}, []
        for node in self._nodes():
            ids.add(node.node_id)
            tree_slots.append(node.slots)
            if not len(node) or len(node.key) != len(node.slots):
                raise AssertionError(f"node has {len(node.key)} tokens and {len(node.slots)} slots: {node!r}")
            if node.parent.children.get(node.key[0]) is not node:
                raise AssertionError(f"node is not its parent's child for token {node.key[0]}: {node!r}")
            below = sum(child.lock_ref for child in node.children.values())
            if node.lock_ref != self._locks[node.node_id] + below:
                raise AssertionError(
                    f"lock_ref {node.lock_ref} != {self._locks[node.node_id]} locks + {below} below: {node!r}"
                )
            self._check_node(node)
        if stale := [node_id for node_id in self._locks if node_id not in ids]:
            raise AssertionError(f"locks held on nodes no longer in the tree: {stale}")
        all_tree_slots = torch.cat(tree_slots) if tree_slots else self._empty
        check_partition("full", self._full.size, self._full.free_slots(), all_tree_slots, request_slots)
        self._check_pools(request_slots)

    def _check_node(self, node: TreeNode) -> None:
        """Hook: per-node checks of a subclass."""

    def _check_pools(self, request_slots: torch.Tensor | None) -> None:
        """Hook: pool-level checks of a subclass."""
