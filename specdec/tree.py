"""Draft-tree construction: top-k per step, candidate bookkeeping, the verify tree and its mask.

Follows EAGLE-2: every drafted token carries the product of the draft probabilities along its
path; each step expands the ``topk`` best frontier nodes; the verify tree is the root plus the
``num_draft_tokens - 1`` best candidates. A child never scores above its parent, and a stable
sort breaks ties by candidate index (parents come first), so the chosen set is ancestor-closed.
With topk = 1 the draft is a chain (:class:`DraftChain`): every drafted token is verified and
the tree's layout is a constant, so nothing is scored or sorted. All shapes are static: nothing
here reads a device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn.base import const_arange, const_tensor
from specdec import softmax_topk
from specdec.sampling import tempered


def topk_probs(logits: torch.Tensor, k: int, temperature: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (at each row's sampling temperature; 0 = greedy keeps 1) then top-k.

    logits ``[N, V]``, temperature ``[N]`` -> (probs ``[N, k]`` fp32, ids ``[N, k]`` int64).
    Without a temperature, a row with a non-finite logit (a 16-bit head that overflowed) scores
    its k candidates 0: its softmax is NaN, which sorts above every score, so a tree took NaN
    children of a candidate it had not taken. Only the ``[N, k]`` result is cleaned: ``tempered``
    makes several more passes over ``[N, V]``. CUDA logits take one Triton kernel
    (specdec.softmax_topk) that gives the same.
    """
    if softmax_topk.applies(logits, k):
        return softmax_topk.triton_softmax_topk(logits, k, temperature)
    if temperature is None:
        probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return probs.nan_to_num(nan=0.0), ids
    return torch.softmax(tempered(logits, temperature), dim=-1).topk(k, dim=-1)


def head_logits(model, hidden: torch.Tensor, greedy: bool = True) -> tuple[torch.Tensor, Optional[object]]:
    """(model.compute_logits(hidden), its rows' greedy picks or None). The picks come from the
    model's ``compute_logits_argmax`` where it has one and ``greedy`` asks for them: an object
    with ``argmax()`` (``[N]`` int64, as logits.argmax(-1)) and ``top1()`` (topk_probs(logits,
    1)), e.g. specdec.models.gemv.HeadPick, which the head's GEMV fills as it writes the logits."""
    fused = getattr(model, "compute_logits_argmax", None) if greedy else None
    return fused(hidden) if fused is not None else (model.compute_logits(hidden), None)


def candidates(model, hidden: torch.Tensor, k: int, temperature: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_probs(model.compute_logits(hidden), k, temperature): at k = 1 without a temperature
    from the head's greedy picks where the model gives them (head_logits)."""
    logits, pick = head_logits(model, hidden, k == 1 and temperature is None)
    return pick.top1() if pick is not None else topk_probs(logits, k, temperature)


@dataclass
class VerifyTree:
    """The tree verified for each request; node 0 is the root (last verified token).

    tokens / parents / depth / child_rank: ``[B, ndt]`` int64 (root: parent 0, depth 0, rank 0);
    child_rank is the token's rank among its parent's draft top-k (0 = the draft's greedy choice).
    mask: ``[B, ndt, ndt]`` bool, ``mask[b, i, j]``: node j is an ancestor of node i or i itself.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    child_rank: torch.Tensor
    mask: torch.Tensor


class DraftTree:
    """Accumulates the candidates of one multi-step draft for a batch of ``B`` requests.

    The frontier (``topk`` nodes per request) is what the next draft forward consumes.
    """

    def __init__(self, probs: torch.Tensor, ids: torch.Tensor) -> None:
        """Start from the first step's top-k: probs / ids ``[B, topk]``."""
        batch, self.topk = ids.shape
        device = ids.device
        self.scores = [probs]
        self.tokens = [ids]
        self.parents = [torch.full_like(ids, -1)]
        self.ranks = [torch.arange(self.topk, device=device).expand(batch, -1)]
        self.frontier_scores = probs
        self.frontier_index = torch.arange(self.topk, device=device).expand(batch, -1)  # candidate index
        self.frontier_tokens = ids
        self.frontier_parent = torch.zeros_like(ids)  # which previous frontier slot each node grew from
        self._num_candidates = self.topk

    def grow(self, probs: torch.Tensor, ids: torch.Tensor) -> None:
        """Add the children of every frontier node and pick the next frontier.

        probs / ids: ``[B, topk (frontier), topk (children)]`` from one draft forward.
        """
        batch, k = self.frontier_scores.shape
        cumulative = (self.frontier_scores[:, :, None] * probs).flatten(1)  # [B, k*k]
        parents = self.frontier_index[:, :, None].expand(-1, -1, k).flatten(1)
        self.scores.append(cumulative)
        self.tokens.append(ids.flatten(1))
        self.parents.append(parents)
        self.ranks.append(torch.arange(k, device=ids.device).repeat(k).expand(batch, -1))
        order = torch.sort(cumulative, dim=1, descending=True, stable=True).indices[:, :k]
        self.frontier_scores = cumulative.gather(1, order)
        self.frontier_tokens = ids.flatten(1).gather(1, order)
        self.frontier_parent = order // k
        self.frontier_index = order + self._num_candidates
        self._num_candidates += k * k

    def build(self, root: torch.Tensor, num_draft_tokens: int, num_steps: int, mask_out: Optional[torch.Tensor] = None) -> VerifyTree:
        """Choose the best ``num_draft_tokens - 1`` candidates and lay out the verify tree.

        root: ``[B]`` int64 last verified tokens. mask_out: the backend's preallocated
        ``[max_bs, >= ndt, >= ndt]`` bool buffer, filled in place (a new tensor if None).
        """
        scores = torch.cat(self.scores, dim=1)
        tokens = torch.cat(self.tokens, dim=1)
        parents = torch.cat(self.parents, dim=1)
        ranks = torch.cat(self.ranks, dim=1)
        batch, device, n = root.shape[0], root.device, num_draft_tokens - 1
        chosen = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
        chosen = chosen.sort(dim=1).values  # candidate order puts parents before children

        node_of = torch.zeros(batch, scores.shape[1] + 1, dtype=torch.long, device=device)  # slot 0: root (-1)
        node_of.scatter_(1, chosen + 1, torch.arange(1, n + 1, device=device).expand(batch, -1))
        chosen_parents = parents.gather(1, chosen)
        tree_parents = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device), node_of.gather(1, chosen_parents + 1)], 1)
        tree_tokens = torch.cat([root[:, None], tokens.gather(1, chosen)], 1)
        tree_ranks = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device), ranks.gather(1, chosen)], 1)

        eye = torch.eye(n + 1, dtype=torch.bool, device=device).expand(batch, -1, -1)
        mask = eye.clone()
        ancestor = tree_parents
        for _ in range(num_steps):  # walk up: the tree is at most num_steps deep
            mask |= torch.nn.functional.one_hot(ancestor, n + 1).bool()
            ancestor = tree_parents.gather(1, ancestor)
        depth = mask.sum(-1) - 1
        if mask_out is not None:
            mask_out[:batch, : n + 1, : n + 1].copy_(mask)
            mask = mask_out[:batch, : n + 1, : n + 1]
        return VerifyTree(tree_tokens, tree_parents, depth, tree_ranks, mask)


