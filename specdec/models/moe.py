"""DeepSeek-V3's routed mixture of experts: the noaux_tc router, the routed experts, the shared expert.

A routed expert runs only on the tokens that chose it: the (token, expert) pairs are sorted into
per-expert blocks on the device (specdec/models/moe_kernels.py) and the experts run as one grouped
GEMM over those blocks.

A bf16 decode MoE layer's Triton path launches 5 kernels (4 for one token) and the next norm's:
the router's GEMM, with the shared expert's gate/up in it, and its choice, the layout (none for
one token), the grouped gate/up GEMM, and one kernel for the down GEMMs, the shared down and their
sum (moe_kernels.decode_tail). Past SHARED_IN_ROUTER_ROWS tokens the shared expert runs on its
own and a combine kernel (with the next norm) sums the down GEMM's pairs.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models import moe_kernels, ops
from specdec.models.config import DeepseekV3Config
from specdec.models.mlp import MLP
from specdec.parallel import SINGLE, Parallel
from specdec.models.moe_kernels import (LAYOUT_MAX_PAIRS, ExpertBlocks, single_token_blocks,
                                        sort_into_blocks, tiles_for, triton_combine, triton_sort_into_blocks)
from specdec.models.moe_router import router_logits, triton_route
from specdec.models.packing import CheckpointViews, row_views


class Router(nn.Module):
    """DeepSeek-V3 routing (noaux_tc): sigmoid scores; e_score_correction_bias steers which
    experts are chosen but not their weights; experts are picked from the topk_group groups whose
    two best (biased) scores sum highest."""

    def __init__(self, cfg: DeepseekV3Config, dtype: Optional[torch.dtype] = None, device: Any = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype, device=device))
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
        """x ``[T, D]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64): :func:`route` of
        the fp32 logits; on the Triton path the logits' partial sums (moe_router.router_logits,
        no fp32 copy of x or the weight) go to moe_router.triton_route."""
        if ops.on_triton(x, self.weight) and x.dtype == self.weight.dtype and x.stride(-1) == 1:
            return triton_route(router_logits(x, self.weight), self.e_score_correction_bias, self.cfg)
        return route(F.linear(x.float(), self.weight.float()), self.e_score_correction_bias, self.cfg)

    def route_with(self, x: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """forward's Triton path, multiplying ``extra`` ``[X, D]`` (x's dtype) in the router's launch:
        (weights, ids, x @ extra^T as partial sums ``[S, T, X]`` fp32, moe_router.router_logits').
        The choice is forward's, bit for bit. For CUDA tensors outside autograd."""
        partials = router_logits(x, self.weight, extra)
        experts = self.weight.shape[0]
        return (*triton_route(partials[..., :experts], self.e_score_correction_bias, self.cfg),
                partials[..., experts:])


def route(logits: torch.Tensor, bias: torch.Tensor, cfg: DeepseekV3Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The noaux_tc choice from the router's logits ``[T, E]`` fp32 and bias ``[E]`` fp32 ->
    (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64, best first), in torch (autograd).

    Ties go to the lowest index, for groups and for experts (torch.topk leaves their order
    unspecified; the kernel must agree with this path exactly).
    """
    per_group = cfg.n_routed_experts // cfg.n_group
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, cfg.n_group, per_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, _top(group_scores, cfg.topk_group), True)
    choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = _top(choice, cfg.num_experts_per_tok)
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def _top(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest values, largest first, equal values lowest index first."""
    return values.sort(dim=-1, descending=True, stable=True).indices[:, :k]


class MoE(CheckpointViews, nn.Module):
    """Routed experts plus the shared experts; a routed expert runs only on the tokens that chose it.

    ``experts_gate_up`` ``[E, 2I, D]`` stacks each expert's gate_proj rows, then its up_proj rows;
    ``experts_down`` ``[E, D, I]`` its down_proj. The checkpoint's ``experts.{e}.gate_proj.weight``,
    ``up_proj.weight`` and ``down_proj.weight`` are views of them (specdec/models/packing.py).

    Forward: route; sort the T * k pairs into per-expert blocks; the grouped GEMM over the blocks
    (the Triton kernels for CUDA tensors outside autograd, else the same blocks through torch.bmm,
    which has a backward); each token's k weighted outputs summed in fp32 in a fixed order (no
    atomics: the same inputs give the same bits); plus the shared expert. Under tensor parallelism
    a rank holds every expert's (and the shared expert's) slice of the intermediate: its output is
    its part of the sum (the decoder layer all-reduces it); the router is every rank's.
    """

    _packed = ("experts_gate_up", "experts_down")

    def __init__(self, cfg: DeepseekV3Config, parallel: Parallel = SINGLE, dtype: Optional[torch.dtype] = None,
                 device: Any = None) -> None:
        super().__init__()
        fk = {"dtype": dtype, "device": device}
        experts, hidden = cfg.n_routed_experts, cfg.hidden_size
        self.inter = parallel.shard(cfg.moe_intermediate_size, "moe_intermediate_size")[1]
        self.gate = Router(cfg, **fk)
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * self.inter, hidden, **fk))
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, self.inter, **fk))
        for e in range(experts):  # each matrix as its own nn.Linear would be
            for w in (*self.experts_gate_up.data[e].split(self.inter), self.experts_down.data[e]):
                nn.init.kaiming_uniform_(w, a=5 ** 0.5)
        shared = parallel.shard(cfg.moe_intermediate_size * cfg.n_shared_experts, "moe_intermediate_size * n_shared_experts")
        self.shared_experts = MLP(hidden, shared[1], **fk)

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        views = {}
        for e in range(self.experts_gate_up.shape[0]):
            rows = row_views(self.experts_gate_up[e], {"gate_proj.weight": self.inter, "up_proj.weight": self.inter})
            views |= {f"experts.{e}.{name}": view for name, view in rows.items()}
            views[f"experts.{e}.down_proj.weight"] = self.experts_down[e]
        return views

    def forward(self, x: torch.Tensor, then: Optional[ops.AddNorm] = None):
        """x ``[T, D]`` -> ``[T, D]``; given ``then``, then(that): (norm, h) ``[T, D]`` each, on the
        Triton path the combine kernel's (one launch for both) where the decode tail does not serve
        (past SHARED_IN_ROUTER_ROWS tokens, or fp32), else the norm's own kernel after the tail's."""
        fused = self._fuses_shared(x)
        if fused:  # the shared expert's gate/up in the router's launch, its down GEMV summing the partials
            weights, ids, shared_gate_up = self.gate.route_with(x, self.shared_experts.gate_up)
        else:
            weights, ids = self.gate(x)  # [T, k] each
        num_experts, _, hidden = self.experts_gate_up.shape
        tiles = tiles_for(ids.numel(), num_experts, hidden, self.inter, x.dtype)
        if not ops.on_triton(x, weights, self.experts_gate_up, self.experts_down):
            blocks = layout_for(ids)(ids, num_experts, tiles.block_m)
            per_pair = grouped_experts_torch(x, self.experts_gate_up, self.experts_down, weights, blocks)
            routed = per_pair.view(*ids.shape, hidden).sum(1)  # [T, k, D] -> [T, D], fp32
            out = routed.to(x.dtype) + self.shared_experts(x)
            return out if then is None else then(out)
        blocks = layout_for(ids, triton_sort_into_blocks)(ids, num_experts, tiles.block_m)
        if fused:  # the down products, the shared down and their sum in one kernel
            h = moe_kernels.grouped_gate_up(x.contiguous(), self.experts_gate_up, blocks, tiles)
            out = moe_kernels.decode_tail(h, self.experts_down, blocks, weights, shared_gate_up,
                                          self.shared_experts.down_proj.weight)
            return out if then is None else then(out)
        per_pair = moe_kernels.grouped_experts(x.contiguous(), self.experts_gate_up, self.experts_down, weights,
                                               blocks, tiles)
        shared = self.shared_experts(x)
        per_pair = per_pair.view(*ids.shape, hidden)
        if then is not None and not then.kernel_takes(shared):  # e.g. a norm weight of another dtype
            return then(triton_combine(per_pair, shared))
        return triton_combine(per_pair, shared, then)

    def _fuses_shared(self, x: torch.Tensor) -> bool:
        shared = self.shared_experts.gate_up
        return (ops.on_triton(x, self.gate.weight, shared, self.experts_gate_up, self.experts_down)
                and x.dim() == 2 and x.stride(-1) == 1 and self.gate.weight.dtype == shared.dtype == x.dtype
                and shared_in_router(x.shape[0], x.dtype, shared.shape[0]))


