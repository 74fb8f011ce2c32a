"""RadixCache: a prefix cache over token ids whose values are KV slots (SGLang's RadixCache).

Each edge holds a run of tokens and the KV slots computed for them. With page_size > 1 the
tree works in whole pages: keys match, insert and split only at page boundaries, so every
node owns whole pages and eviction can hand them straight back to the allocator.

A node always stands for the same end position: splitting creates a new parent for the
shared part and leaves the original node below it, so a request's lock on its last node
stays valid across splits.

A `listener` (gpu_worker/cached_blocks.py) is told of every prefix the tree gains or loses,
so a worker can tell the routers what it holds; a split changes no prefix and tells nothing.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from gpu_worker.memory.allocator import PagedTokenAllocator

_node_ids = itertools.count()


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")

    def __init__(self, parent: TreeNode | None, key: list[int], value: torch.Tensor) -> None:
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key  # token ids of this edge, a multiple of page_size long
        self.value = value  # [len(key)] int64 KV slots, owned by the tree
        # Requests using this node or a descendant; > 0 protects it from eviction.
        self.lock_ref = 0
        self.last_access = 0
        self.id = next(_node_ids)  # tie-break for the eviction heap

    def is_leaf(self) -> bool:
        return not self.children

    def __lt__(self, other: TreeNode) -> bool:
        return (self.last_access, self.id) < (other.last_access, other.id)


class CacheListener(Protocol):
    """Told what the tree gains and loses, as token paths from the root."""

    def inserted(self, key: list[int], already: int) -> None:
        """The tree holds `key` now, of which the first `already` tokens it held before."""

    def evicted(self, path: list[int], start: int) -> None:
        """The tree lost `path`'s tokens from `start` on (and holds its first `start`)."""

    def cleared(self) -> None:
        """The tree holds nothing now."""


@dataclass
class MatchResult:
    slots: torch.Tensor  # [n] int64 KV slots of the matched prefix, n a multiple of page_size
    last_node: TreeNode  # the node ending the match (root when nothing matched)


