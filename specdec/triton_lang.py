"""Triton where it is installed, stand-ins where it is not (a CPU-only install): modules with
kernels stay importable and take their torch paths there (``triton`` is None)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch paths serve
    triton = None
    tl = SimpleNamespace(constexpr=None)


def jit(fn):
    """triton.jit, or the function as it is without Triton (never launched then)."""
    return triton.jit(fn) if triton is not None else fn


def on_triton(*tensors: torch.Tensor) -> bool:
    """The Triton path: CUDA tensors, Triton present, no gradient to track."""
    return (triton is not None and tensors[0].is_cuda
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))
