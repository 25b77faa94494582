"""Shared test helpers: a tiny DeepSeek-V3-architecture model, prompts, and run loops."""

from __future__ import annotations

import torch

from specdec.baseline import greedy_generate
from specdec.models import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM
from specdec.worker import EagleWorker

VOCAB = 96


def tiny_config(**overrides) -> DeepseekV3Config:
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
        v_head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=512,
    )
    base.update(overrides)
    return DeepseekV3Config(**base)


def make_models(device="cpu", dtype=torch.float32, **overrides) -> tuple[DeepseekV3ForCausalLM, DeepseekMTP]:
    """A seeded random target and MTP draft head."""
    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(tiny_config(**overrides)).to(device=device, dtype=dtype).eval()
    torch.manual_seed(1)
    mtp = DeepseekMTP(target.config, target=target).to(device=device, dtype=dtype).eval()
    return target, mtp


def prompts(n: int, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def run_to_completion(worker: EagleWorker, groups: list[tuple[list[list[int]], int]], join_every: int = 2):
    """Add the request groups one at a time, ``join_every`` steps apart, and step until all finish.

    Returns the outputs in request order and every step's accept lengths."""
    reqs, accept, pending, steps = [], [], list(groups), 0
    while pending or worker.requests:
        if pending and steps % join_every == 0:
            group, max_new = pending.pop(0)
            reqs += worker.add_requests(group, max_new)
        if worker.requests:
            accept += worker.step().accept_lens
        steps += 1
    return [r.output for r in reqs], accept


def reference(target, groups, **kwargs) -> list[list[int]]:
    """Target-only greedy outputs of every group, in order."""
    out = []
    for group, max_new in groups:
        out += greedy_generate(target, group, max_new, **kwargs)
    return out

