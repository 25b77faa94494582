"""The routed MoE (specdec/models/moe.py) and its kernels (specdec/models/moe_kernels.py; each
kernel under the interpreter: test_moe_kernels.py).

Reference: a loop over tokens and their chosen experts in fp32, from the checkpoint's per-expert
tensors (the state dict's names): weight * down_e(silu(gate_e x) * up_e x), plus the shared
expert. Routings are forced (the router patched) to reach the layout's edge cases: ties, one
expert for every token, experts nobody chose, one token, more pairs than a block, k = 1 and 8.
The router's rule is checked by hand on ties; each kernel equals its torch counterpart (the
router's choice and the layout exactly, on logits quantised so that scores tie exactly or differ
by far more than an ulp). CPU: the torch path (forward and backward) and the block layout; the
Triton kernels, and the whole Triton path, under the interpreter (their compile for sm_90: test_moe_compile.py).
GPU (marked ``gpu``): the Triton path at a DeepSeek-like size, the kernels against the torch
path on the GPU, and CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from interpreted import run_interpreted
from specdec.models import moe as moe_module, ops
from specdec.models.config import DeepseekV3Config
from specdec.models.moe import MoE, route
from specdec.models.moe_kernels import max_blocks, sort_into_blocks, tiles_for

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64,
             qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             n_group=4, topk_group=2, first_k_dense_replace=0, max_position_embeddings=256)


def make_moe(dtype=torch.float32, device="cpu", seed=0, **overrides) -> MoE:
    """A MoE with unit-scale weights (1/sqrt(fan_in)), so every expert visibly changes the output."""
    torch.manual_seed(seed)
    moe = MoE(DeepseekV3Config(**{**SMALL, **overrides}), dtype=dtype, device=device)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    return moe


def reference(moe: MoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The MoE of x ``[T, D]`` routed by (weights, ids) ``[T, k]``, token by token, in fp32 on x's device."""
    w = {name: t.detach().float() for name, t in moe.state_dict().items()}
    x, weights = x.detach().float(), weights.detach().float()

    def mlp(prefix: str, v: torch.Tensor) -> torch.Tensor:
        h = F.silu(w[prefix + "gate_proj.weight"] @ v) * (w[prefix + "up_proj.weight"] @ v)
        return w[prefix + "down_proj.weight"] @ h

    out = torch.stack([mlp("shared_experts.", v) for v in x])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += weights[t, j] * mlp(f"experts.{int(ids[t, j])}.", x[t])
    return out.cpu()


def random_routing(tokens: int, top_k: int, experts: int, gen: torch.Generator, avoid: tuple[int, ...] = ()):
    """Distinct experts per token (none of ``avoid``), random positive weights: ([T, k] fp32, [T, k] int64)."""
    allowed = torch.tensor([e for e in range(experts) if e not in avoid])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=gen) + 0.1, ids


def forced(monkeypatch, moe: MoE, weights: torch.Tensor, ids: torch.Tensor) -> None:
    monkeypatch.setattr(moe.gate, "forward", lambda x: (weights.to(x.device), ids.to(x.device)))


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol * want.abs().max().item())


# ------------------------------------------------------------------------------- layout
def test_layout_of_the_docstring_example():
    blocks = sort_into_blocks(torch.tensor([[2, 0], [2, 2]]), num_experts=3, block_m=2)
    assert blocks.row_pair.tolist() == [1, 4, 0, 2, 3, 4, 4, 4]
    assert blocks.block_expert.tolist() == [0, 2, 2, 3]
    assert blocks.pair_row.tolist() == [2, 0, 3, 4]


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 8, 64, 16), (5, 2, 8, 16), (40, 1, 8, 16),
                                                          (64, 8, 16, 32), (300, 8, 256, 16), (3, 4, 4, 64)])