class RadixCache:
    """Prefix cache over token ids whose values are KV slots; keys are compared page by page
    (with page_size > 1 only whole pages match or are inserted, and nodes split only at page
    boundaries). Reference counts protect nodes in use; eviction frees least-recently-used
    unlocked leaves back to the allocator."""

    def __init__(self, allocator: PagedTokenAllocator, page_size: int) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self.listener: CacheListener | None = None
        self.reset()

    def reset(self) -> None:
        """Forget every node without freeing its slots: pair it with allocator.clear()."""
        self.root = TreeNode(None, [], torch.empty(0, dtype=torch.int64, device=self.device))
        self._clock = itertools.count(1)  # a counter, not wall time: LRU order is exact
        self._evictable = 0
        self._protected = 0
        if self.listener is not None:
            self.listener.cleared()

    # ---- sizes (tokens) ------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- lookup and insertion ------------------------------------------------------------

    def match_prefix(self, key: list[int]) -> MatchResult:
        """The longest cached prefix of `key` in whole pages; marks its nodes as just used."""
        key = key[: len(key) - len(key) % self.page_size]
        now = next(self._clock)
        node = self.root
        node.last_access = now
        values = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = now
            matched = self._match_len(child.key, key)
            if matched < len(child.key):
                child = self._split(child, matched)
            values.append(child.value)
            node = child
            key = key[matched:]
        slots = torch.cat(values) if values else self.root.value
        return MatchResult(slots, node)

    def insert(self, key: list[int], slots: torch.Tensor) -> int:
        """Add key -> slots; returns how many leading tokens were ALREADY in the tree.

        len(key) == len(slots), a multiple of page_size. The tree takes ownership of
        slots[returned:] only (it stores a copy, so `slots` may be a view of a request's row).
        slots[:returned] stay the caller's: those positions hold the tree's own slots there,
        so whatever part of them the caller allocated itself (positions past its own cached
        prefix) is a duplicate it must free. cache_request_prefix does exactly that.
        """
        if len(key) != len(slots) or len(key) % self.page_size:
            raise ValueError(
                f"insert needs len(key) == len(slots), a multiple of {self.page_size}: "
                f"got {len(key)} and {len(slots)}"
            )
        now = next(self._clock)
        node = self.root
        node.last_access = now
        already = 0
        whole = key
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                self._add_leaf(node, key, slots, now)
                break
            child.last_access = now
            matched = self._match_len(child.key, key)
            if matched < len(child.key):
                child = self._split(child, matched)
            already += matched
            node = child
            key = key[matched:]
            slots = slots[matched:]
        if self.listener is not None and already < len(whole):
            self.listener.inserted(list(whole), already)
        return already

    # ---- locking -------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect node and all its ancestors from eviction (one more request uses them)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on an unlocked node (unbalanced locking)")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until >= num_tokens are freed (or none is
        left); returns the tokens freed. A parent left childless and unlocked becomes a leaf
        and competes in the same LRU order."""
        heap = [node for node in self._nodes() if node.is_leaf() and node.lock_ref == 0]
        heapq.heapify(heap)
        freed_values = []
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            if self.listener is not None:
                path = self._path(node)
                self.listener.evicted(path, len(path) - len(node.key))
            freed_values.append(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            if parent is not self.root and parent.is_leaf() and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        if freed_values:
            # One free call: one host sync for the whole eviction instead of one per leaf.
            self.allocator.free(torch.cat(freed_values))
        return freed

    # ---- internals -----------------------------------------------------------------------

    def _child_key(self, key: list[int]) -> int | tuple[int, ...]:
        # Children are told apart by their first page: siblings never share one.
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of a and b, rounded down to whole pages."""
        ps = self.page_size
        n = min(len(a), len(b))
        i = 0
        while i + ps <= n and a[i : i + ps] == b[i : i + ps]:
            i += ps
        return i

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Give child's first `at` tokens a new parent node; returns that new node."""
        new = TreeNode(child.parent, child.key[:at], child.value[:at])
        new.lock_ref = child.lock_ref  # a lock on child covers its ancestors, now `new` too
        new.last_access = child.last_access
        child.parent.children[self._child_key(child.key)] = new
        child.key = child.key[at:]
        child.value = child.value[at:]
        child.parent = new
        new.children[self._child_key(child.key)] = child
        return new

    def _add_leaf(self, parent: TreeNode, key: list[int], slots: torch.Tensor, now: int) -> None:
        leaf = TreeNode(parent, list(key), slots.clone())
        leaf.last_access = now
        parent.children[self._child_key(key)] = leaf
        self._evictable += len(key)

    def _path(self, node: TreeNode) -> list[int]:
        """The tokens from the root to the end of `node`."""
        keys = []
        while node is not self.root:
            keys.append(node.key)
            node = node.parent
        return [token for key in reversed(keys) for token in key]

    def _nodes(self) -> list[TreeNode]:
        """Every node except the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def cache_request_prefix(
    cache: RadixCache,
    allocator: PagedTokenAllocator,
    token_ids: list[int],
    slots: torch.Tensor,
    cached_len: int,
    locked_node: TreeNode,
) -> tuple[torch.Tensor, TreeNode]:
    """Hand a request's computed whole pages to the cache and re-point it at the tree's copy.

    token_ids / slots: the request's tokens that have KV, and their slots (its req_to_token
    row); only the page-aligned prefix of length n is cached. cached_len: how many leading
    tokens the request already took from the tree (locked through locked_node).

    Positions [cached_len, already) were inserted meanwhile by another request: the tree
    keeps its slots and this request's copies are freed. Positions [already, n) move to the
    tree. Returns the tree's slots for [0, n), which the caller writes into its row, and the
    node now locked for the request (the lock moves from locked_node to it). Slots past n
    (a partly filled last page) stay the request's.
    """
    n = min(len(token_ids), len(slots))
    n -= n % cache.page_size
    if n < cached_len:
        raise ValueError(f"cached_len {cached_len} exceeds the {n} page-aligned tokens with KV")
    key = list(token_ids[:n])
    already = cache.insert(key, slots[:n])
    if already > cached_len:
        allocator.free(slots[cached_len:already])
    match = cache.match_prefix(key)
    # Lock the new node before unlocking the old: their shared ancestors never drop to zero.
    cache.inc_lock_ref(match.last_node)
    cache.dec_lock_ref(locked_node)
    return match.slots, match.last_node
