"""specdec.models.gemv: the GEMV, its silu * up epilogue, its parts of K, its fp32 logits
and their greedy picks, against fp32 products of the torch steps and torch's argmax, under
Triton's interpreter on the CPU and on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
        for m, n, k in ((1, 40, 300), (3, 33, 512), (4, 20, 64), (16, 64, 96), (19, 17, 200), (32, 70, 256),
                        (40, 24, 128)):  # ragged; one 32-row block; two
            w = (rand(n, k) / k ** 0.5).to(dtype)
            x = rand(m, k).to(dtype)
            ref = (x.float() @ w.float().T).to(dtype)
            torch.testing.assert_close(gemv.triton_linear(x, w), ref, **TOL)
            logits = gemv.triton_linear(x, w, out_dtype=torch.float32)
            assert logits.dtype == torch.float32
            torch.testing.assert_close(logits, ref.float(), **TOL)
            assert torch.equal(logits, logits.to(dtype).float())  # rounded to x's dtype, then widened
            for parts in (2, 3):  # K in parts of 128 (a part past K adds nothing)
                got = gemv.triton_linear_parts(x, w, parts)
                assert got.shape == (parts, m, n) and got.dtype == torch.float32
                torch.testing.assert_close(ops.summed_in_order(got).to(dtype), ref, **TOL)

            # silu(gate) * up from the gate/up GEMM's epilogue: as silu_mul's kernel on its output (the GEMV's
            # bits: the same dots), n / 2 pairs of weight rows
            gu_w = torch.cat([w, (rand(n, k) / k ** 0.5).to(dtype)])
            want = ops.triton_silu_mul(gemv.triton_linear(x, gu_w))
            assert torch.equal(gemv.triton_linear_silu(x, gu_w), want), (m, n, k)
            if device == "cuda" and m <= gemv.GEMV_MAX_ROWS:
                assert torch.equal(gemv.linear_silu(x, gu_w), want)

        w, x = (rand(70, 512) / 512 ** 0.5).to(dtype), rand(gemv.PARTS_MAX_ROWS, 512).to(dtype)  # a verify's rows
        got = gemv.triton_linear_parts(x, w, 2)
        assert got.shape == (2, gemv.PARTS_MAX_ROWS, 70) and got.dtype == torch.float32
        torch.testing.assert_close(ops.summed_in_order(got).to(dtype), (x.float() @ w.float().T).to(dtype), **TOL)
        check_pick(rand, dtype)
        check_add_rows(rand, dtype)
        wide = lambda: gemv.triton_linear(rand(2, 10).to(dtype), rand(4, 6).to(dtype))
        odd = lambda: gemv.triton_linear_silu(rand(2, 6).to(dtype), rand(5, 6).to(dtype))
        for call, words in ((wide, "weight (4, 6)"), (odd, "[2I, K]")):
            try:  # a gate_up of the wrong width, of odd rows
                call()
            except ValueError as e:
                assert words in str(e)
            else:
                raise AssertionError(f"taken: {words}")

def check_add_rows(rand, dtype):
    # linear_add_rows: x @ w^T + table[ids] against the fp32 sum rounded once; an id outside the
    # table adds nothing.
    for m, n, k in ((1, 40, 300), (4, 20, 64), (16, 64, 96), (20, 70, 64)):
        w, x = (rand(n, k) / k ** 0.5).to(dtype), rand(m, k).to(dtype)
        table = rand(50, n).to(dtype)
        ids = torch.randint(0, 50, (m,), device=x.device)
        ids[0] = 50  # outside
        got = gemv.triton_linear_add_rows(x, w, table, ids)
        rows = torch.where((ids < 50)[:, None], table[ids.clamp(max=49)].float(), 0.0)
        torch.testing.assert_close(got, (x.float() @ w.float().T + rows).to(dtype), **TOL)
        assert torch.equal(got[0], gemv.triton_linear(x[:1], w)[0])  # no row added: the plain GEMV's bits
        strided = torch.stack([ids, torch.zeros_like(ids)], 1)[:, 0]  # ids of stride 2
        assert torch.equal(gemv.triton_linear_add_rows(x, w, table, strided), got)


def check_pick(rand, dtype):
    # linear_argmax: the logits as linear's, the picks' argmax as torch's over those logits (ties
    # inside a program and across programs to the lower column, NaN first) and their top-1 as
    # topk_probs' (a NaN or +inf row scores 0).
    from specdec.tree import topk_probs

    for m, n, k in ((1, 100, 64), (4, 300, 96), (16, 40, 32), (3, 16160 // 40, 64), (24, 100, 64)):
        w = (rand(n, k) / k ** 0.5).to(dtype)
        x = rand(m, k).to(dtype)
        w[5] = (x[0].float() * 4 / x[0].float().norm()).to(dtype)  # row 0's maximum (~4 against ~0.2)
        w[7] = w[5]  # tied inside the first program
        w[n - 1] = w[5]  # and across programs
        if m > 2:
            x[1] = 0
            x[1, 0] = float("inf")  # +inf / -inf / NaN logits in row 1
            x[2] = x[0]  # row 2 as row 0
        logits, pick = gemv.triton_linear_argmax(x, w)
        assert torch.equal(logits, gemv.triton_linear(x, w, out_dtype=torch.float32))
        assert torch.equal(pick.argmax(), logits.argmax(-1)), (m, n, k)
        assert logits[0, 5] == logits[0, 7] == logits[0, n - 1] == logits[0].max() and pick.argmax()[0] == 5
        probs, ids = pick.top1()
        want_p = topk_probs(logits, 1)[0]  # (torch's top-k breaks ties its own way: ids against argmax)
        finite = torch.isfinite(logits).all(-1)
        assert torch.equal(ids[:, 0], logits.argmax(-1))
        torch.testing.assert_close(probs[finite], want_p[finite], atol=1e-6, rtol=1e-5)
        assert (probs[~finite] == 0).all() and (want_p[~finite] == 0).all()
        out = torch.full((m,), -1, dtype=torch.long, device=x.device)
        assert pick.argmax(out=out) is out and torch.equal(out, logits.argmax(-1))
    w = torch.zeros(20, 8, dtype=dtype, device=x.device)
    w[3, 0], w[11, 0], w[12, 0] = float("nan"), 1.0, float("nan")  # NaN logits: the first NaN is the argmax
    logits, pick = gemv.triton_linear_argmax(torch.ones(1, 8, dtype=dtype, device=x.device), w)
    assert pick.argmax().tolist() == [3] == logits.argmax(-1).tolist() and pick.top1()[0].tolist() == [[0.0]]
"""


