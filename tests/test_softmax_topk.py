"""specdec.softmax_topk: the draft's fused softmax and top-k against topk_probs' torch path, on
rows with ties, infinities, NaN and tiny temperatures, under Triton's interpreter and on a GPU."""

from __future__ import annotations

import pytest

from interpreted import run_interpreted, run_on_gpu

_CHECKS = """
import torch
from specdec import softmax_topk
from specdec.sampling import tempered


def reference(x, k, temperature):
    if temperature is None:
        probs, ids = torch.softmax(x.float(), -1).topk(k, -1)
        return probs.nan_to_num(nan=0.0), ids
    return torch.softmax(tempered(x, temperature), -1).topk(k, -1)


def check_all(device, shapes):
    inf, nan = float("inf"), float("nan")
    gen = torch.Generator().manual_seed(0)
    temperatures = (None, torch.tensor([0.0, 1.0, 0.5, 2.0, 1e-44, 0.7], device=device))
    for vocab, k in shapes:
        x = (torch.randn(6, vocab, generator=gen) * 3).to(device)
        x[1, 1] = x[1].max() + 1
        x[1, 3] = x[1, 1]  # a tie at the top
        x[2] = -inf
        x[3, 2] = inf
        x[4, 1] = nan
        x[5, vocab // 2] = x[5, vocab - 1] = inf
        for dtype in (torch.float32, torch.bfloat16):
            for temperature in temperatures:
                probs, ids = softmax_topk.triton_softmax_topk(x.to(dtype), k, temperature)
                ref_probs, ref_ids = reference(x.to(dtype), k, temperature)
                torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=1e-5)
                distinct = (ref_probs[:, :, None] == ref_probs[:, None, :]).sum(-1) == 1
                real = distinct & (ref_probs > 0)  # where the reference's order is defined
                assert torch.equal(ids[real], ref_ids[real]), (vocab, k, temperature)
                assert ids[1, 0] == 1 and (k == 1 or ids[1, 1] == 3)  # ties: the lower id first
                assert all(len(set(row)) == k for row in ids.tolist())  # k distinct ids, -inf rows too
                if temperature is not None:
                    assert ids[5, 0] == vocab // 2 and probs[5, 0] == 0.5  # two +inf tokens share the row
                    assert torch.allclose(probs[2], torch.full((k,), 1.0 / vocab, device=device))
"""


def test_kernel_under_triton_interpreter():
    pytest.importorskip("triton")
    # 1024-logit chunks: the rows of 5000 and 4096 merge several (the GPU's default chunk holds 16160)
    run_interpreted(_CHECKS + "\nfrom specdec import softmax_topk\nsoftmax_topk.CHUNK = 1024\n"
                    "check_all('cpu', ((5, 2), (300, 1), (5000, 4), (4096, 16), (17, 3)))\nprint('ok')\n")


@pytest.mark.gpu
def test_kernel_on_gpu():
    run_on_gpu(_CHECKS, 'check_all("cuda", ((5, 2), (256, 1), (256, 4), (16160, 1), (16160, 4), (129280, 8), (4096, 16)))')

