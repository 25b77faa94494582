"""Sampling: per-request temperature / top-p / top-k, and exact tree rejection sampling.

Verification walks the tree from the root. At each accepted node, its children are tried in
order: child c is accepted with probability ``p(c)`` under the target's (residual) distribution
p; a rejected child's token is removed from p, which is renormalised. If no child is accepted,
the bonus token is drawn from the residual p. Emitting x then has probability exactly p(x)
whatever the draft proposed (for two children c1, c2: P(c2) = (1 - p(c1)) * p(c2) / (1 - p(c1))),
so the target's distribution is preserved; temperature 0 (one-hot p) reduces to greedy.

Random numbers come from a counter-based hash of (request seed, step counter, draw index): each
request's stream is reproducible, independent of batch composition, and needs no host state. A
request without a seed gets a fresh random one at admission (with_seeds).
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Optional, Union

import torch

from specdec.config import as_int, is_real
from specdec.tree import VerifyTree, tempered
from specdec.verify import AcceptResult, path_and_emitted


_FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_p in (0, 1] (1 disables it); top_k 0 disables it; seed picks the
    random stream (None: a fresh random one, which the worker records in ``Request.sampling``).

    Seeds equal modulo 2**62 share a stream (hash_uniform keeps 62 bits). hash_uniform combines
    seed, step and draw linearly before it scrambles them, so seeds some 6e10 or more apart can
    meet another seed's stream a few steps or draws later; random 62-bit seeds practically never do.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        # The worker samples in fp32: a larger temperature would become inf there (every logit 0,
        # top-k/top-p then keeping the lowest token ids).
        if not (is_real(self.temperature) and 0 <= self.temperature <= _FP32_MAX):
            raise ValueError(f"temperature must be a number in [0, {_FP32_MAX:.4g}] (fp32), got {self.temperature!r}")
        if not (is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if as_int(self.top_k) is None or not 0 <= self.top_k < 2**63:
            raise ValueError(f"top_k must be an int64 >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (as_int(self.seed) is None or not -2**63 <= self.seed < 2**63):
            raise ValueError(f"seed must be an int64 or None, got {self.seed!r}")


def with_seeds(params: list[SamplingParams]) -> list[SamplingParams]:
    """Each SamplingParams without a seed with a fresh random one of its own: with one default
    seed, unseeded requests of the same prompt sampled the same tokens (and others drew the same
    uniforms)."""
    return [p if p.seed is not None else dataclasses.replace(p, seed=secrets.randbits(62)) for p in params]


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


def hash_uniform(seed: torch.Tensor, counter: torch.Tensor, draw: Union[int, torch.Tensor]) -> torch.Tensor:
    """Uniform [0, 1) floats from (seed, counter, draw) by a splitmix64-style hash: int64 tensors
    (or an int draw) that broadcast together -> fp64 of their broadcast shape (``[N]`` from
    ``[N]`` seeds and counters and one draw; ``[N, D]`` from ``[N, 1]`` and D draws ``[D]``)."""
    mask = (1 << 62) - 1  # stay in non-negative int64 so shifts are logical
    x = (seed * 0x9E3779B1 + counter * 0x85EBCA77 + draw * 0xC2B2AE3D + 0x27D4EB2F) & mask
    for mult in (0x2545F4914F6CDD1D & mask, 0x5851F42D4C957F2D & mask):
        x = ((x ^ (x >> 29)) * mult) & mask
    x ^= x >> 31
    return (x >> 9).double() / float(1 << 53)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs ``[N, V]`` (need not be normalised), u ``[N]`` -> ``[N]`` int64."""
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    return idx.clamp(max=probs.shape[-1] - 1)


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
    the one vocabulary-wide residual is the bonus's. All draws are hashed at once.
    Few kernels, which an eager step launches one by one and a graph replays one by one: a loop
    over every node with a hash and a residual sum a node made 631 kernels at topk 2, ndt 6, this
    walk 241 (H200, graph replay at V 129280, batch 1: 1.0 -> 0.36 ms).
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
