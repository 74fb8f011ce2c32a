"""ReqToTokenPool, TokenToKVPool and PagedTokenAllocator: accounting and slot layout."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.memory.allocator import PagedTokenAllocator
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool

CPU = torch.device("cpu")


def pages_of(slots: torch.Tensor, page_size: int) -> set[int]:
    return set((slots // page_size).tolist())


# ---- PagedTokenAllocator -------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_and_free_return_every_page(page_size):
    alloc = PagedTokenAllocator(8 * page_size, page_size, CPU)
    assert alloc.available_size() == 8 * page_size
    slots = alloc.alloc_extend([0, 0], [page_size + 1, 2 * page_size], [0, 0])
    assert len(slots) == 3 * page_size + 1
    assert len(set(slots.tolist())) == len(slots)
    assert alloc.available_size() == (8 - 4) * page_size
    alloc.free(slots)
    assert alloc.available_size() == 8 * page_size


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_fresh_pages_are_filled_in_position_order(page_size):
    alloc = PagedTokenAllocator(8 * page_size, page_size, CPU)
    slots = alloc.alloc_extend([0], [3 * page_size], [0])
    pages = slots.view(3, page_size)
    # Position p sits at offset p % page_size of its page: the layout prefix sharing relies on.
    assert torch.equal(pages % page_size, torch.arange(page_size).expand(3, page_size))
    assert (pages // page_size == pages[:, :1] // page_size).all()


@pytest.mark.parametrize("page_size", [1, 16])
def test_padding_page_is_never_allocated(page_size):
    alloc = PagedTokenAllocator(4 * page_size, page_size, CPU)
    slots = alloc.alloc_extend([0], [4 * page_size], [0])
    assert 0 not in pages_of(slots, page_size)
    assert alloc.available_size() == 0
    with pytest.raises(RuntimeError):
        alloc.free(torch.tensor([0]))


@pytest.mark.parametrize("page_size", [1, 16])
def test_exhaustion_allocates_nothing(page_size):
    alloc = PagedTokenAllocator(4 * page_size, page_size, CPU)
    first = alloc.alloc_extend([0], [2 * page_size], [0])
    assert alloc.alloc_extend([0, 0], [page_size, 2 * page_size], [0, 0]) is None
    assert alloc.available_size() == 2 * page_size
    assert alloc.alloc_decode([0, 0, 0], [0, 0, 0]) is None
    assert alloc.available_size() == 2 * page_size
    alloc.free(first)
    assert alloc.available_size() == 4 * page_size


def test_extend_continues_in_partly_filled_last_page():
    page_size = 4
    alloc = PagedTokenAllocator(8 * page_size, page_size, CPU)
    first = alloc.alloc_extend([0], [6], [0])  # one full page + 2 tokens of the next
    free_before = alloc.available_size()
    more = alloc.alloc_extend([6], [5], [int(first[-1])])
    # Positions 6, 7 finish the partly filled page; 8, 9, 10 open one fresh page.
    assert more[:2].tolist() == [int(first[-1]) + 1, int(first[-1]) + 2]
    assert int(more[2]) % page_size == 0
    assert more[2:].tolist() == list(range(int(more[2]), int(more[2]) + 3))
    assert alloc.available_size() == free_before - page_size


def test_extend_inside_one_page_needs_no_new_page():
    alloc = PagedTokenAllocator(16, 4, CPU)
    first = alloc.alloc_extend([0], [1], [0])
    assert alloc.num_pages_needed(1, 2) == 0
    more = alloc.alloc_extend([1], [2], [int(first[0])])
    assert more.tolist() == [int(first[0]) + 1, int(first[0]) + 2]
    assert alloc.available_size() == 12


def test_decode_opens_a_page_only_at_page_boundaries():
    page_size = 4
    alloc = PagedTokenAllocator(8 * page_size, page_size, CPU)
    a = alloc.alloc_extend([0], [4], [0])  # full page: next position 4 opens a page
    b = alloc.alloc_extend([0], [2], [0])  # half page: next position 2 continues
    free_before = alloc.available_size()
    out = alloc.alloc_decode([4, 2], [int(a[-1]), int(b[-1])])
    assert int(out[0]) % page_size == 0 and int(out[0]) // page_size not in pages_of(a, 4)
    assert int(out[1]) == int(b[-1]) + 1
    assert alloc.available_size() == free_before - page_size


def test_decode_with_page_size_one_gives_distinct_fresh_slots():
    alloc = PagedTokenAllocator(8, 1, CPU)
    out = alloc.alloc_decode([3, 7, 1], [0, 0, 0])
    assert len(set(out.tolist())) == 3 and 0 not in out.tolist()
    assert alloc.available_size() == 5


def test_stale_last_slot_is_rejected():
    alloc = PagedTokenAllocator(16, 4, CPU)
    first = alloc.alloc_extend([0], [2], [0])
    with pytest.raises(ValueError):
        alloc.alloc_extend([2], [1], [int(first[0])])  # slot of position 0, not 1
    assert alloc.available_size() == 12  # the rejected call took no page


def test_num_pages_needed_counts_room_in_last_page():
    alloc = PagedTokenAllocator(64, 16, CPU)
    assert alloc.num_pages_needed(0, 0) == 0
    assert alloc.num_pages_needed(0, 1) == 1
    assert alloc.num_pages_needed(0, 16) == 1
    assert alloc.num_pages_needed(10, 6) == 0
    assert alloc.num_pages_needed(10, 7) == 1
    assert alloc.num_pages_needed(16, 17) == 2


@pytest.mark.parametrize("page_size", [1, 16])
def test_double_free_raises(page_size):
    alloc = PagedTokenAllocator(4 * page_size, page_size, CPU)
    slots = alloc.alloc_extend([0], [page_size], [0])
    alloc.free(slots)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(slots)
    assert alloc.available_size() == 4 * page_size


@pytest.mark.parametrize("page_size", [1, 4])
def test_pages_are_handed_out_in_the_order_they_became_free(page_size):
    alloc = PagedTokenAllocator(8 * page_size, page_size, CPU)
    a = alloc.alloc_extend([0], [3 * page_size], [0])
    b = alloc.alloc_extend([0], [2 * page_size], [0])
    alloc.free(a)
    alloc.free(b)
    assert alloc.available_size() == 8 * page_size
    again = alloc.alloc_extend([0], [8 * page_size], [0])
    pages = (again[::page_size] // page_size).tolist()  # in the order handed out
    assert pages[:3] == [6, 7, 8]  # never used, then a's run, then b's
    assert set(pages[3:6]) == pages_of(a, page_size)
    assert set(pages[6:]) == pages_of(b, page_size)
    assert alloc.available_size() == 0 and alloc.free_pages.tolist() == []


def test_freeing_a_partly_filled_page_frees_the_whole_page():
    alloc = PagedTokenAllocator(16, 4, CPU)
    slots = alloc.alloc_extend([0], [6], [0])
    alloc.free(slots[4:])
    assert alloc.available_size() == 12
    alloc.free(slots[:4])
    assert alloc.available_size() == 16


def test_clear_frees_everything():
    alloc = PagedTokenAllocator(16, 4, CPU)
    alloc.alloc_extend([0], [9], [0])
    alloc.clear()
    assert alloc.available_size() == 16
    assert len(alloc.alloc_extend([0], [16], [0])) == 16


# ---- ReqToTokenPool ------------------------------------------------------------------------


def test_req_pool_alloc_free_and_exhaustion():
    pool = ReqToTokenPool(2, 8, CPU)
    a, b = pool.alloc(), pool.alloc()
    assert {a, b} == {0, 1}
    assert pool.alloc() is None and pool.available_size() == 0
    pool.free(a)
    assert pool.available_size() == 1 and pool.alloc() == a
    pool.free(b)
    with pytest.raises(RuntimeError):
        pool.free(b)


def test_req_pool_write_fills_one_row_range():
    pool = ReqToTokenPool(2, 8, CPU)
    row = pool.alloc()
    pool.write(row, 2, torch.tensor([5, 6, 7]))
    assert pool.req_to_token[row].tolist() == [0, 0, 5, 6, 7, 0, 0, 0]
    assert pool.req_to_token.dtype == torch.int64
    with pytest.raises(IndexError):
        pool.write(row, 6, torch.tensor([1, 2, 3]))


# ---- TokenToKVPool -------------------------------------------------------------------------


def test_kv_pool_round_trip_casts_to_pool_dtype():
    pool = TokenToKVPool(8, 4, torch.bfloat16, num_layers=2, num_kv_heads=2, head_dim=3, device=CPU)
    assert len(pool.k_buffer) == 2 and pool.k_buffer[0].shape == (2, 12, 3)
    loc = torch.tensor([4, 9])
    k = torch.randn(2, 2, 3, dtype=torch.float32)
    v = torch.randn(2, 2, 3, dtype=torch.float32)
    pool.set_kv_buffer(1, loc, k, v)
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert k_buf.dtype == torch.bfloat16
    torch.testing.assert_close(k_buf[:, loc], k.to(torch.bfloat16).transpose(0, 1))
    torch.testing.assert_close(v_buf[:, loc], v.to(torch.bfloat16).transpose(0, 1))
    assert not pool.get_kv_buffer(0)[0].any()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_cpu_kv_pool_is_zeros_and_takes_memory_only_as_its_slots_are_written():
    """A 2 GiB pool: every slot reads zero, and only the pages written become resident
    (the CPU default of 2 GiB was written whole at start-up, ~0.5 s of each worker's)."""
    before = _resident_bytes()
    pool = TokenToKVPool(2**20, 16, torch.bfloat16, num_layers=4, num_kv_heads=2,
                         head_dim=64, device=CPU)  # fmt: skip
    assert _resident_bytes() - before < 64 * 2**20
    k, v = pool.get_kv_buffer(3)
    assert k.is_contiguous() and k.shape == (2, 2**20 + 16, 64) and k.dtype == torch.bfloat16
    assert not k[:, -1000:].any() and not v[:, :1000].any()
    loc = torch.tensor([16, 2**20 + 15])
    values = torch.randn(2, 2, 64)
    pool.set_kv_buffer(3, loc, values, -values)
    assert torch.equal(k[:, loc], values.to(torch.bfloat16).transpose(0, 1))
    assert torch.equal(v[:, loc], (-values).to(torch.bfloat16).transpose(0, 1))
    assert _resident_bytes() - before < 64 * 2**20


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads Linux's /proc")
def test_a_cpu_pool_larger_than_the_memory_available_is_refused_at_start():
    """Taken only as it fills, such a pool would start, and its worker be killed under load."""
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        Engine("random:tiny-llama", dtype="float32", kv_cache_memory_gb=2**20)


def test_kv_pool_bytes_per_token():
    assert TokenToKVPool.bytes_per_token(torch.float16, 30, 3, 64) == 2 * 30 * 3 * 64 * 2
    assert TokenToKVPool.bytes_per_token(torch.float32, 1, 1, 8) == 64