SHARED_IN_ROUTER_ROWS = 4  # the most tokens whose shared gate/up rides in the router's kernel


def shared_in_router(tokens: int, dtype: torch.dtype, shared_rows: int, sms: int = 132) -> bool:
    """Whether MoE multiplies the shared expert's gate/up (``shared_rows`` = 2I rows) in the
    router's kernel, its down projection summing the partials (moe_kernels.decode_tail): 16-bit, a
    decode step of at most SHARED_IN_ROUTER_ROWS tokens (each down program reads S x 2I fp32 a
    token), and too few rows for the GEMV's 16-row tiles to fill the SMs. The rank slice's
    (2I = 512): 32 GEMV programs on 132 SMs; in the router's launch 32 x 14 (S = 14 at D = 7168)."""
    return (dtype in (torch.bfloat16, torch.float16) and tokens <= SHARED_IN_ROUTER_ROWS
            and -(-shared_rows // 16) < sms)


def layout_for(ids: torch.Tensor, kernel: Optional[Callable] = None) -> Callable[..., ExpertBlocks]:
    """How MoE lays out ids ``[T, k]``: one token needs no sort (single_token_blocks); a decode
    step's pairs go to the layout ``kernel`` where one is given, a prefill's to the torch ops
    (sort_into_blocks), whose GEMMs dwarf them."""
    if ids.shape[0] == 1:
        return single_token_blocks
    return kernel if kernel is not None and ids.numel() <= LAYOUT_MAX_PAIRS else sort_into_blocks


def grouped_experts_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                          blocks: ExpertBlocks) -> torch.Tensor:
    """moe_kernels.grouped_experts in torch, with autograd: each pair's weighted expert output
    ``[P, D]`` fp32 (row p: pair p), from x ``[T, D]``, gate_up ``[E, 2I, D]``, down ``[E, D, I]``
    (x's dtype) and weights ``[T, k]`` fp32.

    Every block, in use or not, gathers its expert's weights (``[blocks, 2I, D]``: sized for small
    models) and its token rows, then two torch.bmm; padding rows and unused blocks compute on some
    token and expert and are never read back.
    """
    (num_blocks, block_m), (hidden, inter) = (blocks.num_blocks, blocks.block_m), down.shape[1:]
    token = blocks.row_pair.clamp(max=max(blocks.num_pairs - 1, 0)) // blocks.top_k  # [blocks * block_m]
    expert = blocks.block_expert.clamp(max=blocks.num_experts - 1)  # [blocks]
    rows = x.index_select(0, token).view(num_blocks, block_m, hidden)
    gate_up_out = torch.bmm(rows, gate_up.index_select(0, expert).transpose(1, 2))
    h = ops.silu_mul(gate_up_out.view(num_blocks * block_m, 2 * inter)).view(num_blocks, block_m, inter)
    out = torch.bmm(h, down.index_select(0, expert).transpose(1, 2)).view(num_blocks * block_m, hidden)
    return out.index_select(0, blocks.pair_row).float() * weights.reshape(-1, 1)
