"""Acceptance: which drafted tokens a step keeps, and where each request's output stops.

Greedy (topk = 1 chains and trees) accepts the longest path the target's argmax agrees with. With
sampling on, tree rejection sampling walks the tree from the root: at each accepted node its
children are tried in order, child c taken with probability ``p(c)`` under the target's residual
distribution p; a rejected child's token leaves p, which is renormalised; if none is taken the
bonus is drawn from the residual. Emitting x then has probability exactly p(x) whatever the draft
proposed (two children: P(c2) = (1 - p(c1)) * p(c2) / (1 - p(c1))), and temperature 0 (a one-hot
p) reduces to greedy. Then the stop rules cut each output at eos and max_new_tokens. All shapes are
static: nothing here reads a device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn.base import const_arange
from specdec.sampling import hash_uniform, sample_from, tempered
from specdec.tree import VerifyTree


@dataclass
class AcceptResult:
    """Per request: accept_len ``[B]`` int64 accepted draft tokens (0..num_steps);
    path ``[B, num_steps + 1]`` int64 tree nodes of the accepted path (path[:, 0] = root; entries
    past accept_len repeat the last accepted node); emitted ``[B, num_steps + 1]`` int64: the
    accepted draft tokens then the bonus token, -1 past ``accept_len + 1``; bonus ``[B]``;
    extend_ids ``[B, num_steps + 1]`` int64 or None: draft-extend's input tokens, emitted up to
    ``accept_len + 1`` and any token id past it, where the acceptance has them at no cost (None:
    emitted with its -1 as 0)."""

    accept_len: torch.Tensor
    path: torch.Tensor
    emitted: torch.Tensor
    bonus: torch.Tensor
    extend_ids: Optional[torch.Tensor] = None


def greedy_accept(tree: VerifyTree, target_pred: torch.Tensor, num_steps: int) -> AcceptResult:
    """Accept the longest tree path whose every token is the target's argmax at its parent.

    target_pred: ``[B, ndt]`` int64, the target's argmax after each tree node. Siblings carry
    distinct tokens, so at most one path matches.
    """
    correct = tree.tokens == target_pred.gather(1, tree.parents)
    correct[:, 0] = True
    accepted = correct.clone()
    for _ in range(num_steps):  # a node is accepted when it and all its ancestors are correct
        accepted = correct & accepted.gather(1, tree.parents)
    last = (accepted * (tree.depth + 1)).argmax(dim=1)  # the deepest accepted node
    accept_len = tree.depth.gather(1, last[:, None]).squeeze(1)
    bonus = target_pred.gather(1, last[:, None]).squeeze(1)
    return path_and_emitted(tree, last, accept_len, bonus, num_steps)


def chain_accept(tree: VerifyTree, target_pred: torch.Tensor, num_steps: int) -> AcceptResult:
    """greedy_accept for a chain tree (topk = 1, ``[B, num_steps + 1]`` nodes, node i's parent
    i - 1): the accepted drafts are the longest prefix equal to the target's argmaxes, so the
    emitted tokens are the target's own argmaxes up to accept_len, the bonus included."""
    steps = const_arange(num_steps + 1, target_pred.device)
    accept_len = (tree.tokens[:, 1:] == target_pred[:, :-1]).cumprod(dim=1).sum(dim=1)  # [B] int64
    bonus = target_pred.gather(1, accept_len[:, None]).squeeze(1)
    emitted = target_pred.masked_fill(steps[None, :] > accept_len[:, None], -1)
    return AcceptResult(accept_len, torch.minimum(steps[None, :], accept_len[:, None]), emitted, bonus)


