"""specdec.models.ops: each Triton kernel against the torch path it replaces (the arithmetic
transformers' DeepSeek-V3 does; W_UK and W_UV against fp32 products), under Triton's interpreter
on the CPU and on a GPU."""

from __future__ import annotations

import pytest
import torch

from interpreted import run_interpreted, run_on_gpu
from specdec.models import ops

_CHECKS = """
import torch
from model_reference import norm_ref, rope_ref
from specdec.models import ops


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def in_order(parts):  # [S, ...] fp32 partial sums, first to last
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def check_all(device, dtypes, d=7168, q_rank=1536, heads=3, tokens=5, exact=True):
    # exact: the residual sum equals torch's bit for bit (the interpreter rounds to bf16 its own way)
    gen = torch.Generator(device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device)
    for dtype in dtypes:
        x, res = rand(tokens, d).to(dtype), rand(tokens, d).to(dtype)
        w = (1 + 0.2 * rand(d)).to(dtype)
        for residual in (None, res):
            out, h = ops.triton_rms_norm(x, w, 1e-6, residual)
            ref_h = x if residual is None else residual + x
            torch.testing.assert_close(h, ref_h, **(dict(atol=0, rtol=0) if exact else tol(dtype)))
            torch.testing.assert_close(out, norm_ref(ref_h, w, 1e-6), **tol(dtype))
        strided = rand(tokens, 2 * d).to(dtype)[:, ::2]  # not unit stride along rows' elements: the torch path
        torch.testing.assert_close(ops.rms_norm(strided, w, 1e-6)[0], norm_ref(strided, w, 1e-6), **tol(dtype))

        table, hidden = rand(50, d).to(dtype), rand(tokens, d).to(dtype)
        ids = torch.tensor([3, 0, 49, 3, 7][:tokens], device=device).repeat_interleave(2)[::2]  # stride 2
        hw = (1 + 0.2 * rand(d)).to(dtype)
        halves = (ops.triton_rms_norm(table[ids], w, 1e-6)[0], ops.triton_rms_norm(hidden, hw, 0.5)[0])
        assert ids.stride(0) == 2
        got = ops.triton_mtp_input(ids, table, hidden, w, hw, 1e-6, 0.5)
        torch.testing.assert_close(got, torch.cat(halves, dim=-1), atol=0, rtol=0)  # each half is rms_norm's kernel
        ref = torch.cat([norm_ref(table[ids], w, 1e-6), norm_ref(hidden, hw, 0.5)], dim=-1)
        torch.testing.assert_close(ops.mtp_input(ids, table, hidden, w, hw, 1e-6, 0.5), ref, **tol(dtype))
        normed, h = ops.triton_embed_norm(ids, table, w, 1e-6)  # rms_norm's kernel over the looked-up rows
        torch.testing.assert_close(h, table[ids], atol=0, rtol=0)
        torch.testing.assert_close(normed, ops.triton_rms_norm(table[ids], w, 1e-6)[0], atol=0, rtol=0)
        ref_n, ref_h = ops.embed_norm(ids.cpu(), table.cpu(), w.cpu(), 1e-6)  # the torch path
        torch.testing.assert_close(normed.cpu(), ref_n, **tol(dtype))
        assert not ops.triton_embed_norm(torch.tensor([50, -1], device=device), table, w, 1e-6)[1].any()
        unknown = ops.triton_mtp_input(torch.tensor([50, -1], device=device), table, hidden[:2], w, hw, 1e-6, 0.5)
        assert not unknown[:, :d].any()  # an id outside the table: a zero row, not another row's
        torch.testing.assert_close(unknown[:, d:], got[:2, d:], atol=0, rtol=0)

        gu = rand(tokens, 2 * 300).to(dtype)  # an intermediate that is no power of two
        gate, up = gu.float().chunk(2, dim=-1)
        torch.testing.assert_close(ops.triton_silu_mul(gu), (torch.nn.functional.silu(gate) * up).to(dtype), **tol(dtype))

        pos = torch.tensor([0, 1, 7, 300, 4095][:tokens], device=device)[:, None]
        inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2, device=device).float() / 64)
        freqs = pos.float() * inv_freq[None]
        cos, sin = freqs.cos(), freqs.sin()
        long_pos = torch.tensor([0, 1, 4095, 163839, 70000, 12345, 99] * 20, device=device)[::2]  # 70, stride 2
        for factor in (1.0, 0.7071):
            want = [f * factor for f in ((long_pos[:, None] * inv_freq).cos(), (long_pos[:, None] * inv_freq).sin())]
            for got, ref in zip(ops.triton_rope_cos_sin(long_pos, inv_freq, factor), want):
                torch.testing.assert_close(got, ref, **(dict(atol=0, rtol=0) if exact else dict(atol=1e-6, rtol=1e-5)))
        assert ops.triton_rope_cos_sin(long_pos[:0], inv_freq)[0].shape == (0, 32)
        for interleave in (True, False):
            for rank in (q_rank, 0):
                qkv = rand(tokens, (rank or heads * 192) + 576).to(dtype)
                width = rank or heads * 192
                q_norm = (1 + 0.2 * rand(rank)).to(dtype) if rank else None
                kv_norm = (1 + 0.2 * rand(512)).to(dtype)
                got_q, got_kv = ops.triton_mla_latents(qkv, width, q_norm, kv_norm, 1e-6, cos, sin, interleave)
                ref_q = qkv[:, :width] if q_norm is None else norm_ref(qkv[:, :width], q_norm, 1e-6)
                ref_kv = torch.cat([norm_ref(qkv[:, width:width + 512], kv_norm, 1e-6),
                                    rope_ref(qkv[:, -64:].float(), cos, sin, interleave).to(dtype)], dim=-1)
                torch.testing.assert_close(got_q, ref_q, **tol(dtype))
                torch.testing.assert_close(got_kv, ref_kv, **tol(dtype))
                cache = torch.full((9, 576), 7.0, device=device, dtype=dtype)  # the rows of a cache
                slots = torch.tensor([5, 0, 8, 2, 6][:tokens], device=device)
                for latents in (ops.triton_mla_latents, ops.mla_latents):  # the kernel, and what the device takes
                    cache.fill_(7.0)
                    _, kv = latents(qkv, width, q_norm, kv_norm, 1e-6, cos, sin, interleave, (cache, slots))
                    assert kv is None  # the rows went to the cache
                    want = got_kv if latents is ops.triton_mla_latents else ref_kv
                    torch.testing.assert_close(cache[slots], want, **(dict(atol=0, rtol=0) if latents is
                                                                      ops.triton_mla_latents else tol(dtype)))
                    untouched = torch.ones(9, dtype=torch.bool, device=device)
                    untouched[slots] = False
                    assert bool((cache[untouched] == 7.0).all())
                if rank and dtype != torch.float32:  # qkv as gemv.linear_parts' fp32 partial sums: their rounded sum
                    # (eighths add exactly: the interpreter rounds fp32 to 16 bits its own way; on a GPU, any values)
                    for parts in [(rand(3, tokens, qkv.shape[1]) * 8).round() / 8] + ([rand(2, tokens, qkv.shape[1])]
                                                                                     if device == "cuda" else []):
                        summed = in_order(parts).to(dtype)
                        for latents in (ops.triton_mla_latents, ops.mla_latents):
                            got = latents(parts, width, q_norm, kv_norm, 1e-6, cos, sin, interleave)
                            want = latents(summed, width, q_norm, kv_norm, 1e-6, cos, sin, interleave)
                            assert all(torch.equal(a, b) for a, b in zip(got, want)), (latents, dtype, interleave)
                            cache.fill_(7.0)
                            latents(parts, width, q_norm, kv_norm, 1e-6, cos, sin, interleave, (cache, slots))
                            assert torch.equal(cache[slots], want[1])
        if dtype != torch.float32:  # 16-bit only (fp32 takes the torch path)
            # (tokens, nope, v, latent): DeepSeek's dims; past one block of 16 tokens; v no multiple of 16
            for t, nope, v, latent in ((tokens, 128, 128, 512), (19, 128, 128, 512), (3, 64, 40, 256)):
                q = rand(t, heads, nope + 64).to(dtype)
                kv_b = rand(heads, nope + v, latent).to(dtype)
                w_uk, w_uv = (kv_b[:, :nope] / nope ** 0.5), (kv_b[:, nope:] / latent ** 0.5)  # kv_b_proj's rows
                rows = torch.arange(t, device=device) % tokens
                for interleave in (True, False):
                    q_latent = torch.einsum("thn,hnl->thl", q[..., :nope].float(), w_uk.float())  # a head: nope @ W_UK
                    rope = rope_ref(q[..., nope:].float(), cos[rows], sin[rows], interleave)
                    ref = torch.cat([q_latent, rope], -1).to(dtype)
                    for query in (ops.triton_mla_query, ops.mla_query):  # the kernel, and what the device takes
                        torch.testing.assert_close(query(q, w_uk, cos[rows], sin[rows], interleave), ref, **tol(dtype))
                out = rand(t, heads, latent).to(dtype)
                ref = torch.einsum("thl,hvl->thv", out.float(), w_uv.float()).flatten(1).to(dtype)  # [T, H * v]
                for value in (ops.triton_mla_value, ops.mla_value):
                    torch.testing.assert_close(value(out, w_uv), ref, **tol(dtype))
"""


