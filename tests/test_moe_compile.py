"""MoE's Triton kernels compile for sm_90 without a GPU: the launches MoE.forward's Triton path
makes, recorded on CPU stand-ins, each within a block's shared memory (tests/test_moe.py has
their behaviour)."""

from __future__ import annotations

import pytest
import torch

from sm90_compile import H200_SHARED_MEMORY, Recorder, compile_for_sm90
from specdec.models import moe as moe_module, ops
from specdec.models.config import DeepseekV3Config
from specdec.models.moe_kernels import LAYOUT_MAX_PAIRS, tiles_for

KERNELS = ("_layout_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel", "_decode_tail_kernel")
ROUTER_KERNELS = ("_router_kernel", "_route_kernel")


def recorded_launches(monkeypatch, dtype, tokens, top_k, experts, hidden, inter, then=False):
    """The (kernel, args, constexprs and options) that MoE.forward's Triton path launches, for CPU
    stand-ins of the inputs (weights broadcast from one row: only shapes, strides and dtypes reach
    the compile); the layout as moe.layout_for chooses it (one token's and a prefill's launch
    nothing). then: the combine with the next norm (a decoder layer's at tp 1)."""
    from specdec.models import moe_kernels, moe_router

    launches = []
    for module, names in ((moe_router, ROUTER_KERNELS), (moe_kernels, KERNELS)):
        for name in names:
            monkeypatch.setattr(module, name, Recorder(getattr(module, name), launches))
    cfg = DeepseekV3Config(n_routed_experts=experts, n_group=8, topk_group=4, num_experts_per_tok=top_k)
    x = torch.empty(tokens, hidden, dtype=dtype)
    fused = moe_module.shared_in_router(tokens, dtype, 2 * inter)
    shared = torch.empty(2 * inter, hidden, dtype=dtype) if fused else None
    partials = moe_router.router_logits(x, torch.empty(experts, hidden, dtype=dtype), shared)
    moe_router.triton_route(partials[..., :experts], torch.empty(experts), cfg)
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(0))
    tiles = tiles_for(ids.numel(), experts, hidden, inter, dtype)
    layout = moe_module.layout_for(ids, moe_kernels.triton_sort_into_blocks)  # forward's choice
    gate_up = torch.empty(1, 1, hidden, dtype=dtype).expand(experts, 2 * inter, hidden)
    down = torch.empty(1, 1, inter, dtype=dtype).expand(experts, hidden, inter)
    blocks = layout(ids, experts, tiles.block_m)
    if fused:  # the down GEMMs, the shared down and the sum in one kernel; the next norm its own
        h = moe_kernels.grouped_gate_up(x, gate_up, blocks, tiles)
        moe_kernels.decode_tail(h, down, blocks, torch.rand(tokens, top_k), partials[..., experts:],
                                torch.empty(hidden, inter, dtype=dtype))
        return launches
    per_pair = moe_kernels.grouped_experts(x, gate_up, down, torch.rand(tokens, top_k), blocks, tiles)
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
    tail = ["_decode_tail_kernel"] if fused else ["_down_kernel", "_combine_kernel"]
    layout = ["_layout_kernel"] * (1 < tokens and tokens * 8 <= LAYOUT_MAX_PAIRS)  # moe.layout_for's
    assert names == ["_router_kernel", "_route_kernel"] + layout + ["_gate_up_kernel"] + tail
    with_norm = [] if fused else [("_combine_kernel", recorded_launches(monkeypatch, dtype, tokens, 8, experts, 7168,
                                                                        inter, then=True)[-1])]
    for name, launch in [*zip(names, launches), *with_norm]:
        compiled = compile_for_sm90(*launch)
        if name in ("_gate_up_kernel", "_down_kernel"):
            assert "cp.async" in compiled.asm["ptx"]
        assert compiled.metadata.shared <= H200_SHARED_MEMORY

