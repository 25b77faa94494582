"""The MoE router's kernels (specdec/models/moe_router.py): router_logits' partial sums against
the fp32 GEMM, and triton_route against moe.route (ids exactly, the tie rule included; weights to
fp32 rounding), under Triton's interpreter on the CPU. Helpers and GPU checks: tests/test_moe.py.
"""

from __future__ import annotations

import pytest

from interpreted import run_interpreted


def test_router_kernel_under_triton_interpreter():
    """triton_route equals route: ids exactly (the tie rule included), weights to fp32 rounding."""
    pytest.importorskip("triton")
    run_interpreted("""
import torch
from specdec.models.config import DeepseekV3Config
from specdec.models.moe import route
from specdec.models.moe_router import triton_route
from test_moe import ROUTER_CONFIGS, router_logits

gen = torch.Generator().manual_seed(0)
for experts, groups, kept, top_k, norm in ROUTER_CONFIGS:
    cfg = DeepseekV3Config(n_routed_experts=experts, n_group=groups, topk_group=kept, num_experts_per_tok=top_k,
                           norm_topk_prob=norm)
    for kind in ("random", "zero", "groups", "pairs"):
        for bias in (torch.zeros(experts), (torch.randn(experts, generator=gen) * 4).round() / 32):
            if kind == "groups":  # the same bias in every group too
                bias = bias[:experts // groups].repeat(groups)
            logits = router_logits(kind, 5, experts, groups, gen)
            want_weights, want_ids = route(logits, bias, cfg)
            zeros = torch.zeros_like(logits)
            for given in (logits, torch.stack([zeros, logits, zeros])):  # partial sums: exactly the logits
                weights, ids = triton_route(given, bias, cfg)
                assert torch.equal(ids, want_ids), (experts, kind, ids, want_ids)
                torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
weights, ids = triton_route(torch.zeros(0, 8), torch.zeros(8), DeepseekV3Config(n_routed_experts=8, n_group=4,
                            topk_group=2, num_experts_per_tok=2))
assert weights.shape == ids.shape == (0, 2)
print("ok")
""")


def test_router_gemm_under_triton_interpreter():
    """router_logits' partial sums add up to the fp32 GEMM, over D below, at and past its chunks,
    at T past a tile; the logits of a token do not depend on the other tokens, nor on extra rows
    multiplied in the same launch (whose sums are their GEMM's); bad shapes refused."""
    pytest.importorskip("triton")
    run_interpreted("""
import pytest, torch
import torch.nn.functional as F
from specdec.models.moe_router import ROUTER_CHUNK, router_logits

gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for tokens, experts, hidden in ((1, 8, 72), (5, 64, ROUTER_CHUNK), (20, 12, 2 * ROUTER_CHUNK + 40), (0, 8, 64)):
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        w = torch.randn(experts, hidden, generator=gen).to(dtype)
        partial = router_logits(x, w)
        assert partial.shape == (-(-hidden // ROUTER_CHUNK), tokens, experts) and partial.dtype == torch.float32
        want = F.linear(x.float(), w.float())
        torch.testing.assert_close(partial.sum(0), want, rtol=1e-5, atol=1e-5 * hidden ** 0.5)
        if tokens > 1:
            assert torch.equal(router_logits(x[1:2], w), partial[:, 1:2])
        for more in (2, 17, 40):  # extra rows: their products after the router's, whose bits do not change
            extra = torch.randn(more, hidden, generator=gen).to(dtype)
            both = router_logits(x, w, extra)
            assert both.shape == (partial.shape[0], tokens, experts + more)
            assert torch.equal(both[..., :experts], partial)
            torch.testing.assert_close(both[..., experts:].sum(0), F.linear(x.float(), extra.float()), rtol=1e-5,
                                       atol=1e-5 * hidden ** 0.5)
for x, w in ((torch.zeros(2, 64), torch.zeros(8, 32)), (torch.zeros(2, 64), torch.zeros(8, 64).bfloat16()),
             (torch.zeros(64, 2).t(), torch.zeros(8, 64))):
    with pytest.raises(ValueError, match="router"):
        router_logits(x, w)
for extra in (torch.zeros(4, 32), torch.zeros(4, 64).bfloat16(), torch.zeros(64, 4).t()):
    with pytest.raises(ValueError, match="extra"):
        router_logits(torch.zeros(2, 64), torch.zeros(8, 64), extra)
print("ok")
""")


def test_route_refuses_other_inputs():
    """triton_route refuses, before any launch, logits other than fp32 of unit stride in E, a bias
    other than fp32 [E] of unit stride, experts that the groups do not divide (the config refuses a k
    past the kept groups itself)."""
    import torch
    from specdec.models.config import DeepseekV3Config
    from specdec.models.moe_router import triton_route

    cfg = DeepseekV3Config(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    logits, bias = torch.zeros(3, 8), torch.zeros(8)
    for bad_logits, bad_bias, bad_cfg in ((logits.double(), bias, cfg), (torch.zeros(8, 3).t(), bias, cfg),
                                          (logits, torch.zeros(8, 2)[:, 0], cfg), (logits, bias.half(), cfg),
                                          (logits, torch.zeros(7), cfg),
                                          (torch.zeros(3, 6), torch.zeros(6), cfg)):
        with pytest.raises(ValueError, match="expected fp32 logits"):
            triton_route(bad_logits, bad_bias, bad_cfg)