def test_gemv_under_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_CHECKS + "\ncheck_all('cpu', (torch.bfloat16,))\nprint('ok')\n")


@pytest.mark.gpu
def test_gemv_on_gpu():
    run_on_gpu(_CHECKS, 'check_all("cuda", (torch.bfloat16, torch.float16))')


def test_k_parts_fill_one_wave_where_the_tiles_do_not():
    """qkv_a's 33 tiles of 64 rows take 4 parts of K on 132 SMs, q_b's 48 two; weights whose
    64-row tiles fill the SMs (o_proj, the head) and the CPU path take none."""
    assert [gemv.k_parts(n, k) for n, k in ((2112, 7168), (3072, 1536), (7168, 2048), (16160, 7168))] == [4, 2, 1, 1]
    assert gemv.k_parts(2112, 512) == 2  # each part at least two K tiles
    x, w = torch.randn(3, 7168, dtype=torch.bfloat16), torch.randn(2112, 7168, dtype=torch.bfloat16)
    assert torch.equal(gemv.linear_parts(x, w), F.linear(x, w))  # no GEMV on the CPU: the product itself, no parts
    with pytest.raises(ValueError, match="at most 128 rows, not 129"):
        gemv.triton_linear_parts(torch.randn(129, 7168, dtype=torch.bfloat16), w, 4)


@pytest.mark.parametrize("rows", [1, gemv.GEMV_MAX_ROWS])
def test_gemv_compiles_for_sm90(monkeypatch, rows):
    """Without a GPU: the rank slice's layer GEMVs (qkv_a also in parts of K, gate_up also with its
    silu epilogue), its head with
    the greedy picks (and their reduce) and the MTP layer's eh_proj half with its table rows, at
    one row and at GEMV_MAX_ROWS (qkv_a's parts also at PARTS_MAX_ROWS), compile for H200, each within a
    block's shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    from sm90_compile import H200_SHARED_MEMORY, Recorder, compile_for_sm90

    launches = []
    monkeypatch.setattr(gemv, "_gemv_kernel", Recorder(gemv._gemv_kernel, launches))
    bf16 = dict(dtype=torch.bfloat16)
    for n, k in ((2112, 7168), (3072, 1536), (7168, 2048), (4608, 7168)):
        gemv.triton_linear(torch.empty(rows, k, **bf16), torch.empty(n, k, **bf16))
    gemv.triton_linear_parts(torch.empty(rows, 7168, **bf16), torch.empty(2112, 7168, **bf16), 4)
    if rows == gemv.GEMV_MAX_ROWS:  # and a verify's rows in one block
        gemv.triton_linear_parts(torch.empty(gemv.PARTS_MAX_ROWS, 7168, **bf16), torch.empty(2112, 7168, **bf16), 4)
    gemv.triton_linear(torch.empty(rows, 2304, **bf16), torch.empty(7168, 2304, **bf16))
    gemv.triton_linear_silu(torch.empty(rows, 7168, **bf16), torch.empty(4608, 7168, **bf16))
    monkeypatch.setattr(gemv, "_pick_kernel", Recorder(gemv._pick_kernel, launches))
    gemv.triton_linear_argmax(torch.empty(rows, 7168, **bf16), torch.empty(16160, 7168, **bf16))[1].top1()
    gemv.triton_linear_add_rows(torch.empty(rows, 7168, **bf16), torch.empty(7168, 7168, **bf16),
                                torch.empty(16160, 7168, **bf16), torch.zeros(rows, dtype=torch.long))
    assert len(launches) == (11 if rows == gemv.GEMV_MAX_ROWS else 10)
    for launch in launches:
        assert compile_for_sm90(*launch).metadata.shared <= H200_SHARED_MEMORY
