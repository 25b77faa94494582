"""DeepSeek-V3's routed mixture of experts: the noaux_tc router, the routed experts, the shared expert."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.config import DeepseekV3Config
from specdec.models.mlp import MLP


def _factory(dtype: Optional[torch.dtype], device: Any) -> dict[str, Any]:
    return {"dtype": dtype, "device": device}


class Router(nn.Module):
    """DeepSeek-V3 routing (noaux_tc): sigmoid scores; e_score_correction_bias steers which
    experts are chosen but not their weights; experts are picked from the topk_group groups whose
    two best (biased) scores sum highest."""

    def __init__(self, cfg: DeepseekV3Config, dtype: Optional[torch.dtype] = None, device: Any = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, **_factory(dtype, device)))
        nn.init.normal_(self.weight, std=0.02)
        # fp32 as in the reference: bias steps are far below bf16 resolution at score ~1 (_apply).
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32, device=device))

    def _apply(self, fn, recurse: bool = True):
        """Module.to(dtype) and friends leave the bias fp32; only its device follows (from a meta
        tensor, as in to_empty, an uninitialised fp32 one)."""
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if moved.dtype != bias.dtype:
            self.e_score_correction_bias = (torch.empty_like(moved, dtype=bias.dtype) if bias.is_meta
                                            else bias.to(moved.device))
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, D]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64)."""
        cfg = self.cfg
        per_group = cfg.n_routed_experts // cfg.n_group
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        group_scores = choice.view(-1, cfg.n_group, per_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


class MoE(nn.Module):
    """Routed experts (one MLP each, as in the checkpoint) plus the shared experts."""

    def __init__(self, cfg: DeepseekV3Config, dtype: Optional[torch.dtype] = None, device: Any = None) -> None:
        super().__init__()
        fk = _factory(dtype, device)
        self.gate = Router(cfg, **fk)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size, **fk) for _ in range(cfg.n_routed_experts))
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, D]`` -> ``[T, D]``."""
        weights, ids = self.gate(x)
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=torch.float32, device=x.device).scatter_(1, ids, weights)
        # Every expert runs on every token, weighted 0 where not chosen: no data-dependent shapes or
        # host syncs, so it captures in CUDA graphs. Clarity over speed: meant for small models.
        routed = sum(expert(x).float() * dense[:, e, None] for e, expert in enumerate(self.experts))
        return routed.to(x.dtype) + self.shared_experts(x)