def test_layout_invariants(tokens, top_k, experts, block_m):
    """Each pair in one row, rows of a block one expert's in pair order, padding and unused blocks
    marked, and the static bound on blocks holds with every used block non-empty."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    if tokens == 40:
        ids.fill_(3)
    blocks = sort_into_blocks(ids, experts, block_m)
    pairs = tokens * top_k
    assert blocks.num_blocks == max_blocks(pairs, experts, block_m)
    assert blocks.row_pair[blocks.pair_row].tolist() == list(range(pairs))
    flat = ids.flatten()
    rows = blocks.row_pair.view(-1, block_m)
    used = blocks.block_expert < experts
    assert used.sum() == sum(-(-int((flat == e).sum()) // block_m) for e in range(experts))
    assert used[:int(used.sum())].all()  # the used blocks lead
    for b, expert in enumerate(blocks.block_expert.tolist()):
        real = rows[b][rows[b] < pairs]
        if expert == experts:
            assert real.numel() == 0
        else:
            assert real.numel() > 0 and (flat[real] == expert).all() and (real.diff() > 0).all()


def test_single_token_layout():
    """One token's layout: the docstring's example, every pair in its own block of its expert,
    padding marked, the constants built once, the same per-pair outputs as the sorted layout's
    (a repeated expert included), and bad ids refused."""
    from specdec.models.moe_kernels import single_token_blocks

    blocks = single_token_blocks(torch.tensor([[5, 1]]), num_experts=8, block_m=2)
    assert blocks.row_pair.tolist() == [0, 2, 1, 2] and blocks.pair_row.tolist() == [0, 2]
    assert blocks.block_expert.tolist() == [5, 1] and blocks.num_blocks == 2 and blocks.top_k == 2
    again = single_token_blocks(torch.tensor([[3, 0]]), num_experts=8, block_m=2)
    assert again.row_pair is blocks.row_pair and again.block_expert.tolist() == [3, 0]
    moe = make_moe(num_experts_per_tok=3, n_group=4, topk_group=4)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    for ids in (torch.tensor([[6, 2, 4]]), torch.tensor([[3, 3, 1]])):
        weights = torch.tensor([[0.5, 0.3, 0.2]])
        sorted_out, single_out = (moe_module.grouped_experts_torch(x, moe.experts_gate_up, moe.experts_down, weights,
                                                                   layout(ids, 8, 16))
                                  for layout in (sort_into_blocks, single_token_blocks))
        torch.testing.assert_close(single_out, sorted_out, rtol=0, atol=0)
    for bad in (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(1, 3, dtype=torch.int32),
                torch.zeros(1, 9, dtype=torch.int64)):
        with pytest.raises(ValueError, match="single_token_blocks"):
            single_token_blocks(bad, 8, 16)


# ------------------------------------------------------------------- torch path (CPU)
CASES = {  # name: (tokens, config overrides, routing)
    "random": (7, {}, "random"),
    "one-token": (1, {}, "random"),
    "one-expert-many-blocks": (40, dict(num_experts_per_tok=1), "one"),
    "unchosen-expert": (6, {}, "avoid"),
    "k1": (9, dict(num_experts_per_tok=1), "random"),
    "k8": (5, dict(n_routed_experts=16, num_experts_per_tok=8, n_group=2, topk_group=2), "random"),
    "k8-many-tokens": (24, dict(n_routed_experts=16, num_experts_per_tok=8, n_group=2, topk_group=2), "random"),
}


def routing_for(kind: str, tokens: int, moe: MoE, gen: torch.Generator):
    cfg = moe.gate.cfg
    k, experts = cfg.num_experts_per_tok, cfg.n_routed_experts
    if kind == "one":
        return torch.rand(tokens, k, generator=gen) + 0.1, torch.full((tokens, k), 5)
    return random_routing(tokens, k, experts, gen, avoid=(0, 3) if kind == "avoid" else ())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_reference(monkeypatch, case, dtype):
    tokens, overrides, kind = CASES[case]
    moe = make_moe(dtype, **overrides)
    gen = torch.Generator().manual_seed(1)
    weights, ids = routing_for(kind, tokens, moe, gen)
    if kind == "avoid":  # an expert nobody chose is never read
        with torch.no_grad():
            moe.experts_gate_up[0].fill_(float("nan"))
            moe.experts_down[3].fill_(float("nan"))
    x = torch.randn(tokens, 64, generator=gen).to(dtype)
    forced(monkeypatch, moe, weights, ids)
    with torch.no_grad():
        got = moe(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert_matches(got, reference(moe, x, weights, ids), dtype)


def test_tied_scores_through_the_router():
    """Zero router weights: every score ties; whatever the router picks is what is computed."""
    moe = make_moe()
    with torch.no_grad():
        moe.gate.weight.zero_()
    x = torch.randn(6, 64)
    weights, ids = moe.gate(x)
    with torch.no_grad():
        assert_matches(moe(x), reference(moe, x, weights, ids), torch.float32)


@pytest.mark.parametrize("bias,want", [
    ([0, 0, 0, 0, 0, 0, 0, 0], [0, 1]),  # every score ties: the first experts of the first groups
    ([0, 0, 1, 1, 0, 0, 1, 1], [2, 3]),  # groups 1 and 3 tie for the lead
    ([1, 1, 0, 0, 1, 1, 1, 1], [0, 1]),  # groups 0, 2 and 3 tie for two places: 0 and 2 kept
    ([0, 0, 0, 1, 0, 0, 0, 1], [3, 7]),  # groups 1 and 3 kept, their best before the rest
    ([0, 0, 0, 0, 0, 1, 0, 0], [5, 0]),  # the best expert, then the tie among the rest of the kept
])
def test_router_ties_go_to_the_lowest_index(bias, want):
    """E = 8 in 4 groups of 2, 2 groups kept, k = 2; zero logits (sigmoid 0.5), so the bias decides."""
    cfg = DeepseekV3Config(**SMALL)
    weights, ids = route(torch.zeros(3, 8), torch.tensor(bias, dtype=torch.float32), cfg)
    assert ids.tolist() == [want] * 3
    torch.testing.assert_close(weights, torch.full((3, 2), cfg.routed_scaling_factor / 2))


def test_empty_batch():
    moe = make_moe()
    with torch.no_grad():
        assert moe(torch.randn(0, 64)).shape == (0, 64)


def test_combine_refuses_a_norm_of_other_shapes():
    """The combine's norm takes a weight [D] and a residual [T, D] of the output's dtype; others
    are refused before any launch."""
    from specdec.models.moe_kernels import triton_combine

    per_pair, shared = torch.zeros(2, 8, 64), torch.zeros(2, 64, dtype=torch.bfloat16)
    for weight, residual in ((torch.ones(32, dtype=torch.bfloat16), None),
                             (torch.ones(64), None),
                             (torch.ones(64, 2, dtype=torch.bfloat16)[:, 0], None),
                             (torch.ones(64, dtype=torch.bfloat16), torch.zeros(3, 64, dtype=torch.bfloat16)),
                             (torch.ones(64, dtype=torch.bfloat16), torch.zeros(2, 64))):
        with pytest.raises(ValueError, match="combine's norm"):
            triton_combine(per_pair, shared, ops.AddNorm(residual, weight, 1e-6))


def test_backward_matches_reference():
    """The torch path trains: gradients of x, the experts and the router as the reference's."""
    moe = make_moe(n_routed_experts=4, n_group=2, topk_group=1)
    x = torch.randn(20, 64, requires_grad=True)
    grad_out = torch.randn(20, 64)
    (moe(x) * grad_out).sum().backward()
    got = (x.grad, moe.experts_gate_up.grad, moe.experts_down.grad, moe.gate.weight.grad)

    ref = make_moe(n_routed_experts=4, n_group=2, topk_group=1)
    x_ref = x.detach().clone().requires_grad_()
    weights, ids = ref.gate(x_ref)
    gate_up, down = ref.experts_gate_up, ref.experts_down
    out = torch.stack([ref.shared_experts(v[None])[0] for v in x_ref])
    rows = []
    for t in range(20):
        row = out[t]
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (gate_up[e] @ x_ref[t]).chunk(2)
            row = row + weights[t, j] * (down[e] @ (F.silu(g) * u))
        rows.append(row)
    (torch.stack(rows) * grad_out).sum().backward()
    want = (x_ref.grad, gate_up.grad, down.grad, ref.gate.weight.grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_checkpoint_names_round_trip():
    """Per-expert checkpoint names and shapes; loading writes into the packed parameters."""
    moe, other = make_moe(seed=0), make_moe(seed=1)
    state = moe.state_dict()
    experts, inter, hidden = 8, 32, 64
    for e in range(experts):
        assert state[f"experts.{e}.gate_proj.weight"].shape == (inter, hidden)
        assert state[f"experts.{e}.up_proj.weight"].shape == (inter, hidden)
        assert state[f"experts.{e}.down_proj.weight"].shape == (hidden, inter)
    assert not any(name.startswith("experts_") for name in state)
    assert {n for n in state if not n.startswith("experts.")} == {
        "gate.weight", "gate.e_score_correction_bias", "shared_experts.gate_proj.weight",
        "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"}
    result = other.load_state_dict({k: v.clone() for k, v in state.items()})
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(other.experts_gate_up, moe.experts_gate_up, rtol=0, atol=0)
    torch.testing.assert_close(other.experts_down, moe.experts_down, rtol=0, atol=0)
    torch.testing.assert_close(other.experts_gate_up[2, inter:], state["experts.2.up_proj.weight"], rtol=0, atol=0)


def test_init_as_linear():
    """kaiming_uniform(a=sqrt(5)) per expert matrix: uniform in +-1/sqrt(fan_in)."""
    cfg = DeepseekV3Config(**SMALL)
    moe = MoE(cfg)
    assert moe.experts_gate_up.abs().max() <= 64 ** -0.5 and moe.experts_gate_up.abs().max() > 0.9 * 64 ** -0.5
    assert moe.experts_down.abs().max() <= 32 ** -0.5 and moe.experts_down.abs().max() > 0.9 * 32 ** -0.5


# ------------------------------------------------------------------- Triton interpreter
ROUTER_CONFIGS = [  # (experts, groups, groups kept, k, norm_topk_prob)
    (8, 4, 2, 2, True), (16, 2, 2, 8, True), (64, 8, 4, 8, True), (256, 8, 4, 8, True), (24, 3, 2, 3, False)]


LAYOUT_CASES = [  # (tokens, k, experts, block_m): P below, at and past a power of two and a multiple
    (2, 2, 3, 2), (1, 8, 64, 16), (5, 2, 8, 16), (40, 1, 8, 16), (8, 8, 16, 32),  # of block_m,
    (64, 8, 16, 32), (300, 8, 256, 16), (3, 4, 4, 64), (7, 3, 12, 16), (0, 8, 256, 16),  # no pairs,
    (512, 8, 256, 16)]  # LAYOUT_MAX_PAIRS, the most the kernel sorts


def router_logits(kind: str, tokens: int, experts: int, groups: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, E]`` fp32 logits in multiples of 1/8, so scores tie exactly or differ by far more than
    an ulp: "random"; "zero" (every score ties); "groups" (every group the same logits: all groups
    tie); "pairs" (within each group the experts tie two by two)."""
    logits = (torch.randn(tokens, experts, generator=gen) * 8).round() / 8
    if kind == "zero":
        return torch.zeros(tokens, experts)
    if kind == "groups":
        return logits[:, :experts // groups].repeat(1, groups)
    if kind == "pairs":
        return logits[:, ::2].repeat_interleave(2, dim=1)
    return logits


def test_triton_path_under_triton_interpreter():
    """The whole MoE forward on its Triton path (the CUDA check patched; the torch router, layout
    and grouped GEMM made to fail; at 16-bit decode sizes the shared expert's own forward too, its
    gate/up in the router's kernel) against the per-token reference of the torch router's choice;
    with the next norm (ops.AddNorm; in the combine kernel where the decode tail does not serve),
    equal to the norm's own kernel on that output and to the norm written out."""
    pytest.importorskip("triton")
    run_interpreted("""
import torch
from specdec.models import gemv, moe as moe_module, ops
from test_moe import assert_matches, make_moe, reference
from model_reference import norm_ref

def torch_ran(*args, **kwargs):
    raise AssertionError("the torch path ran")

cases = [(dtype, tokens, 72, overrides) for dtype in (torch.float32, torch.bfloat16)
         for tokens, overrides in ((1, {}), (3, {}), (6, {}), (40, dict(num_experts_per_tok=1)),
                                   (5, dict(n_routed_experts=16, num_experts_per_tok=8, n_group=2, topk_group=2)))]
cases.append((torch.bfloat16, 2, 1100, {}))  # the router's partials over three chunks of D
for dtype, tokens, hidden, overrides in cases:
    moe = make_moe(dtype, hidden_size=hidden, moe_intermediate_size=40, **overrides).eval()
    with torch.no_grad():  # expert 0 is never chosen, and never read
        moe.gate.e_score_correction_bias[0] = -10.0
        moe.experts_gate_up[0].fill_(float("nan"))
        moe.experts_down[0].fill_(float("nan"))
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    with torch.no_grad():
        weights, ids = moe.gate(x)
        saved = (ops.on_triton, gemv.on_triton, moe_module.route, moe_module.sort_into_blocks,
                 moe_module.grouped_experts_torch, ops.summed_in_order)
        ops.on_triton = gemv.on_triton = lambda *tensors: True
        moe_module.route = moe_module.sort_into_blocks = moe_module.grouped_experts_torch = torch_ran
        ops.summed_in_order = torch_ran  # the partials' torch sum: the GEMV adds them as it loads
        got_weights, got_ids = moe.gate(x)
        if moe_module.shared_in_router(tokens, dtype, moe.shared_experts.gate_up.shape[0]):  # in the router's
            moe.shared_experts.forward = torch_ran
        got = moe(x)
        residual = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7)).to(dtype)
        norm = (torch.rand(hidden, generator=torch.Generator().manual_seed(8)) + 0.5).to(dtype)
        fused = [moe(x, then=ops.AddNorm(r, norm, 1e-6)) for r in (residual, None)]  # the combine's, or the tail's
        unfused = [ops.rms_norm(got, norm, 1e-6, r) for r in (residual, None)]  # its own kernel
        (ops.on_triton, gemv.on_triton, moe_module.route, moe_module.sort_into_blocks,
         moe_module.grouped_experts_torch, ops.summed_in_order) = saved
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(got_weights, weights, rtol=1e-6, atol=1e-7)
    assert got.dtype == dtype and got.shape == x.shape
    assert_matches(got, reference(moe, x, weights, ids), dtype)
    for (normed, h), (want_normed, want_h), r in zip(fused, unfused, (residual, None)):
        assert torch.equal(normed, want_normed) and torch.equal(h, want_h)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(h, got if r is None else r + got, **tol)  # the interpreter rounds its own way
        torch.testing.assert_close(normed, norm_ref(h, norm, 1e-6), **tol)  # and the norm itself
print("ok")
""")


# ------------------------------------------------------------------------------ GPU
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEEPSEEK_LIKE = dict(hidden_size=7168, moe_intermediate_size=256, n_routed_experts=64, num_experts_per_tok=8,
                     n_group=8, topk_group=4)


def _no_torch_path(*args, **kwargs):
    raise AssertionError("the torch path ran for CUDA tensors outside autograd")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_path_on_gpu(monkeypatch, dtype):
    for name in ("route", "sort_into_blocks", "grouped_experts_torch"):
        monkeypatch.setattr(moe_module, name, _no_torch_path)
    moe = make_moe(dtype, "cuda", **DEEPSEEK_LIKE).eval()
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 4, 64, 256):
        x = torch.randn(tokens, 7168, generator=gen).to(dtype).cuda()
        with torch.inference_mode():
            weights, ids = moe.gate(x)
            got = moe(x)
        assert_matches(got, reference(moe, x, weights, ids), dtype)


@pytest.mark.gpu
@requires_cuda
def test_kernels_match_the_torch_path_on_gpu():
    """On the GPU, each new kernel against the torch path's ops on the same CUDA inputs: the
    router's choice and the layout exactly, the combine bit for bit (the GPU rounds as torch), and
    with the next norm the norm kernel's bits; the decode tail within a bf16 step of the three
    launches it replaces (at 1 and 4 tokens)."""
    from specdec.models.moe_kernels import (decode_tail, grouped_experts, grouped_gate_up, single_token_blocks,
                                            triton_combine, triton_sort_into_blocks)
    from specdec.models.moe_router import router_logits as router_gemm, triton_route

    gen = torch.Generator().manual_seed(0)
    for experts, groups, kept, top_k, norm in ROUTER_CONFIGS:
        cfg = DeepseekV3Config(n_routed_experts=experts, n_group=groups, topk_group=kept, num_experts_per_tok=top_k,
                               norm_topk_prob=norm)
        for kind in ("random", "zero", "groups", "pairs"):
            logits = router_logits(kind, 64, experts, groups, gen).cuda()
            bias = torch.zeros(experts, device="cuda")
            want_weights, want_ids = route(logits, bias, cfg)
            weights, ids = triton_route(logits, bias, cfg)
            assert torch.equal(ids, want_ids), (experts, kind)
            torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)  # tl.exp: the GPU's ex2.approx
    for tokens, top_k, experts, block_m in LAYOUT_CASES:
        ids = torch.randint(0, experts, (tokens, top_k), generator=gen).cuda()
        want, got = sort_into_blocks(ids, experts, block_m), triton_sort_into_blocks(ids, experts, block_m)
        for field in ("row_pair", "block_expert", "pair_row"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (tokens, top_k, experts, field)
    for tokens in (1, 64):
        x = torch.randn(tokens, 7168, generator=gen).to("cuda", torch.bfloat16)
        w = torch.randn(64, 7168, generator=gen).to("cuda", torch.bfloat16)
        torch.testing.assert_close(router_gemm(x, w).sum(0), F.linear(x.float(), w.float()), rtol=1e-5, atol=1e-3)
    moe = make_moe(torch.bfloat16, "cuda", **DEEPSEEK_LIKE).eval()  # the decode tail: one kernel for three
    for tokens in (1, 4):
        x = torch.randn(tokens, 7168, generator=gen).to("cuda", torch.bfloat16)
        with torch.inference_mode():
            weights, ids, partials = moe.gate.route_with(x, moe.shared_experts.gate_up)
            tiles = tiles_for(8 * tokens, 64, 7168, 256, torch.bfloat16)
            blocks = (single_token_blocks if tokens == 1 else triton_sort_into_blocks)(ids, 64, tiles.block_m)
            shared_down = moe.shared_experts.down_proj.weight
            got = decode_tail(grouped_gate_up(x, moe.experts_gate_up, blocks, tiles), moe.experts_down, blocks,
                              weights, partials, shared_down)
            per_pair = grouped_experts(x, moe.experts_gate_up, moe.experts_down, weights, blocks, tiles)
            act = ops.silu_mul(ops.summed_in_order(partials).bfloat16())
            want = triton_combine(per_pair.view(tokens, 8, 7168), F.linear(act, shared_down))
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
    per_pair = torch.randn(64, 8, 7168, generator=gen).cuda()
    shared = torch.randn(64, 7168, generator=gen).to("cuda", torch.bfloat16)
    routed = per_pair[:, 0].clone()
    for j in range(1, 8):
        routed += per_pair[:, j]
    out = triton_combine(per_pair, shared)
    assert torch.equal(out, routed.bfloat16() + shared)
    residual = torch.randn(64, 7168, generator=gen).to("cuda", torch.bfloat16)
    weight = torch.rand(7168, generator=gen).to("cuda", torch.bfloat16)
    for r in (residual, None):  # the next norm in the same launch: its own kernel's bits
        got, want = triton_combine(per_pair, shared, ops.AddNorm(r, weight, 1e-6)), ops.rms_norm(out, weight, 1e-6, r)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@requires_cuda
def test_triton_path_captures_in_a_cuda_graph():
    moe = make_moe(torch.bfloat16, "cuda", **DEEPSEEK_LIKE).eval()
    static = torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe(static)  # compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(static)
        for seed in (1, 2):
            fresh = torch.randn(4, 7168, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
            static.copy_(fresh)
            graph.replay()
            assert torch.equal(out, moe(fresh))
