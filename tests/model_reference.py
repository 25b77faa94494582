"""The arithmetic of transformers' DeepSeek-V3 layers the model's kernels are checked against,
written out in plain torch (tests/test_ops.py, tests/test_moe.py)."""

from __future__ import annotations

import torch


def norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepseekV3RMSNorm: x ``[..., D]`` normed in fp32, rounded to x's dtype, times w ``[D]``."""
    f = x.float()
    return w * (f / torch.sqrt(f.square().sum(-1, keepdim=True) / f.shape[-1] + eps)).to(x.dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """transformers' rotate_half form: x ``[T, ..., 64]`` fp32, cos / sin ``[T, 32]``; interleave:
    the pairs (x0, x1), (x2, x3), ... de-interleaved first."""
    if interleave:
        x = x.unflatten(-1, (32, 2)).transpose(-1, -2).flatten(-2)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (64,)
    c, s = torch.cat([cos, cos], -1).view(shape), torch.cat([sin, sin], -1).view(shape)
    return x * c + torch.cat([-x[..., 32:], x[..., :32]], -1) * s
