"""Greedy verification of a draft tree: which path the target agrees with, and the bonus token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn.base import const_arange
from specdec.tree import VerifyTree


@dataclass
class AcceptResult:
    """Per request: accept_len ``[B]`` int64 accepted draft tokens (0..num_steps);
    path ``[B, num_steps + 1]`` int64 tree nodes of the accepted path (path[:, 0] = root; entries
    past accept_len repeat the last accepted node); emitted ``[B, num_steps + 1]`` int64: the
    accepted draft tokens then the bonus token, -1 past ``accept_len + 1``; bonus ``[B]``."""

    accept_len: torch.Tensor
    path: torch.Tensor
    emitted: torch.Tensor
    bonus: torch.Tensor


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
