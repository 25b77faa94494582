"""MoE's Triton kernels compile for sm_90 without a GPU: the launches MoE.forward's Triton path
makes, recorded on CPU stand-ins, each within a block's shared memory (tests/test_moe.py has
their behaviour)."""

from __future__ import annotations

import pytest
import torch

from sm90_compile import H200_SHARED_MEMORY, Recorder, compile_for_sm90
from specdec.models import gemv, moe as moe_module, ops
from specdec.models.config import DeepseekV3Config
from specdec.models.moe_kernels import LAYOUT_MAX_PAIRS, tiles_for

KERNELS = ("_router_kernel", "_route_kernel", "_layout_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel")


def recorded_launches(monkeypatch, dtype, tokens, top_k, experts, hidden, inter, then=False):
    """The (kernel, args, constexprs and options) that MoE.forward's Triton path launches, for CPU
    stand-ins of the inputs (weights broadcast from one row: only shapes, strides and dtypes reach
    the compile); a prefill's layout is the torch ops', no launch. then: the combine with the next
    norm (a decoder layer's at tp 1)."""
    from specdec.models import moe_kernels

    launches = []
    for module, name in [*((moe_kernels, name) for name in KERNELS), (gemv, "_gemv_kernel")]:
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), launches))
    cfg = DeepseekV3Config(n_routed_experts=experts, n_group=8, topk_group=4, num_experts_per_tok=top_k)
    x = torch.empty(tokens, hidden, dtype=dtype)
    fused = moe_module.shared_in_router(tokens, dtype, 2 * inter)
    shared = torch.empty(2 * inter, hidden, dtype=dtype) if fused else None
    partials = moe_kernels.router_logits(x, torch.empty(experts, hidden, dtype=dtype), shared)
    moe_kernels.triton_route(partials[..., :experts], torch.empty(experts), cfg)
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(0))
    tiles = tiles_for(ids.numel(), experts, hidden, inter, dtype)
    layout = (moe_kernels.triton_sort_into_blocks if ids.numel() <= moe_kernels.LAYOUT_MAX_PAIRS
              else moe_kernels.sort_into_blocks)
    gate_up = torch.empty(1, 1, hidden, dtype=dtype).expand(experts, 2 * inter, hidden)
    down = torch.empty(1, 1, inter, dtype=dtype).expand(experts, hidden, inter)
    per_pair = moe_kernels.grouped_experts(x, gate_up, down,
                                           torch.rand(tokens, top_k), layout(ids, experts, tiles.block_m), tiles)
    if shared is not None:
        gemv.triton_silu_linear_partials(partials[..., experts:], torch.empty(hidden, inter, dtype=dtype))
    norm = ops.AddNorm(torch.empty(tokens, hidden, dtype=dtype), torch.empty(hidden, dtype=dtype), 1e-6) if then else None
    moe_kernels.triton_combine(per_pair.view(tokens, top_k, hidden), torch.empty(tokens, hidden, dtype=dtype), norm)
    return launches


@pytest.mark.parametrize("dtype,tokens,experts,inter", [
    (torch.bfloat16, 1, 256, 256), (torch.bfloat16, 3, 256, 2048), (torch.bfloat16, 256, 64, 256),
    (torch.bfloat16, 1024, 64, 2048), (torch.float16, 3, 64, 256), (torch.float32, 1, 64, 256),
    (torch.float32, 3, 64, 256), (torch.float32, 256, 64, 256),
], ids=["bf16-one-token", "bf16-decode", "bf16-2048-pairs", "bf16-prefill", "fp16-decode", "fp32-one-token",
        "fp32-decode", "fp32-2048-pairs"])
def test_kernels_compile_for_sm90(monkeypatch, dtype, tokens, experts, inter):
    """Without a GPU: the kernels MoE's Triton path launches compile for H200 (the grouped GEMM's
    16, 32 and 64-row tiles with their loads pipelined into shared memory), each within a block's
    shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    launches = recorded_launches(monkeypatch, dtype, tokens, 8, experts, 7168, inter)
    fused = moe_module.shared_in_router(tokens, dtype, 2 * inter)
    names = [kernel.fn.__name__ for kernel, _, _ in launches]
    want = [name for name in KERNELS if tokens * 8 <= LAYOUT_MAX_PAIRS or name != "_layout_kernel"]
    assert names == want[:-1] + ["_gemv_kernel"] * fused + want[-1:]
    combine_with_norm = recorded_launches(monkeypatch, dtype, tokens, 8, experts, 7168, inter, then=True)[-1]
    for name, launch in [*zip(names, launches), ("_combine_kernel", combine_with_norm)]:
        compiled = compile_for_sm90(*launch)
        if name in ("_gate_up_kernel", "_down_kernel"):
            assert "cp.async" in compiled.asm["ptx"]
        assert compiled.metadata.shared <= H200_SHARED_MEMORY


@pytest.mark.parametrize("dtype,experts,inter", [(torch.bfloat16, 64, 256), (torch.bfloat16, 256, 2048),
                                                 (torch.float16, 64, 256)],
                         ids=["bf16-rank-slice", "bf16-whole-expert", "fp16"])
def test_one_token_tail_compiles_for_sm90(monkeypatch, dtype, experts, inter):
    """Without a GPU: one token's tail (moe_kernels.one_token_tail, MoE's path at one 16-bit
    token), at the rank slice's I = 256 and a whole expert's 2048 (K loops of 256), compiles for
    H200 within a block's shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    from specdec.models import moe_kernels

    launches = []
    monkeypatch.setattr(moe_kernels, "_one_token_tail_kernel",
                        Recorder(moe_kernels._one_token_tail_kernel, launches))
    ids = torch.randint(0, experts, (1, 8), generator=torch.Generator().manual_seed(0))
    blocks = moe_kernels.single_token_blocks(ids, experts, 16)
    down = torch.empty(1, 1, inter, dtype=dtype).expand(experts, 7168, inter)
    moe_kernels.one_token_tail(torch.empty(8 * 16, inter, dtype=dtype), down, blocks, torch.rand(1, 8),
                               torch.empty(14, 1, 2 * inter), torch.empty(7168, inter, dtype=dtype))
    (launch,) = launches
    assert compile_for_sm90(*launch).metadata.shared <= H200_SHARED_MEMORY
