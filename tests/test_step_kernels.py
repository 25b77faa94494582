"""specdec.step_kernels: each kernel against the torch path it replaces (pass_slots: the index
ops of a uniform pass; chain_report: chain_accept, stop_at_limits and StepReport.pack;
rows_to_host: a copy into pinned memory; row_of_each: a gather; next_counts: the next N), under
Triton's interpreter on the CPU and on a GPU."""

from __future__ import annotations

import pytest
import torch

from interpreted import run_interpreted, run_on_gpu

_CHECKS = """
import torch
from specdec import step_kernels
from specdec.accept import chain_accept, stop_at_limits
from specdec.step import StepReport
from specdec.tree import VerifyTree


def reference_report(tokens, pred, seq_lens, limit, eos):
    z = torch.zeros_like(tokens)
    tree = VerifyTree(tokens, z, z, z, torch.zeros(*tokens.shape, tokens.shape[1], dtype=torch.bool))
    result = chain_accept(tree, pred, pred.shape[1] - 1)
    take, done = stop_at_limits(result, seq_lens, limit, eos)
    return result, StepReport.pack(result, take, done)


def check_all(device):
    gen = torch.Generator().manual_seed(0)
    r2t = torch.randint(0, 10_000, (6, 300), generator=gen, dtype=torch.int32).to(device)
    rows = torch.tensor([4, 0, 5], device=device)
    lens = torch.tensor([0, 17, 290], device=device)
    for first, q_len in ((0, 1), (1, 4), (0, 8), (3, 5)):
        loc, seq, index = step_kernels.triton_pass_slots(r2t, rows, lens, first, q_len)
        ref_loc, ref_seq, ref_index = step_kernels.pass_slots(r2t.cpu(), rows.cpu(), lens.cpu(), first, q_len)
        assert torch.equal(loc.cpu(), ref_loc) and loc.dtype == torch.int64, (first, q_len)
        assert torch.equal(seq.cpu(), ref_seq) and seq.dtype == torch.int32
        assert torch.equal(index.cpu(), ref_index) and index.dtype == torch.int64
        assert torch.equal(r2t.cpu()[rows.cpu().repeat_interleave(q_len), ref_index].long(), ref_loc)
    for steps in (1, 3, 6):
        bs = 64
        pred = torch.randint(0, 4, (bs, steps + 1), generator=gen)
        other = torch.randint(0, 4, (bs, steps), generator=gen)
        drafts = torch.where(torch.rand(bs, steps, generator=gen) < 0.7, pred[:, :-1], other)
        tokens = torch.cat([torch.randint(0, 4, (bs, 1), generator=gen), drafts], 1)
        seq_lens = torch.randint(10, 20, (bs,), generator=gen)
        limit = seq_lens + torch.randint(1, steps + 3, (bs,), generator=gen)
        eos = torch.where(torch.rand(bs, generator=gen) < 0.5, torch.randint(0, 4, (bs,), generator=gen), -1)
        ref, ref_report = reference_report(tokens, pred, seq_lens, limit, eos)
        got, report = step_kernels.chain_report(*(t.to(device) for t in (tokens, pred, seq_lens, limit, eos)))
        assert torch.equal(report.cpu(), ref_report), steps
        for name in ("accept_len", "path", "emitted", "bonus"):
            assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name
        assert set(ref.accept_len.tolist()) == set(range(steps + 1)) or steps == 6  # every length seen
        assert report[:, -1].bool().any() and not report[:, -1].bool().all()  # some stop, some go on
    got, report = step_kernels.chain_report(*(torch.tensor(v, device=device) for v in (
        [[4, 5, 6, 9]], [[5, 6, 7, 8]], [10], [100], [-1])))  # chain_report's docstring example
    assert report.tolist() == [[5, 6, 7, -1, 2, 3, 0]] and got.bonus.tolist() == [7]
    check_rows_to_host(device)
    check_copy_tensors(device)
    check_row_of_each(device)
    check_next_counts(device)


def check_next_counts(device):
    gen = torch.Generator().manual_seed(2)
    for bs in (1, 7, 1500):
        lens, counter = torch.randint(0, 5000, (bs,), generator=gen), torch.randint(1, 100, (bs,), generator=gen)
        columns = torch.randint(0, 4, (bs, 7), generator=gen)
        accept = columns[:, 4]  # a column, as accept_len is of the report
        rows = torch.randint(0, 3, (bs,), generator=gen)
        want = step_kernels.next_counts(lens, accept, counter, rows, 0)  # the torch path (CPU)
        assert torch.equal(want[0], torch.where(rows == 0, 0, lens + accept + 1)) and torch.equal(want[1], counter + 1)
        got = step_kernels.triton_next_counts(lens.to(device), columns.to(device)[:, 4], counter.to(device),
                                              rows.to(device), 0)
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want)), bs
    got = step_kernels.triton_next_counts(*(torch.tensor(v, device=device) for v in ([10, 3], [2, 1], [4, 4], [7, 0])),
                                          0)  # next_counts' docstring example
    assert [t.tolist() for t in got] == [[13, 0], [5, 5]]


def check_row_of_each(device):
    gen = torch.Generator().manual_seed(1)
    for bs, q_len, dim, dtype in ((3, 4, 7168, torch.bfloat16), (5, 1, 100, torch.float32), (2, 6, 9000, torch.float16)):
        x = torch.randn(bs * q_len, dim, generator=gen).to(dtype)
        columns = torch.randint(0, q_len, (bs, 3), generator=gen)
        index = columns[:, 1]  # a column, as accept_len is of the report
        want = x.view(bs, q_len, dim)[torch.arange(bs), index]
        assert torch.equal(step_kernels.row_of_each(x, q_len, index), want)  # the torch path (CPU)
        got = step_kernels.triton_row_of_each(x.to(device), q_len, columns.to(device)[:, 1])
        assert torch.equal(got.cpu(), want), (bs, q_len, dim)


def check_copy_tensors(device):
    # a DecodeState's six fields, of four dtypes and sizes past one block (hidden: 2 x 3000 bf16
    # = 12000 bytes), into the first rows of wider buffers; the buffers' other rows untouched
    gen = torch.Generator().manual_seed(1)
    srcs = [torch.randint(-9, 9, (2,), generator=gen), torch.randn(2, 3000, generator=gen).bfloat16(),
            torch.rand(2, 1, generator=gen), torch.randint(0, 9, (2, 1), generator=gen), torch.tensor([True, False]),
            torch.randint(0, 9, (2,), generator=gen).int()]
    srcs = [t.to(device) for t in srcs]
    bufs = [torch.full((5, *t.shape[1:]), 7, dtype=t.dtype, device=device) for t in srcs]
    before = [b.clone() for b in bufs]
    step_kernels.triton_copy_tensors([b[:2] for b in bufs], srcs)
    for b, old, t in zip(bufs, before, srcs):
        assert torch.equal(b[:2], t) and torch.equal(b[2:], old[2:]), t.dtype
    step_kernels.triton_copy_tensors([], [])  # nothing to copy
    for dsts, what in (([bufs[0][:2]] * 9, "9 pairs"), ([bufs[1][:2, :5]], "not contiguous"),
                       ([bufs[2][:2].double()], "dtype")):
        try:
            step_kernels.triton_copy_tensors(dsts, srcs[:len(dsts)] if len(dsts) < 9 else [srcs[0]] * 9)
        except ValueError as e:
            assert "copy_tensors" in str(e)
        else:
            raise AssertionError(what)


def check_rows_to_host(device):
    # rows of a wider tensor (row stride > width) land in the first rows of a pinned host buffer,
    # the rest of it untouched
    wide = torch.arange(3 * 11, dtype=torch.long, device=device).view(3, 11) - 7
    dst = torch.full((5, 6), 99, dtype=torch.long, pin_memory=device == "cuda")
    step_kernels.rows_to_host(wide[:, 2:8], dst)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst[:3], wide[:, 2:8].cpu()) and (dst[3:] == 99).all()
    step_kernels.rows_to_host(wide[:0, :6], dst)  # no rows: nothing written, no launch
    assert torch.equal(dst[:3], wide[:, 2:8].cpu())
"""


