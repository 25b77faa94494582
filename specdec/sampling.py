"""Sampling parameters and random numbers: per-request temperature / top-p / top-k, and
counter-based uniforms.

Random numbers come from a counter-based hash of (request seed, step counter, draw index): each
request's stream is reproducible, independent of batch composition, and needs no host state. A
request without a seed gets a fresh random one at admission (with_seeds). How a step uses them
to accept drafted tokens is specdec.accept.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Optional, Union

import torch

from attn.values import as_int, is_real


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


def tempered(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[N, V]`` at each row's temperature ``[N]`` (0: left as they are, greedy),
    shifted by the row maximum first, so a tiny temperature sends the rest to -inf and never
    the maximum to inf. Non-finite logits (a 16-bit head that overflowed): NaN counts as -inf, a
    row with +inf keeps only its +inf tokens (equally likely), a row of nothing finite all its
    tokens; shifting them made the row NaN, which sampled the last token id."""
    logits = logits.float().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    top = logits.amax(-1, keepdim=True)
    shifted = torch.where(top.isfinite(), logits - top, torch.where(logits == top, 0.0, float("-inf")))
    return shifted / torch.where(temperature > 0, temperature, 1.0)[:, None]


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
