"""specdec.models.gemv: the GEMV, its folded silu * up (also from partial sums) and its fp32 logits,
against fp32 products of the torch steps, under Triton's interpreter on the CPU and on a GPU."""

from __future__ import annotations

import pytest
import torch

from interpreted import run_interpreted, run_on_gpu
from specdec.models import gemv

_CHECKS = """
import torch
from specdec.models import gemv, ops


TOL = dict(atol=2e-2, rtol=2e-2)


def check_all(device, dtypes):
    gen = torch.Generator(device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device)
    for dtype in dtypes:
        for m, n, k in ((1, 40, 300), (3, 33, 512), (4, 20, 64), (16, 64, 96), (19, 17, 200)):  # ragged; past a block
            w = (rand(n, k) / k ** 0.5).to(dtype)
            x = rand(m, k).to(dtype)
            ref = (x.float() @ w.float().T).to(dtype)
            torch.testing.assert_close(gemv.triton_linear(x, w), ref, **TOL)
            logits = gemv.triton_linear(x, w, out_dtype=torch.float32)
            assert logits.dtype == torch.float32
            torch.testing.assert_close(logits, ref.float(), **TOL)
            assert torch.equal(logits, logits.to(dtype).float())  # rounded to x's dtype, then widened

            gate_up = rand(m, 2 * k).to(dtype)
            act = ops.silu_mul(gate_up)  # the torch path on the CPU, its kernel on a GPU
            torch.testing.assert_close(gemv.triton_silu_linear(gate_up, w), (act.float() @ w.float().T).to(dtype),
                                       **TOL)
            # The gate/up GEMM as partial sums (a column slice, as router_logits' extra columns): their
            # in-order sum, rounded, is the input. Eighths add exactly (the interpreter rounds fp32 to
            # 16 bits its own way); on a GPU, any values.
            eighths = [(rand(splits, m, 2 * k + 8) * 8).round() / 8 for splits in (1, 3)]
            for parts in eighths + ([rand(3, m, 2 * k + 8)] if device == "cuda" else []):
                parts, splits = parts[..., 8:], parts.shape[0]
                want = gemv.triton_silu_linear(gemv.summed_in_order(parts).to(dtype), w)
                assert torch.equal(gemv.triton_silu_linear_partials(parts, w), want), (m, n, k, splits)
                if device == "cuda":
                    assert torch.equal(gemv.silu_linear_partials(parts, w), want)
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
    run_on_gpu(_CHECKS, 'check_all("cuda", (torch.bfloat16, torch.float16))')


@pytest.mark.parametrize("rows", [1, gemv.GEMV_MAX_ROWS])
def test_gemv_compiles_for_sm90(monkeypatch, rows):
    """Without a GPU: the rank slice's layer GEMVs (the down one with its silu fold) at one row and
    at GEMV_MAX_ROWS compile for H200, each within a block's shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    from sm90_compile import H200_SHARED_MEMORY, Recorder, compile_for_sm90

    launches = []
    monkeypatch.setattr(gemv, "_gemv_kernel", Recorder(gemv._gemv_kernel, launches))
    bf16 = dict(dtype=torch.bfloat16)
    for n, k in ((2112, 7168), (3072, 1536), (7168, 2048), (4608, 7168)):
        gemv.triton_linear(torch.empty(rows, k, **bf16), torch.empty(n, k, **bf16))
    gemv.triton_silu_linear(torch.empty(rows, 2 * 2304, **bf16), torch.empty(7168, 2304, **bf16))
    assert len(launches) == 5
    for launch in launches:
        assert compile_for_sm90(*launch).metadata.shared <= H200_SHARED_MEMORY