def path_and_emitted(tree: VerifyTree, last: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor, num_steps: int) -> AcceptResult:
    """The AcceptResult of a verification that ended at tree node ``last`` (``[B]``) with ``bonus``."""
    batch, device = last.shape[0], last.device
    on_path = tree.mask[torch.arange(batch, device=device), last]  # ancestors of `last`, itself included
    steps = torch.arange(num_steps + 1, device=device)
    at_depth = on_path[:, None, :] & (tree.depth[:, None, :] == steps[None, :, None])  # [B, S+1, ndt]
    path = torch.where(at_depth.any(-1), at_depth.int().argmax(-1), last[:, None])
    drafted = tree.tokens.gather(1, path[:, 1:])  # [B, num_steps]
    emitted = torch.cat([drafted, torch.full_like(bonus[:, None], -1)], dim=1)
    emitted.scatter_(1, accept_len[:, None], bonus[:, None])
    # (an index put by a mask counts the mask on the host unless the value is a scalar)
    emitted.masked_fill_(steps[None, :] > accept_len[:, None], -1)
    return AcceptResult(accept_len, path, emitted, bonus)


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The distribution each request samples from. logits ``[N, V]``; per-row parameters ``[N]``.

    Temperature 0 gives a one-hot of torch.argmax's choice, as target-only greedy decoding picks
    (non-finite logits included). Returns ``[N, V]`` fp32.
    """
    scaled = tempered(logits, temperature)
    # Stable: tied logits keep index order, so rank 0 is argmax's choice.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    drop = ranks >= k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix reaching top_p, and at least the first token. Only where top_p < 1:
    # the fp32 running sum reaches 1 before the tail, which top_p = 1 must keep.
    beyond_p = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]
    drop |= beyond_p & (top_p < 1)[:, None] & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, torch.softmax(sorted_logits, dim=-1))
    greedy = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where((temperature <= 0)[:, None], greedy, probs)


def tree_rejection_sample(
    tree: VerifyTree, probs: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor, num_steps: int,
    max_children: Optional[int] = None,
) -> AcceptResult:
    """Walk the tree accepting children by target probability; draw the bonus from the residual.

    probs: ``[B, ndt, V]`` target distributions after each tree node (target_probs);
    seed / counter: ``[B]`` int64 random stream of each request; max_children: most children a
    node has (the draft's topk; None: ndt - 1). Static loop bounds: no host sync.

    At node n, child j (tried in index order) is taken with probability residual[token_j] /
    sum(residual), the residual being probs[n] less the tokens of the children rejected before
    it, with draw ``depth * ndt + j``; the bonus comes from the residual where the walk stopped,
    with draw ``num_steps * ndt + ndt``. Siblings' tokens differ, so a rejection only lowers the
    sum: the walk runs on ``[B, max_children]`` gathers of the children's probabilities and the
    rows' sums (a threshold may then differ from a sum over the residual in its last bits), and
    the one vocabulary-wide residual is the bonus's. All draws are hashed at once: few kernels.
    """
    batch, ndt, _ = probs.shape
    device = probs.device
    rows = torch.arange(batch, device=device)
    nodes = torch.arange(ndt, device=device)
    max_children = ndt - 1 if max_children is None else max_children
    u = hash_uniform(seed[:, None], counter[:, None], torch.arange(num_steps * ndt + ndt + 1, device=device))
    # children[b, n, r]: node n's r-th child in index order, 0 where it has fewer (the root is nobody's child).
    child_of = (tree.parents[:, None, :] == nodes[None, :, None]) & (nodes > 0)  # [B, n, j]
    rank = torch.where(child_of, child_of.long().cumsum(-1) - 1, max_children).clamp(max=max_children)
    children = torch.zeros(batch, ndt, max_children + 1, dtype=torch.long, device=device)
    children.scatter_(2, rank, torch.where(child_of, nodes, 0))  # column max_children: the rest, dropped
    children = children[:, :, :max_children]
    child_tokens = tree.tokens.gather(1, children.flatten(1)).view(children.shape)  # [B, n, r]
    child_p = probs.gather(2, child_tokens)  # [B, n, r]: each child's token under its parent's distribution
    total = probs.sum(-1)  # [B, ndt]
    support = (probs > 0).sum(-1)  # [B, ndt]: tokens with mass
    cur = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)  # still descending
    accept_len = torch.zeros_like(cur)
    for depth in range(num_steps):
        moved = torch.zeros_like(active)
        kids, kid_p, left, left_tokens = children[rows, cur], child_p[rows, cur], total[rows, cur], support[rows, cur]
        kid_has_mass = kid_p > 0
        for r in range(max_children):
            j = kids[:, r]
            is_child = active & ~moved & (j > 0)
            # A child holding the residual's last token with mass is taken outright: its threshold is
            # 1, which left (the sum less the rejected siblings', rounded) can miss by an ulp.
            last = kid_has_mass[:, r] & (left_tokens == 1)
            take = is_child & ((u[rows, depth * ndt + j] < kid_p[:, r] / left.clamp_min(1e-30)) | last)
            refused = is_child & ~take
            left = torch.where(refused, left - kid_p[:, r], left)
            left_tokens = torch.where(refused & kid_has_mass[:, r], left_tokens - 1, left_tokens)
            cur = torch.where(take, j, cur)
            moved |= take
        accept_len += moved
        active &= moved
    # Where the walk stopped short, it rejected every child of its node.
    rejected = (children[rows, cur] > 0) & active.logical_not()[:, None]
    # (a product: a padding column's token, the root's, may be a rejected child's too)
    residual = probs[rows, cur].scatter_reduce_(1, child_tokens[rows, cur], rejected.logical_not().to(probs.dtype), "prod")
    bonus = sample_from(residual, u[:, -1])
    return path_and_emitted(tree, cur, accept_len, bonus, num_steps)


def stop_at_limits(result: AcceptResult, seq_lens: torch.Tensor, limit: torch.Tensor, eos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each request's output stops this step. seq_lens ``[B]`` int64: N; limit ``[B]``
    int64: the N at which max_new_tokens run out; eos ``[B]`` int64 (-1: none).

    Returns take ``[B]`` int64: how many leading ``result.emitted`` tokens join the output (the
    accepted ones and the bonus, cut after the first eos and at the limit), and done ``[B]``
    bool: the request ends with this step.
    """
    cols = const_arange(result.emitted.shape[1], result.emitted.device)
    take = torch.minimum(result.accept_len + 1, limit - seq_lens)
    hit = (result.emitted == eos[:, None]) & (cols < take[:, None])
    first_eos = torch.where(hit, cols, cols.shape[0]).amin(dim=1)  # emitted.shape[1]: none
    take = torch.minimum(take, first_eos + 1)
    return take, (first_eos < cols.shape[0]) | (seq_lens + take >= limit)
