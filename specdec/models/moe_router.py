"""The MoE router's kernels: its GEMM as partial sums over chunks of D (:func:`router_logits`, the
shared expert's gate/up rows in the same launch) and the noaux_tc choice from them
(:func:`triton_route`, a program per token). specdec/models/moe.py's Router calls them; the
module imports without Triton (CPU-only installs), where moe.route serves.
"""

from __future__ import annotations

from typing import Optional

import torch

from specdec.models.config import DeepseekV3Config
from specdec.models.ops import dot_precision, pow2, summed
from specdec.triton_lang import jit as _jit, tl, triton

ROUTER_CHUNK = 512  # the columns of D one partial sum of the router's logits covers
ROUTER_TILE = 16  # tokens and experts a router program multiplies (tl.dot's minimum)


def router_logits(x: torch.Tensor, weight: torch.Tensor, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The router's GEMM in partial sums over chunks of D, by one kernel (any device Triton runs on,
    its interpreter included): x ``[T, D]`` and weight ``[E, D]`` of one dtype, unit stride in D
    -> ``[S, T, E]`` fp32, S = ceil(D / ROUTER_CHUNK), whose in-order sum over S is x @ weight^T
    (``F.linear(x.float(), weight.float())`` to fp32 rounding: 16-bit products are exact in
    fp32). triton_route sums them, so the router costs no casts and no reduction kernel.

    ``extra`` ``[X, D]`` (x's dtype, unit stride in D): its products too, as columns E.. of
    ``[S, T, E + X]``, in the same launch (MoE: the shared expert's gate/up, whose 2I rows alone
    are too few for a GEMV to fill the SMs). The router's columns have the same bits either way.

    E.g. E = 256, D = 7168: S = 14, at T = 1 a grid of 16 x 14 programs each reading 16 KB of the
    weight; with the rank slice's shared gate/up (X = 512) 48 x 14. S depends on D alone, so a
    token's logits have the same bits at any T.
    """
    rows = (weight,) if extra is None else (weight, extra)
    if (x.dim() != 2 or any(w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != x.dtype or w.stride(1) != 1
                            for w in rows) or x.stride(1) != 1):
        raise ValueError(f"router: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
                         + ("" if extra is None else f", extra {tuple(extra.shape)} {extra.dtype}")
                         + ": expected x [T, D] and weights [E, D] (and [X, D]) of one dtype, unit stride in D")
    (tokens, hidden), experts = x.shape, weight.shape[0]
    more = 0 if extra is None else extra.shape[0]
    splits = triton.cdiv(hidden, ROUTER_CHUNK)
    out = torch.empty(splits, tokens, experts + more, dtype=torch.float32, device=x.device)
    if tokens:
        tiles = triton.cdiv(experts, ROUTER_TILE) + triton.cdiv(more, ROUTER_TILE)
        other = weight if extra is None else extra
        _router_kernel[(tiles, splits, triton.cdiv(tokens, ROUTER_TILE))](
            x, weight, other, out, tokens, experts, more, hidden, x.stride(0), weight.stride(0), other.stride(0),
            PRECISION=dot_precision(x.dtype), BLOCK=ROUTER_TILE, BLOCK_K=256, CHUNK=ROUTER_CHUNK, num_warps=2)
    return out


@_jit
def _router_kernel(x_ptr, w_ptr, extra_ptr, out_ptr, T, E, X, D, stride_x, stride_w, stride_extra,
                   PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    """out[s, token tile, column tile] = x[tokens, chunk s] @ rows[chunk s]^T: the column tiles
    of w (columns 0..E) first, then those of extra (columns E..E + X)."""
    c_tile, s, t_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    in_w = c_tile < tl.cdiv(E, BLOCK)  # selects, not branches: E or X may be a specialised constant
    first = tl.where(in_w, c_tile, c_tile - tl.cdiv(E, BLOCK)) * BLOCK
    n_rows = tl.where(in_w, E, X)
    col0 = tl.where(in_w, 0, E) + first
    rt = t_tile * BLOCK + tl.arange(0, BLOCK)
    re = first + tl.arange(0, BLOCK)
    rows = tl.where(in_w, w_ptr + re * stride_w, extra_ptr + re * stride_extra)  # [BLOCK] row starts
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in tl.static_range(0, CHUNK, BLOCK_K):
        rk = s * CHUNK + k0 + tl.arange(0, BLOCK_K)
        k_in = rk < D
        a = tl.load(x_ptr + rt.to(tl.int64)[:, None] * stride_x + rk[None, :], mask=(rt < T)[:, None] & k_in[None, :],
                    other=0.0)
        w = tl.load(rows[None, :] + rk[:, None], mask=k_in[:, None] & (re < n_rows)[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    cols = col0 + tl.arange(0, BLOCK)
    out = out_ptr + (s * T + rt.to(tl.int64))[:, None] * (E + X) + cols[None, :]
    tl.store(out, acc, mask=(rt < T)[:, None] & (re < n_rows)[None, :])


def triton_route(logits: torch.Tensor, bias: torch.Tensor, cfg: DeepseekV3Config) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.route by one kernel, a program per token, its E scores in registers (any device Triton
    runs on, its interpreter included).

    logits ``[T, E]`` fp32, or ``[S, T, E]`` partial sums (router_logits') added in order; unit
    stride in E; bias ``[E]`` fp32 -> (weights ``[T, k]`` fp32, ids ``[T, k]`` int64). route's
    rule, ties to the lowest index included: on equal scores the ids are route's; the weights
    equal route's to fp32 rounding (the kernel's sigmoid and sums are its own, so a near-tie
    within a few ulps may go either way, as between torch's CPU and CUDA).
    """
    partial = logits if logits.dim() == 3 else logits.unsqueeze(0)
    splits, tokens, experts = partial.shape if partial.dim() == 3 else (0, 0, 0)
    groups, top_k = cfg.n_group, cfg.num_experts_per_tok
    per_group = experts // groups
    if (logits.dim() not in (2, 3) or logits.dtype != torch.float32 or bias.dtype != torch.float32
            or tuple(bias.shape) != (experts,) or bias.stride(0) != 1 or partial.stride(2) != 1
            or experts % groups or per_group < 2 or top_k > cfg.topk_group * per_group):
        raise ValueError(f"logits {tuple(logits.shape)} {logits.dtype}, bias {tuple(bias.shape)} {bias.dtype}, "
                         f"{groups} groups, {cfg.topk_group} kept, top {top_k}: expected fp32 logits [T, E] or "
                         "[S, T, E] of unit stride in E, an fp32 bias [E] of unit stride, groups of at least 2 "
                         "dividing E, and k experts within the kept groups")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](partial, bias, weights, ids, partial.stride(0), partial.stride(1),
                                 float(cfg.routed_scaling_factor), SPLITS=splits, GROUPS=groups,
                                 PER_GROUP=per_group, TOPK_GROUP=cfg.topk_group, TOP_K=top_k,
                                 NORMALISE=bool(cfg.norm_topk_prob), G_BLOCK=pow2(groups), PG_BLOCK=pow2(per_group),
                                 K_BLOCK=pow2(top_k), num_warps=1)
    return weights, ids


