"""attn.kernels.block_tables: the kernel against the torch expression it replaces (whole rows
gathered, every page_size-th column, divided), under Triton's interpreter on the CPU and on a
GPU; the docstring's example on the torch path."""

from __future__ import annotations

import pytest
import torch

from interpreted import run_interpreted, run_on_gpu

_CHECKS = """
import torch
from attn.kernels import block_tables as bt


def check_all(device):
    gen = torch.Generator().manual_seed(0)
    for context, page_size, rows in ((300, 1, [4, 0, 5]), (300, 16, [2]), (1000, 64, [0, 5, 5, 1]), (70, 4, [])):
        r2t = torch.randint(0, 50_000, (6, context), generator=gen, dtype=torch.int32)
        want = (r2t[rows][:, ::page_size] // page_size).int()
        got = bt.triton_block_tables(r2t.to(device), torch.tensor(rows, dtype=torch.long, device=device), page_size)
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), want), (context, page_size)
    assert bt.BLOCK_PAGES < 300  # the first case spans two programs a request
"""


def test_kernel_under_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_CHECKS + "\ncheck_all('cpu')\nprint('ok')\n")


@pytest.mark.gpu
def test_kernel_on_gpu():
    run_on_gpu(_CHECKS, 'check_all("cuda")')


def test_worked_example():
    from attn.kernels.block_tables import block_tables

    row = torch.tensor([[8, 9, 10, 11, 20, 21, 22, 23, 0, 0, 0, 0]], dtype=torch.int32)
    assert block_tables(row, torch.tensor([0]), 4).tolist() == [[2, 5, 0]]
