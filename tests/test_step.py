"""The spec step's report to the host: packed on the device into one int64 row a request,
unpacked on the host into the fields finish_step reads."""

from __future__ import annotations

import numpy as np
import torch

from specdec.accept import AcceptResult
from specdec.step import StepReport


def test_a_report_round_trips_through_its_packed_rows():
    # num_steps 3: request 0 accepted two drafts and stops at an eos bonus; request 1 accepted none.
    result = AcceptResult(accept_len=torch.tensor([2, 0]), path=torch.tensor([[0, 1, 3, 3], [0, 0, 0, 0]]),
                          emitted=torch.tensor([[11, 12, 2, -1], [7, -1, -1, -1]]), bonus=torch.tensor([2, 7]))
    packed = StepReport.pack(result, take=torch.tensor([3, 1]), done=torch.tensor([True, False]))
    assert packed.dtype == torch.long and packed.shape == (2, StepReport.width(3))
    assert packed.tolist() == [[11, 12, 2, -1, 2, 3, 1], [7, -1, -1, -1, 0, 1, 0]]
    report = StepReport.unpack(packed.numpy())
    assert report.emitted.tolist() == result.emitted.tolist()
    assert (report.accept_len.tolist(), report.take.tolist(), report.done.tolist()) == ([2, 0], [3, 1], [1, 0])
    assert all(np.shares_memory(field, packed.numpy()) for field in vars(report).values())  # views, no copies
