import numpy as np
import pytest
import torch

from specdec.kv import MLAKVPool, OutOfPagesError


def make_pool(num_pages=9, page_size=4):
    return MLAKVPool(num_layers=2, num_pages=num_pages, page_size=page_size, max_requests=3, max_context_len=16, dtype=torch.float32)


def test_slots_follow_pages_and_page_zero_is_never_handed_out():
    pool = make_pool()
    row = pool.alloc_request()
    pool.ensure_capacity(row, 10)
    slots = pool.req_to_token[row, :10]
    pages = slots // 4
    assert (pages > 0).all()
    assert torch.equal(slots % 4, torch.arange(10) % 4)
    # Every slot is on its page of the block table (req_to_token[:, ::page_size] // page_size).
    table = pool.req_to_token[row, ::4].long() // 4
    assert torch.equal(slots.long(), table.repeat_interleave(4)[:10] * 4 + torch.arange(10) % 4)
    assert len(set(pages.tolist())) == 3


def test_a_failed_slot_write_gives_the_pages_back(monkeypatch):
    """ensure_capacity_many is all or nothing when the req_to_token write fails too (a copy to the
    device: out of memory): free pages, capacities and block tables are unchanged, and the next
    call maps every page it hands out (none is left held but unmapped)."""
    pool = make_pool()
    a, b = pool.alloc_request(), pool.alloc_request()
    pool.ensure_capacity(a, 3)
    before = (pool.num_free_pages, pool.capacity.copy(), pool.req_to_token.clone())
    write = MLAKVPool._write_slots
    monkeypatch.setattr(MLAKVPool, "_write_slots", lambda self, writes: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        pool.ensure_capacity_many([a, b], [10, 6])
    assert pool.num_free_pages == before[0] and (pool.capacity == before[1]).all()
    assert torch.equal(pool.req_to_token, before[2])
    monkeypatch.setattr(MLAKVPool, "_write_slots", write)
    pool.ensure_capacity_many([a, b], [10, 6])
    assert (pool.req_to_token[[a, b], :6] // 4 > 0).all() and (pool.req_to_token[a, :10] // 4 > 0).all()
    assert len(set((pool.req_to_token[a, :10] // 4).tolist()) | set((pool.req_to_token[b, :6] // 4).tolist())) == 5


def test_exhaustion_is_all_or_nothing_and_free_returns_everything():
    pool = make_pool(num_pages=5)
    a, b = pool.alloc_request(), pool.alloc_request()
    pool.ensure_capacity(a, 12)  # 3 of 4 usable pages
    before = pool.num_free_pages
    with pytest.raises(OutOfPagesError, match="num_pages"):
        pool.ensure_capacity(b, 8)
    assert pool.num_free_pages == before
    pool.trim(a, 5)
    assert pool.num_free_pages == 2
    pool.free_request(a)
    pool.free_request(b)
    assert pool.num_free_pages == 4


def test_context_limit_and_row_limit():
    pool = make_pool()
    row = pool.alloc_request()
    with pytest.raises(ValueError, match="max_context_len"):
        pool.ensure_capacity(row, 17)
    pool.alloc_request(), pool.alloc_request()
    with pytest.raises(OutOfPagesError, match="max_batch_size"):
        pool.alloc_request()


def test_unknown_row_is_a_clear_error():
    pool = make_pool()
    with pytest.raises(KeyError, match="row 2 is not allocated"):
        pool.ensure_capacity(2, 4)


def test_growing_many_rows_is_one_all_or_nothing_write():
    pool = make_pool(num_pages=6)
    a, b, c = pool.alloc_request(), pool.alloc_request(), pool.alloc_request()
    pool.ensure_capacity(a, 3)
    pool.ensure_capacity_many([a, b], [9, 4])  # a grows by 2 pages, b gets 1
    assert pool.capacity[a] == 12 and pool.capacity[b] == 4 and pool.num_free_pages == 1
    for row, n in ((a, 9), (b, 4)):
        slots = pool.req_to_token[row, :n]
        assert torch.equal(slots % 4, torch.arange(n) % 4) and (slots // 4 > 0).all()
    assert len(set((pool.req_to_token[[a, a, a, b], [0, 4, 8, 0]] // 4).tolist())) == 4
    before = pool.req_to_token.clone()
    with pytest.raises(OutOfPagesError, match="need 2 more"):
        pool.ensure_capacity_many([b, c], [8, 4])  # 2 pages needed, 1 free: neither grows
    assert pool.num_free_pages == 1 and pool.capacity[b] == 4 and pool.capacity[c] == 0
    assert torch.equal(pool.req_to_token, before)
    pool.trim(a, 4)
    assert pool.capacity[a] == 4 and pool.num_free_pages == 3


def test_repeated_rows_and_negative_trims_are_refused_unchanged():
    """A row listed twice in ensure_capacity_many (its pages for both entries would be written past
    its own req_to_token row, into the next request's) and trim(row, -1) (which would free every
    page) are refused, leaving the tables, capacities and free pages as they were."""
    pool = make_pool(num_pages=9)
    a, b = pool.alloc_request(), pool.alloc_request()
    pool.ensure_capacity(b, 8)
    before = pool.req_to_token.clone()
    with pytest.raises(ValueError, match="rows repeat"):
        pool.ensure_capacity_many([a, a], [16, 16])
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        pool.trim(b, -1)
    assert torch.equal(pool.req_to_token, before) and pool.capacity[a] == 0 and pool.capacity[b] == 8
    assert pool.num_free_pages == 6


def test_grow_takes_pages_ahead_up_to_the_most_a_request_needs_and_gives_them_back():
    pool = make_pool(num_pages=8)  # 7 usable pages of 4
    a, b = pool.alloc_request(), pool.alloc_request()
    rows = np.array([a, b])
    pool.grow(rows, np.array([5, 2]), np.array([16, 6]))  # a: 2 pages + 2 ahead; b: 1 + 1, capped at 6 positions
    assert pool.capacity[a] == 16 and pool.capacity[b] == 8 and pool.num_free_pages == 1
    assert pool.spare_pages(rows, np.array([5, 2])) == 3
    pool.trim_many(rows, np.array([5, 2]))
    assert pool.capacity[a] == 8 and pool.capacity[b] == 4 and pool.num_free_pages == 4
    pool.grow(rows, np.array([9, 2]), np.array([16, 6]))  # a: 3 pages + 1 ahead (16 positions at most)
    assert pool.capacity[a] == 16 and pool.num_free_pages == 2
    pool.grow(rows, np.array([9, 16]), np.array([16, 16]))  # b needs 3 more, 2 free: a's grow-ahead comes back
    assert pool.capacity[a] == 12 and pool.capacity[b] == 16 and pool.num_free_pages == 0
    with pytest.raises(OutOfPagesError):
        pool.grow(rows, np.array([13, 16]), np.array([16, 16]))
    assert pool.capacity[a] == 12 and pool.num_free_pages == 0


def test_growth_inside_and_outside_inference_mode_writes_every_slot():
    """Page writes go through one reused staging buffer; growing from inside and then outside
    inference mode (an engine's step, then its admission) both land."""
    pool = MLAKVPool(1, 10, 4, 2, 16, torch.float32)
    row = pool.alloc_request()
    with torch.inference_mode():
        pool.ensure_capacity(row, 5)
    pool.ensure_capacity(row, 9)
    pages = pool.req_to_token[row, :12:4] // 4
    expected = (pages[:, None] * 4 + torch.arange(4)).flatten()
    assert torch.equal(pool.req_to_token[row, :12], expected.int())
    assert len(set(pages.tolist())) == 3 and 0 not in pages.tolist()


def test_returned_pages_positions_point_at_the_padding_page():
    """A stray write through a trimmed or freed position must reach page 0, never the page's next owner."""
    pool = make_pool()
    a = pool.alloc_request()
    pool.ensure_capacity(a, 12)
    pool.trim(a, 5)
    assert (pool.req_to_token[a, 8:12] == 0).all() and (pool.req_to_token[a, :8] // 4 > 0).all()
    pool.free_request(a)
    assert not pool.req_to_token[a].any()
