"""specdec.models.gemv: the GEMV, its folded silu * up and its fp32 logits, against fp32 products of
the torch steps, under Triton's interpreter on the CPU and on a GPU; and the path elsewhere."""

from __future__ import annotations

import pytest
import torch

from interpreted import run_interpreted
from specdec.models import gemv, ops

_CHECKS = """
import torch
from specdec.models import gemv, ops


def tol(dtype):
    return dict(atol=2e-2, rtol=2e-2)


def check_all(device, dtypes):
    gen = torch.Generator(device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device)
    for dtype in dtypes:
        for m, n, k in ((1, 40, 300), (3, 33, 512), (4, 20, 64), (16, 64, 96), (19, 17, 200)):  # ragged; past a block
            w = (rand(n, k) / k ** 0.5).to(dtype)
            x = rand(m, k).to(dtype)
            ref = (x.float() @ w.float().T).to(dtype)
            torch.testing.assert_close(gemv.triton_linear(x, w), ref, **tol(dtype))
            logits = gemv.triton_linear(x, w, out_dtype=torch.float32)
            assert logits.dtype == torch.float32
            torch.testing.assert_close(logits, ref.float(), **tol(dtype))

            gate_up = rand(m, 2 * k).to(dtype)
            act = ops.silu_mul(gate_up)  # the torch path on the CPU, its kernel on a GPU
            torch.testing.assert_close(gemv.triton_silu_linear(gate_up, w), (act.float() @ w.float().T).to(dtype),
                                       **tol(dtype))
        try:
            gemv.triton_silu_linear(rand(2, 10).to(dtype), rand(4, 6).to(dtype))
        except ValueError as e:
            assert "weight (4, 6)" in str(e)
        else:
            raise AssertionError("a gate_up of the wrong width was taken")
"""


def test_gemv_under_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_CHECKS + "\ncheck_all('cpu', (torch.bfloat16,))\nprint('ok')\n")


@pytest.mark.gpu
def test_gemv_on_gpu():
    pytest.importorskip("triton")
    scope: dict = {}
    exec(_CHECKS, scope)
    scope["check_all"]("cuda", (torch.bfloat16, torch.float16))


def test_unfused_paths_are_the_torch_steps():
    """Where the GEMV does not serve (here: the CPU), each entry is the torch steps it fuses."""
    gen = torch.Generator().manual_seed(0)
    gate_up, w = torch.randn(3, 10, generator=gen), torch.randn(4, 5, generator=gen)
    torch.testing.assert_close(gemv.silu_linear(gate_up, w),
                               torch.nn.functional.linear(ops.silu_mul(gate_up), w), atol=0, rtol=0)
    x, w = torch.randn(3, 8, generator=gen).bfloat16(), torch.randn(5, 8, generator=gen).bfloat16()
    logits = gemv.linear(x, w, torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, torch.nn.functional.linear(x, w).float(), atol=0, rtol=0)
