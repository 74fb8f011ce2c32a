"""RadixCache: page-granular matching, locking, LRU eviction and page conservation."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.memory.allocator import PagedTokenAllocator
from gpu_worker.memory.radix_cache import RadixCache, TreeNode, cache_request_prefix

CPU = torch.device("cpu")


def make_cache(page_size: int, num_pages: int = 32) -> tuple[RadixCache, PagedTokenAllocator]:
    allocator = PagedTokenAllocator(num_pages * page_size, page_size, CPU)
    return RadixCache(allocator, page_size), allocator


def alloc_and_insert(cache: RadixCache, allocator: PagedTokenAllocator, key: list[int]):
    """Allocate fresh slots for key and insert them, freeing the duplicates as a caller must;
    returns (slots, already)."""
    slots = allocator.alloc_extend([0], [len(key)], [0])
    already = cache.insert(key, slots)
    allocator.free(slots[:already])
    return slots, already


def tree_pages(cache: RadixCache) -> list[int]:
    pages, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        assert len(node.key) == len(node.value) and len(node.key) % cache.page_size == 0
        pages += sorted(set((node.value // cache.page_size).tolist()))
        stack.extend(node.children.values())
    return pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_returns_the_inserted_slots(page_size):
    cache, allocator = make_cache(page_size)
    key = list(range(3 * page_size))
    slots, already = alloc_and_insert(cache, allocator, key)
    assert already == 0
    match = cache.match_prefix(key + [99])
    assert torch.equal(match.slots, slots)
    assert match.last_node is not cache.root
    assert cache.match_prefix([99] + key).slots.numel() == 0


def test_key_differing_inside_a_page_matches_up_to_the_previous_boundary():
    cache, allocator = make_cache(4)
    key = list(range(12))
    slots, _ = alloc_and_insert(cache, allocator, key)
    other = key[:6] + [99] + key[7:]  # differs at position 6, inside the second page
    assert torch.equal(cache.match_prefix(other).slots, slots[:4])
    # A query shorter than a page, or a partial trailing page, never matches that page.
    assert cache.match_prefix(key[:3]).slots.numel() == 0
    assert torch.equal(cache.match_prefix(key[:11]).slots, slots[:8])


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_splits_at_page_boundary_and_reports_shared_prefix(page_size):
    cache, allocator = make_cache(page_size)
    a = list(range(4 * page_size))
    slots_a, _ = alloc_and_insert(cache, allocator, a)
    b = a[: 2 * page_size] + [100 + i for i in range(2 * page_size)]
    slots_b, already = alloc_and_insert(cache, allocator, b)
    assert already == 2 * page_size
    shared = cache.match_prefix(a[: 2 * page_size]).last_node
    assert len(shared.key) == 2 * page_size and len(shared.children) == 2
    # b's leading slots were duplicates: the tree kept a's copy.
    expected_b = torch.cat([slots_a[: 2 * page_size], slots_b[2 * page_size :]])
    assert torch.equal(cache.match_prefix(b).slots, expected_b)
    assert torch.equal(cache.match_prefix(a).slots, slots_a)
    assert cache.total_size() == 6 * page_size


def test_insert_of_a_key_already_present_returns_its_full_length():
    cache, allocator = make_cache(4)
    key = list(range(8))
    alloc_and_insert(cache, allocator, key)
    _, already = alloc_and_insert(cache, allocator, key)
    assert already == 8 and cache.total_size() == 8
    assert allocator.available_size() == (32 - 2) * 4


def test_insert_rejects_a_partial_page():
    cache, _ = make_cache(4)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4, 5], torch.arange(4, 9))


def test_insert_copies_slots_so_the_callers_row_can_change():
    cache, allocator = make_cache(1)
    row = allocator.alloc_extend([0], [3], [0])
    expected = row.clone()
    cache.insert([1, 2, 3], row)
    row.zero_()
    assert torch.equal(cache.match_prefix([1, 2, 3]).slots, expected)


def test_locked_nodes_survive_eviction_and_sizes_follow_locks():
    cache, allocator = make_cache(4)
    alloc_and_insert(cache, allocator, list(range(8)))
    alloc_and_insert(cache, allocator, list(range(4)) + [50, 51, 52, 53])
    locked = cache.match_prefix(list(range(8))).last_node
    cache.inc_lock_ref(locked)
    # The shared first page is locked through its child.
    assert cache.protected_size() == 8 and cache.evictable_size() == 4
    assert cache.evict(100) == 4
    assert cache.match_prefix(list(range(8))).slots.numel() == 8
    assert cache.total_size() == 8 and allocator.available_size() == (32 - 2) * 4
    cache.dec_lock_ref(locked)
    assert cache.protected_size() == 0 and cache.evictable_size() == 8
    assert cache.evict(100) == 8
    assert allocator.available_size() == 32 * 4
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(locked)


def test_evicts_least_recently_used_leaf_first():
    cache, allocator = make_cache(1)
    alloc_and_insert(cache, allocator, [1, 1])
    alloc_and_insert(cache, allocator, [2, 2])
    alloc_and_insert(cache, allocator, [3, 3])
    cache.match_prefix([1, 1])  # now [2, 2] is the least recently used
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).slots.numel() == 0
    assert cache.match_prefix([1, 1]).slots.numel() == 2
    assert cache.match_prefix([3, 3]).slots.numel() == 2
    # [1, 1] was matched before [3, 3] in the lines above, so it goes next.
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 1]).slots.numel() == 0
    assert cache.match_prefix([3, 3]).slots.numel() == 2


def test_eviction_climbs_to_parents_that_become_leaves():
    cache, allocator = make_cache(2)
    alloc_and_insert(cache, allocator, [1, 1, 2, 2])
    alloc_and_insert(cache, allocator, [1, 1, 3, 3])
    assert cache.evict(6) == 6
    assert cache.total_size() == 0 and allocator.available_size() == 64
    assert not cache.root.children


def test_cache_request_prefix_frees_duplicates_and_moves_the_lock():
    page_size = 4
    cache, allocator = make_cache(page_size)
    prompt = list(range(10))
    # Request A computes prompt[0:10]; request B computes the same prompt concurrently.
    slots_a = allocator.alloc_extend([0], [10], [0])
    slots_b = allocator.alloc_extend([0], [10], [0])
    free_before = allocator.num_free_pages()
    tree_a, node_a = cache_request_prefix(cache, allocator, prompt, slots_a, 0, cache.root)
    assert torch.equal(tree_a, slots_a[:8]) and node_a.lock_ref == 1
    tree_b, node_b = cache_request_prefix(cache, allocator, prompt, slots_b, 0, cache.root)
    # B's two whole pages were duplicates: freed, and B now reads A's pages.
    assert torch.equal(tree_b, slots_a[:8]) and node_b is node_a and node_a.lock_ref == 2
    assert allocator.num_free_pages() == free_before + 2
    assert cache.protected_size() == 8 and cache.evictable_size() == 0
    # Later, B has decoded to 13 tokens: caching again moves its lock deeper.
    more = allocator.alloc_extend([10], [3], [int(slots_b[9])])
    row_b = torch.cat([tree_b, slots_b[8:10], more])
    tokens_b = prompt + [70, 71, 72]
    tree_b2, node_b2 = cache_request_prefix(cache, allocator, tokens_b, row_b, 8, node_b)
    assert torch.equal(tree_b2, row_b[:12])
    assert node_a.lock_ref == 2 and node_b2.lock_ref == 1 and node_b2.parent is node_a


def test_cache_request_prefix_with_nothing_new_keeps_the_lock():
    cache, allocator = make_cache(4)
    slots = allocator.alloc_extend([0], [8], [0])
    tree, node = cache_request_prefix(cache, allocator, list(range(8)), slots, 0, cache.root)
    again, node2 = cache_request_prefix(cache, allocator, list(range(8)), tree, 8, node)
    assert node2 is node and node.lock_ref == 1 and torch.equal(again, tree)


class FakeRequest:
    """A request as the scheduler holds it: tokens with KV, a row of slots, a locked node."""

    def __init__(self, tokens: list[int], cache: RadixCache) -> None:
        self.tokens = tokens
        match = cache.match_prefix(tokens)
        cache.inc_lock_ref(match.last_node)
        self.node: TreeNode = match.last_node
        self.cached_len = self.kv_len = len(match.slots)
        self.row = match.slots.clone()

    def owned_pages(self, page_size: int) -> list[int]:
        return sorted(set((self.row[self.cached_len : self.kv_len] // page_size).tolist()))


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_operations_conserve_pages(page_size):
    rng = random.Random(1234)
    num_pages = 32
    cache, allocator = make_cache(page_size, num_pages)
    live: list[FakeRequest] = []
    common_pages = [[rng.randint(0, 2) for _ in range(page_size)] for _ in range(3)]

    def random_tokens(length: int) -> list[int]:
        # Mostly a few common pages (shared prefixes, splits), sometimes a page differing inside.
        tokens: list[int] = []
        while len(tokens) < length:
            if rng.random() < 0.8:
                tokens += rng.choice(common_pages)
            else:
                tokens += [rng.randint(0, 2) for _ in range(page_size)]
        return tokens[:length]

    def check_invariants() -> None:
        held = tree_pages(cache) + [p for r in live for p in r.owned_pages(page_size)]
        free = allocator.free_pages.tolist()
        # Every page is in exactly one place: free, in the tree, or owned by one request.
        assert sorted(held + free) == list(range(1, num_pages + 1))
        assert cache.total_size() == cache.evictable_size() + cache.protected_size()
        assert len(tree_pages(cache)) * page_size == cache.total_size()

    for _ in range(300):
        op = rng.random()
        if op < 0.3 and len(live) < 6:
            # Small vocabulary and short tokens: many shared prefixes and splits.
            length = rng.randint(1, 5 * page_size)
            live.append(FakeRequest(random_tokens(length), cache))
        elif op < 0.6 and live:
            req = rng.choice(live)
            # Often whole pages, so the common pages stay aligned; sometimes a ragged tail.
            num_new = rng.choice(
                [page_size - req.kv_len % page_size, rng.randint(1, 2 * page_size)]
            )
            last = int(req.row[req.kv_len - 1]) if req.kv_len % page_size else 0
            slots = allocator.alloc_extend([req.kv_len], [num_new], [last])
            if slots is None:
                cache.evict(num_new + page_size)
                slots = allocator.alloc_extend([req.kv_len], [num_new], [last])
            if slots is not None:
                req.row = torch.cat([req.row[: req.kv_len], slots])
                req.tokens = req.tokens[: req.kv_len] + random_tokens(num_new)
                req.kv_len += num_new
        elif op < 0.8 and live:
            req = rng.choice(live)
            tree_slots, req.node = cache_request_prefix(
                cache, allocator, req.tokens[: req.kv_len], req.row, req.cached_len, req.node
            )
            req.row[: len(tree_slots)] = tree_slots
            req.cached_len = len(tree_slots)
            if rng.random() < 0.5:  # finish: the partial last page goes back, the lock drops
                allocator.free(req.row[req.cached_len : req.kv_len])
                cache.dec_lock_ref(req.node)
                live.remove(req)
        else:
            before = {id(r): r.row[: r.cached_len].clone() for r in live}
            cache.evict(rng.randint(1, 4 * page_size))
            for r in live:  # locked prefixes are still whole in the tree
                assert torch.equal(
                    cache.match_prefix(r.tokens[: r.cached_len]).slots, before[id(r)]
                )
            assert cache.protected_size() >= max((r.cached_len for r in live), default=0)
        check_invariants()

    for req in live:
        allocator.free(req.row[req.cached_len : req.kv_len])
        cache.dec_lock_ref(req.node)
    live.clear()
    cache.evict(num_pages * page_size)
    assert cache.total_size() == 0 and allocator.num_free_pages() == num_pages