@_jit
def _first_max(values, index, NONE: tl.constexpr):
    """The lowest index among those of the largest value: a stable descending sort's first."""
    return tl.min(tl.where(values == tl.max(values, axis=0), index, NONE), axis=0)


@_jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_split, stride_logits, scale,
                  SPLITS: tl.constexpr, GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  TOP_K: tl.constexpr, NORMALISE: tl.constexpr, G_BLOCK: tl.constexpr, PG_BLOCK: tl.constexpr,
                  K_BLOCK: tl.constexpr):
    """Token t's route; its experts as a [group, member] tile, padding lanes at -inf."""
    t = tl.program_id(0)
    group, member = tl.arange(0, G_BLOCK), tl.arange(0, PG_BLOCK)
    real = (group < GROUPS)[:, None] & (member < PER_GROUP)[None, :]
    expert = tl.where(real, group[:, None] * PER_GROUP + member[None, :], GROUPS * PER_GROUP)
    row = logits_ptr + t.to(tl.int64) * stride_logits + expert
    logit = summed(row, stride_split, real, SPLITS)  # unrolled: the SPLITS loads go out together
    score = tl.sigmoid(logit)
    choice = tl.where(real, score + tl.load(bias_ptr + expert, mask=real, other=0.0), float("-inf"))
    # A group's score: its two best choices, as topk(2).values.sum() (a tie for the best is both).
    best = tl.max(choice, axis=1)
    first = tl.min(tl.where(choice == best[:, None], member[None, :], PG_BLOCK), axis=1)
    second = tl.max(tl.where(member[None, :] == first[:, None], float("-inf"), choice), axis=1)
    group_score = tl.where(group < GROUPS, best + second, float("-inf"))
    kept = group < 0
    for _ in tl.static_range(TOPK_GROUP):
        pick = _first_max(group_score, group, G_BLOCK)
        kept = kept | (group == pick)
        group_score = tl.where(group == pick, float("-inf"), group_score)
    choice = tl.reshape(tl.where(kept[:, None], choice, float("-inf")), [G_BLOCK * PG_BLOCK])
    expert, score = tl.reshape(expert, [G_BLOCK * PG_BLOCK]), tl.reshape(score, [G_BLOCK * PG_BLOCK])
    slot = tl.arange(0, K_BLOCK)
    weights = tl.zeros([K_BLOCK], dtype=tl.float32)
    ids = tl.zeros([K_BLOCK], dtype=tl.int32)
    for j in tl.static_range(TOP_K):  # the best choice left, each time
        pick = _first_max(choice, expert, GROUPS * PER_GROUP)
        weights = tl.where(slot == j, tl.sum(tl.where(expert == pick, score, 0.0), axis=0), weights)
        ids = tl.where(slot == j, pick, ids)
        choice = tl.where(expert == pick, float("-inf"), choice)
    if NORMALISE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    out = t * TOP_K + slot
    tl.store(weights_ptr + out, weights * scale, mask=slot < TOP_K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=slot < TOP_K)
