"""benchmarks/mla_sparse.py's host-side parts on the CPU: the drawn selections and the target's verdict
(the timing needs a GPU; the V3.2 fp8 rows it times FlashMLA over: tests/test_flashmla_sparse_seam.py)."""

import math

import torch

from benchmarks.mla_sparse import PAGE_SIZE, draw_slots, targets


def test_selections_are_distinct_positions_of_each_tokens_own_request():
    g = torch.Generator().manual_seed(1)
    pages = torch.tensor([[5, 2, 7], [0, 3, 6]], dtype=torch.int32)  # 2 requests of 3 pages (192 tokens)
    slots = draw_slots(pages, 150, 2, 64, g)
    assert slots.shape == (4, 64) and slots.dtype == torch.int32
    for token in range(4):
        table = pages[token // 2].tolist()  # tokens 0-1 are request 0's, 2-3 request 1's
        chosen = slots[token].tolist()
        assert len(set(chosen)) == 64 and {s // PAGE_SIZE for s in chosen} <= set(table)
        assert max(table.index(s // PAGE_SIZE) * PAGE_SIZE + s % PAGE_SIZE for s in chosen) < 150  # within context
    short = draw_slots(pages, 40, 1, 64, g)  # a context shorter than topk: all 40 rows, then -1
    assert (short[:, 40:] == -1).all()
    assert sorted(short[0, :40].tolist()) == [int(pages[0, 0]) * PAGE_SIZE + i for i in range(40)]


def test_the_target_is_flashmlas_speed_where_it_ran():
    assert targets(dict(speedup_vs_flashmla=1.0)) == "flashmla:yes"
    assert targets(dict(speedup_vs_flashmla=0.99)) == "flashmla:no"
    assert targets(dict(speedup_vs_flashmla=math.nan)) == "-"
