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
    assert torch.equal(pages[::4], pages[torch.arange(0, 10, 4)])  # block table = req_to_token[:, ::page_size] // page_size
    assert len(set(pages.tolist())) == 3


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
    with pytest.raises(OutOfPagesError, match="max_requests"):
        pool.alloc_request()


def test_unknown_row_is_a_clear_error():
    pool = make_pool()
    with pytest.raises(KeyError, match="row 2 is not allocated"):
        pool.ensure_capacity(2, 4)
