"""Triton where it is installed, stand-ins where it is not (a CPU-only install): attn's kernel
modules stay importable, their signatures defined, and take their torch paths there (``triton``
is None). specdec has its own twin (specdec/triton_lang.py): attn imports nothing of specdec."""

from __future__ import annotations

from types import SimpleNamespace

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install
    triton = None
    tl = SimpleNamespace(constexpr=None)


def jit(fn):
    """triton.jit, or the function as it is without Triton (never launched then)."""
    return triton.jit(fn) if triton is not None else fn