class DraftChain:
    """:class:`DraftTree`'s interface for topk = 1: the verify tree is the root then every
    drafted token in order (num_draft_tokens = num_steps + 1), so the draft probabilities play
    no part and parents, depth, ranks and mask are constants."""

    def __init__(self, probs: torch.Tensor, ids: torch.Tensor) -> None:
        """ids ``[B, 1]``: the first step's token (probs unused)."""
        self.frontier_tokens = ids
        self.tokens = [ids]

    def grow(self, probs: torch.Tensor, ids: torch.Tensor) -> None:
        """ids ``[B, 1, 1]``: the next token of each chain (probs unused)."""
        self.frontier_tokens = ids.flatten(1)
        self.tokens.append(self.frontier_tokens)

    def build(self, root: torch.Tensor, num_draft_tokens: int, num_steps: int, mask_out: Optional[torch.Tensor] = None) -> VerifyTree:
        """root ``[B]`` int64; the tree of ``num_draft_tokens`` nodes, which must be num_steps + 1."""
        if num_draft_tokens != len(self.tokens) + 1:
            raise ValueError(f"a chain of {len(self.tokens)} drafted tokens verifies {len(self.tokens) + 1} nodes, "
                             f"not num_draft_tokens={num_draft_tokens}")
        batch, n = root.shape[0], num_draft_tokens
        depth, parents, ranks, mask = (t.expand(batch, *t.shape[1:]) for t in chain_layout(n, root.device))
        if mask_out is not None:
            mask_out[:batch, :n, :n].copy_(mask)
            mask = mask_out[:batch, :n, :n]
        return VerifyTree(torch.cat([root[:, None], *self.tokens], dim=1), parents, depth, ranks, mask)


def chain_layout(n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A chain of ``n`` nodes' (depth, parents, ranks) ``[1, n]`` int64 and mask ``[1, n, n]`` bool,
    constants (const_tensor). E.g. n = 3: depth [0, 1, 2], parents [0, 0, 1], ranks [0, 0, 0],
    mask lower-triangular (every earlier node is an ancestor)."""
    depth = const_arange(n, device)[None, :]
    return (depth,
            const_tensor(("chain parents", n), device,
                         lambda dev: (torch.arange(n, device=dev) - 1).clamp(min=0)[None]),
            const_tensor(("chain ranks", n), device, lambda dev: torch.zeros(1, n, dtype=torch.long, device=dev)),
            const_tensor(("chain mask", n), device,
                         lambda dev: torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None]))


def start_tree(probs: torch.Tensor, ids: torch.Tensor) -> DraftTree | DraftChain:
    """The accumulator of one multi-step draft from its first candidates ``[B, topk]``: a
    DraftChain for topk = 1, else a DraftTree."""
    return DraftChain(probs, ids) if ids.shape[1] == 1 else DraftTree(probs, ids)
