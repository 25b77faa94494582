"""Weights pulled into L2 ahead of the GEMV that reads them, while latency-bound kernels leave the
memory idle: a cache hint, nothing computed changes.

At decode a layer's attention core (the latents, the query, attention and its reduce, the value
product) is latency-bound and reads a few MB; o_proj's 29 MB come right after (a TP8 rank of
DeepSeek-V3). :func:`prefetch` issued after qkv_a lets q_b and o_proj read from L2.
One Triton kernel of PTX prefetches (``cp.async.bulk.prefetch.L2``: the copy engine fetches a
chunk per instruction, the issuing program does not wait for it).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from specdec.triton_lang import jit as _jit, tl, triton

CHUNK = 4096  # bytes one prefetch instruction covers
LANES = 128  # chunks a program issues


def serves(weight: torch.Tensor) -> bool:
    """The kernel runs: a contiguous CUDA tensor of at least one chunk, Triton compiled (not its
    interpreter, which has no PTX)."""
    return (triton is not None and weight.is_cuda and weight.is_contiguous()
            and weight.numel() * weight.element_size() >= CHUNK and os.environ.get("TRITON_INTERPRET") != "1")


def prefetch(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> None:
    """Ask the GPU to pull ``a`` and ``b`` (contiguous tensors) into L2 now, in one launch; their
    trailing bytes past a whole chunk are left to their readers. A no-op where :func:`serves` is
    false. E.g. o_proj ``[7168, 2048]`` bf16: 7168 chunks, 56 programs."""
    tensors = [t for t in (a, b) if t is not None and serves(t)]
    if not tensors:
        return
    first, second = tensors[0], tensors[-1]
    chunks = [t.numel() * t.element_size() // CHUNK for t in (first, second)]
    if second is first:
        chunks[1] = 0
    programs = triton.cdiv(chunks[0], LANES) + triton.cdiv(chunks[1], LANES)
    _prefetch_kernel[(programs,)](first, chunks[0], second, chunks[1], CHUNK=CHUNK, LANES=LANES, num_warps=4)


@_jit
def _prefetch_kernel(a_ptr, a_chunks, b_ptr, b_chunks, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Programs [0, ceil(a_chunks / LANES)) prefetch a's chunks, the rest b's; a lane per chunk."""
    pid = tl.program_id(0)
    a_programs = tl.cdiv(a_chunks, LANES)
    on_a = pid < a_programs
    base = tl.where(on_a, a_ptr.to(tl.pointer_type(tl.int8)), b_ptr.to(tl.pointer_type(tl.int8)))
    chunk = tl.where(on_a, pid, pid - a_programs) * LANES + tl.arange(0, LANES)
    real = chunk < tl.where(on_a, a_chunks, b_chunks)
    size = tl.where(real, CHUNK, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + tl.where(real, chunk, 0).to(tl.int64) * CHUNK, size], dtype=tl.int32, is_pure=False,
        pack=1)