def test_kernels_under_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_CHECKS + "\ncheck_all('cpu', (torch.float32, torch.bfloat16, torch.float16), d=1000, q_rank=96, tokens=4, exact=False)\nprint('ok')\n")


@pytest.mark.gpu
def test_kernels_on_gpu():
    run_on_gpu(_CHECKS, 'check_all("cuda", (torch.float32, torch.bfloat16, torch.float16))')


def test_rope_interleaved_pairs_rotate_as_complex_numbers():
    """x0 + i x1 times e^{i theta} is (x0 cos - x1 sin) + i (x1 cos + x0 sin): the evens, then the odds."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    theta = torch.tensor([[0.5, -1.25]])
    z = torch.complex(x[:, 0::2], x[:, 1::2]) * torch.polar(torch.ones_like(theta), theta)
    got = ops.apply_rope(x, theta.cos(), theta.sin(), interleave=True)
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], dim=-1))


def test_absorbed_products_refuse_mismatched_shapes():
    w_uk = torch.zeros(2, 16, 512)
    with pytest.raises(ValueError, match=r"q must be \[T, 2, 80\]"):
        ops.mla_query(torch.zeros(3, 2, 64), w_uk, torch.zeros(3, 32), torch.zeros(3, 32), True)
    with pytest.raises(ValueError, match=r"out must be \[T, 2, 512\]"):
        ops.mla_value(torch.zeros(3, 4, 512), torch.zeros(2, 16, 512))


def test_training_takes_the_torch_path_with_gradients():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    out, _ = ops.rms_norm(x, w, 1e-6)
    out.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_rms_norm_kernel_only_where_it_computes_torch_rules(monkeypatch):
    """Where the row kernel would not compute torch's rules (a residual that broadcasts, of another
    dtype, a weight of another dtype or shape), rms_norm takes the torch path on a Triton device too;
    its own inputs go to the kernel."""
    calls = []
    monkeypatch.setattr(ops, "on_triton", lambda *tensors: True)
    monkeypatch.setattr(ops, "triton_rms_norm", lambda *args: calls.append(args) or (args[0], args[0]))
    x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.rand(8, dtype=torch.bfloat16) + 0.5
    ops.rms_norm(x, w, 1e-6, torch.randn(3, 8, dtype=torch.bfloat16))
    assert len(calls) == 1
    for residual, weight in ((torch.randn(1, 8, dtype=torch.bfloat16), w), (torch.randn(3, 8), w),
                             (None, w.float()), (None, torch.ones(1, dtype=torch.bfloat16))):
        out, h = ops.rms_norm(x, weight, 1e-6, residual)
        want_h = x if residual is None else residual + x
        assert torch.equal(h, want_h) and torch.equal(out, ops._torch_rms_norm(want_h, weight, 1e-6))
    assert len(calls) == 1
