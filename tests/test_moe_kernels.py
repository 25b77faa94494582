"""The routed experts' kernels (specdec/models/moe_kernels.py) under Triton's interpreter on the
CPU, each against its torch counterpart or tests/test_moe.py's per-token reference: the layout
kernel, the combine, the grouped GEMM, the decode tail; and the refusals of the layout kernel,
the decode tail and the grouped GEMM. The whole Triton path and the GPU runs: tests/test_moe.py.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import run_interpreted


def test_layout_kernel_under_triton_interpreter():
    """triton_sort_into_blocks equals sort_into_blocks tensor for tensor."""
    pytest.importorskip("triton")
    run_interpreted("""
import torch
from specdec.models.moe_kernels import sort_into_blocks, triton_sort_into_blocks
from test_moe import LAYOUT_CASES

gen = torch.Generator().manual_seed(0)
for tokens, top_k, experts, block_m in LAYOUT_CASES:
    for kind in ("random", "one", "few"):
        ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
        if kind == "one":
            ids.fill_(experts - 1)
        if kind == "few":  # most experts unused
            ids = ids % 3 * (experts // 3)
        want, got = sort_into_blocks(ids, experts, block_m), triton_sort_into_blocks(ids, experts, block_m)
        for field in ("row_pair", "block_expert", "pair_row"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (tokens, top_k, experts, kind, field)
        assert (got.block_m, got.num_experts, got.top_k) == (block_m, experts, top_k)
print("ok")
""")


def test_layout_kernel_refuses_more_pairs_than_it_sorts():
    """Past LAYOUT_MAX_PAIRS a clear error before any launch, and MoE lays such ids out by torch."""
    from specdec.models.moe import layout_for
    from specdec.models.moe_kernels import LAYOUT_MAX_PAIRS, sort_into_blocks, triton_sort_into_blocks

    ids = torch.zeros(LAYOUT_MAX_PAIRS // 8 + 1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="lays out at most 4096 pairs"):
        triton_sort_into_blocks(ids, 64, 16)
    assert layout_for(ids, triton_sort_into_blocks) is sort_into_blocks
    assert layout_for(ids[:-1], triton_sort_into_blocks) is triton_sort_into_blocks


def test_combine_kernel_under_triton_interpreter():
    """triton_combine: the k rows summed in order, in fp32 (exactly), cast, plus the shared output."""
    pytest.importorskip("triton")
    run_interpreted("""
import torch
from specdec.models.moe_kernels import triton_combine

gen = torch.Generator().manual_seed(0)
for tokens, top_k, hidden in ((1, 8, 64), (5, 2, 1100), (3, 1, 72), (0, 8, 64)):
    per_pair = torch.randn(tokens * top_k + 1, hidden, generator=gen)[1:].view(tokens, top_k, hidden)  # a view
    routed = per_pair[:, 0].clone()
    for j in range(1, top_k):
        routed += per_pair[:, j]
    shared = torch.randn(tokens, hidden, generator=gen)
    assert torch.equal(triton_combine(per_pair, shared), routed + shared)
    # bf16 within one step of it: the interpreter truncates fp32 to bf16 where a GPU rounds to nearest
    got, want = triton_combine(per_pair, shared.bfloat16()), routed.bfloat16() + shared.bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6)
print("ok")
""")


def test_kernels_under_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted("""
import torch
from specdec.models.moe_kernels import grouped_experts, single_token_blocks, sort_into_blocks, tiles_for
from test_moe import assert_matches, make_moe, random_routing, reference

# D and I not powers of two (masked K and N tails); 16-row and 32-row blocks; k = 1, 2 and 8;
# unused blocks past those in use.
for dtype in (torch.float32, torch.bfloat16):
    for tokens, experts, top_k, n_group in ((1, 8, 2, 4), (5, 16, 8, 2), (40, 4, 2, 2), (30, 8, 1, 4)):
        moe = make_moe(dtype, hidden_size=72, moe_intermediate_size=40, n_routed_experts=experts,
                       num_experts_per_tok=top_k, n_group=n_group, topk_group=n_group)
        gen = torch.Generator().manual_seed(tokens)
        weights, ids = random_routing(tokens, top_k, experts, gen, avoid=(0,))
        if tokens == 30:
            ids.fill_(2)  # one expert, two blocks
        with torch.no_grad():  # nobody chose expert 0: its weights are never read
            moe.experts_gate_up[0].fill_(float("nan"))
            moe.experts_down[0].fill_(float("nan"))
        x = torch.randn(tokens, 72, generator=gen).to(dtype)
        tiles = tiles_for(ids.numel(), experts, 72, 40, dtype)
        blocks = sort_into_blocks(ids, experts, tiles.block_m)
        per_pair = grouped_experts(x, moe.experts_gate_up.detach(), moe.experts_down.detach(), weights, blocks, tiles)
        with torch.no_grad():
            got = per_pair.view(tokens, top_k, 72).sum(1).to(dtype) + moe.shared_experts(x)
        assert_matches(got, reference(moe, x, weights, ids), dtype)
        if tokens == 1:  # the unsorted single-token layout: the same rows, bit for bit
            single = single_token_blocks(ids, experts, tiles.block_m)
            assert torch.equal(grouped_experts(x, moe.experts_gate_up.detach(), moe.experts_down.detach(), weights,
                                               single, tiles), per_pair)
# Several K steps of kernel 1 with a masked tail (D 1100), in its one-wave tiles and (a 4-SM rule) its wide ones.
for dtype, sms in ((torch.float32, 132), (torch.bfloat16, 132), (torch.bfloat16, 4)):
    moe = make_moe(dtype, hidden_size=1100, moe_intermediate_size=40, n_routed_experts=8, num_experts_per_tok=2,
                   n_group=4, topk_group=4)
    gen = torch.Generator().manual_seed(sms)
    weights, ids = random_routing(2, 2, 8, gen, avoid=())
    x = torch.randn(2, 1100, generator=gen).to(dtype)
    tiles = tiles_for(ids.numel(), 8, 1100, 40, dtype, sms=sms)
    assert tiles.n1 == (16 if sms == 132 else 32) and 1100 > 2 * tiles.k1, tiles
    per_pair = grouped_experts(x, moe.experts_gate_up.detach(), moe.experts_down.detach(), weights,
                               sort_into_blocks(ids, 8, tiles.block_m), tiles)
    with torch.no_grad():
        got = per_pair.view(2, 2, 1100).sum(1).to(dtype) + moe.shared_experts(x)
    assert_matches(got, reference(moe, x, weights, ids), dtype)
print("ok")
""")


def test_decode_tail_under_triton_interpreter():
    """decode_tail against the torch reference of the launches it replaces (the pairs' down
    products weighted and summed in order, rounded, plus the shared expert's down projection of
    silu(gate) * up of the partials, rounded) and the per-token reference: one token's layout and a
    sorted one of 3 tokens, I past one K tile (300) and not a power of two, D not a multiple of the
    programs' 8 columns, k = 2 and 8, a repeated expert."""
    pytest.importorskip("triton")
    run_interpreted("""
import torch
from specdec.models import ops
from specdec.models.moe_kernels import decode_tail, grouped_gate_up, single_token_blocks, sort_into_blocks, tiles_for
from specdec.models.moe_router import router_logits
from test_moe import assert_matches, make_moe, reference

cases = ((72, 40, 2, [[5, 1]]), (1100, 300, 8, [[3, 0, 7, 3, 1, 2, 6, 5]]), (72, 40, 2, [[5, 1], [1, 4], [5, 5]]))
for hidden, inter, top_k, ids in cases:
    moe = make_moe(torch.bfloat16, hidden_size=hidden, moe_intermediate_size=inter, num_experts_per_tok=top_k,
                   n_group=4, topk_group=4).eval()
    gen = torch.Generator().manual_seed(hidden + len(ids))
    ids = torch.tensor(ids)
    tokens = ids.shape[0]
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    gate_up, down = moe.experts_gate_up.detach(), moe.experts_down.detach()
    shared_down = moe.shared_experts.down_proj.weight.detach()
    partials = router_logits(x, moe.gate.weight.detach(), moe.shared_experts.gate_up.detach())[..., 8:]
    tiles = tiles_for(ids.numel(), 8, hidden, inter, torch.bfloat16)
    blocks = (single_token_blocks if tokens == 1 else sort_into_blocks)(ids, 8, tiles.block_m)
    h = grouped_gate_up(x, gate_up, blocks, tiles)
    got = decode_tail(h, down, blocks, weights, partials, shared_down)
    rows = h[blocks.pair_row].float().view(tokens, top_k, inter)
    routed = torch.zeros(tokens, hidden)
    for j in range(top_k):
        routed += weights[:, j, None] * torch.einsum("ti,tdi->td", rows[:, j], down[ids[:, j]].float())
    act = ops.silu_mul(ops.summed_in_order(partials).bfloat16())
    want = (routed.bfloat16().float() + (act.float() @ shared_down.float().T).bfloat16().float()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, hidden)
    # a bf16 step apart at most: the fp32 sums in other orders, the interpreter's bf16 truncation
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    assert_matches(got, reference(moe, x, weights, ids), torch.bfloat16)
print("ok")
""")


def test_decode_tail_refuses_other_inputs(monkeypatch):
    """decode_tail launches for consistent inputs and refuses, before any launch, h not 16-bit or of
    other rows than the layout's, a layout for other experts, weights other than fp32 [T, k],
    partials other than fp32 [S, T, 2I_s] of one T and an even width, a shared down of another I_s."""
    from sm90_compile import Recorder
    from specdec.models import moe_kernels
    from specdec.models.moe_kernels import decode_tail, single_token_blocks

    launches = []
    monkeypatch.setattr(moe_kernels, "_decode_tail_kernel", Recorder(moe_kernels._decode_tail_kernel, launches))
    blocks = single_token_blocks(torch.tensor([[1, 2]]), 4, 16)
    good = dict(h=torch.zeros(32, 8, dtype=torch.bfloat16), down=torch.zeros(4, 64, 8, dtype=torch.bfloat16),
                blocks=blocks, weights=torch.ones(1, 2), shared_partials=torch.zeros(2, 1, 16),
                shared_down=torch.zeros(64, 8, dtype=torch.bfloat16))
    decode_tail(**good)
    assert len(launches) == 1
    for bad in (dict(shared_partials=torch.zeros(2, 2, 16)), dict(h=good["h"].float()),
                dict(h=torch.zeros(16, 8, dtype=torch.bfloat16)),
                dict(blocks=single_token_blocks(torch.tensor([[1, 2]]), 8, 16)),
                dict(weights=torch.ones(2, 1)), dict(shared_down=torch.zeros(64, 4, dtype=torch.bfloat16)),
                dict(shared_partials=torch.zeros(2, 1, 17)),
                dict(shared_partials=torch.zeros(2, 1, 16, dtype=torch.float64)),
                dict(weights=torch.ones(1, 2).double())):
        with pytest.raises(ValueError, match="decode_tail"):
            decode_tail(**{**good, **bad})
    assert len(launches) == 1


def test_grouped_gemm_refuses_other_inputs(monkeypatch):
    """grouped_experts and grouped_gate_up launch for consistent inputs and refuse, before any launch,
    a layout for another number of experts, of other blocks or of other tokens, gate_up of odd rows
    or another dtype, x of another D, and down or weights of other shapes."""
    from sm90_compile import Recorder
    from specdec.models import moe_kernels
    from specdec.models.moe_kernels import grouped_experts, grouped_gate_up, single_token_blocks, tiles_for

    launches = []
    for name in ("_gate_up_kernel", "_down_kernel"):
        monkeypatch.setattr(moe_kernels, name, Recorder(getattr(moe_kernels, name), launches))
    tiles = tiles_for(2, 4, 64, 8, torch.bfloat16)
    bf16 = dict(dtype=torch.bfloat16)
    good = dict(x=torch.zeros(1, 64, **bf16), gate_up=torch.zeros(4, 16, 64, **bf16),
                down=torch.zeros(4, 64, 8, **bf16), weights=torch.ones(1, 2),
                blocks=single_token_blocks(torch.tensor([[1, 2]]), 4, tiles.block_m), tiles=tiles)
    grouped_experts(**good)
    assert [kernel.fn.__name__ for kernel, _, _ in launches] == ["_gate_up_kernel", "_down_kernel"]
    bad_layouts = (dict(blocks=single_token_blocks(torch.tensor([[1, 2]]), 8, tiles.block_m)),
                   dict(blocks=single_token_blocks(torch.tensor([[1, 2]]), 4, 2 * tiles.block_m)),
                   dict(x=torch.zeros(2, 64, **bf16)),
                   dict(gate_up=torch.zeros(4, 15, 64, **bf16)), dict(gate_up=torch.zeros(4, 16, 64)),
                   dict(x=torch.zeros(1, 32, **bf16)))
    for bad in bad_layouts:
        for call in (grouped_experts, grouped_gate_up):
            args = {**good, **bad}
            if call is grouped_gate_up:
                args = {k: v for k, v in args.items() if k not in ("down", "weights")}
            with pytest.raises(ValueError, match="grouped experts"):
                call(**args)
    for bad in (dict(down=torch.zeros(4, 64, 4, **bf16)), dict(down=torch.zeros(4, 64, 8)),
                dict(weights=torch.ones(2, 1))):
        with pytest.raises(ValueError, match="grouped_experts"):
            grouped_experts(**{**good, **bad})
    assert len(launches) == 2