def test_kernels_under_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_CHECKS + "\ncheck_all('cpu')\nprint('ok')\n")


@pytest.mark.gpu
def test_kernels_on_gpu():
    run_on_gpu(_CHECKS, 'check_all("cuda")')


def test_worked_example():
    """pass_slots' docstring example, on its torch path."""
    from specdec import step_kernels

    r2t = torch.arange(40, dtype=torch.int32).view(2, 20)
    loc, seq, index = step_kernels.pass_slots(r2t, torch.tensor([1]), torch.tensor([7]), 1, 2)
    assert loc.tolist() == [28, 29] and seq.tolist() == [10] and index.tolist() == [8, 9]


def test_rows_to_host_refuses_what_it_cannot_write():
    from specdec import step_kernels

    src = torch.zeros(2, 4, dtype=torch.long)
    for dst, what in ((torch.zeros(1, 4, dtype=torch.long), "rows"), (torch.zeros(2, 5, dtype=torch.long), "width"),
                      (torch.zeros(4, 2, dtype=torch.long).t(), "contiguous"), (torch.zeros(2, 4), "dtype")):
        with pytest.raises(ValueError, match="rows_to_host"):
            step_kernels.rows_to_host(src, dst)
    with pytest.raises(ValueError, match="unit stride"):
        step_kernels.rows_to_host(torch.zeros(4, 2, dtype=torch.long).t(), torch.zeros(2, 4, dtype=torch.long))
