"""The draft's softmax and top-k in one Triton kernel (specdec.tree.topk_probs' GPU path).

Why: torch's softmax and top-k over a draft row are single-block kernels, about 45 us a step
for a 16160-token vocabulary; this is one launch, one program a row, reading the logits once.
Same results as the torch path: probabilities to fp32 rounding, ties to the lower token id.
"""

from __future__ import annotations

from typing import Optional

import torch

from specdec.triton_lang import jit as _jit, on_triton, tl, triton

MAX_K = 16  # candidates the kernel keeps a row (its selection is unrolled); more go to torch
CHUNK = 16384  # logits a program reads at once (16 warps past 4096: a draft row of 16160 in one pass)


def applies(logits: torch.Tensor, k: int) -> bool:
    """The kernel serves CUDA logits ``[N, V]`` (rows of unit stride, ids below 2**31) for k <= MAX_K."""
    return (on_triton(logits) and logits.dim() == 2 and logits.stride(1) == 1
            and 1 <= k <= min(MAX_K, logits.shape[1]) and logits.shape[1] < 2**31)


def triton_softmax_topk(logits: torch.Tensor, k: int,
                        temperature: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[N, V]`` (any float dtype), temperature ``[N]`` or None -> (probs ``[N, k]`` fp32,
    ids ``[N, k]`` int64), as topk_probs defines them: without a temperature a row holding NaN or
    no finite maximum scores 0; with one, NaN counts as -inf, a row with +inf spreads over its +inf
    tokens and a row with nothing finite is uniform; temperature 0 is softmax at 1."""
    n, vocab = logits.shape
    probs = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    if n:
        has_t = temperature is not None
        block = min(CHUNK, triton.next_power_of_2(vocab))
        _softmax_topk_kernel[(n,)](logits, temperature if has_t else probs, probs, ids, vocab, logits.stride(0),
                                   K=k, K_PAD=triton.next_power_of_2(k), HAS_T=has_t,
                                   BLOCK=block, num_warps=16 if block > 4096 else 8)
    return probs, ids


@_jit
def _keys(x, offs):
    """One int64 a logit that orders (value, then lower id) as an integer: the fp32 bits made
    monotonic in the high word, the complemented id in the low word."""
    bits = x.to(tl.int32, bitcast=True)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    low = tl.full([], 0xFFFFFFFF, tl.int64)
    return (mono.to(tl.int64) << 32) + (low - offs.to(tl.int64))


@_jit
def _softmax_topk_kernel(x_ptr, t_ptr, probs_ptr, ids_ptr, V, stride_x, K: tl.constexpr, K_PAD: tl.constexpr,
                         HAS_T: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    inf = float("inf")
    temp = 1.0
    if HAS_T:
        t = tl.load(t_ptr + row).to(tl.float32)
        temp = tl.where(t > 0, t, 1.0)
    slots = tl.arange(0, K_PAD)
    top = tl.full([K_PAD], -2**63, tl.int64)  # the running top-k keys, best first
    m = -inf  # the running maximum, NaN as -inf
    s = 0.0  # sum of exp((x - m) / temp) over the row so far (meaningful while m is finite)
    n_nan = 0
    n_posinf = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=-inf).to(tl.float32)
        nan = x != x
        n_nan += tl.sum(nan.to(tl.int32), axis=0)
        x = tl.where(nan, -inf, x)
        n_posinf += tl.sum((x == inf).to(tl.int32), axis=0)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        alpha = tl.where(m_new == m, 1.0, tl.exp((m - m_new) / temp))
        e = tl.where(x == -inf, 0.0, tl.exp((x - m_new) / temp))
        s = s * alpha + tl.where(m_new < inf, tl.sum(e, axis=0), 0.0)
        m = m_new
        # merge: the k best of (running top, this chunk), the running ones first at equal keys
        key = tl.where(offs < V, _keys(x, offs), -2**63)
        merged = tl.full([K_PAD], -2**63, tl.int64)
        for i in tl.static_range(K):
            best_top = tl.max(top, axis=0)
            best_new = tl.max(key, axis=0)
            pick = tl.maximum(best_top, best_new)
            merged = tl.where(slots == i, pick, merged)
            top = tl.where(top == pick, -2**63, top)
            key = tl.where(key == pick, -2**63, key)
        top = merged
    low = tl.full([], 0xFFFFFFFF, tl.int64)
    ids = low - (top & low)
    mono = (top >> 32).to(tl.int32)
    v = (mono ^ ((mono >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    finite = (m > -inf) & (m < inf)
    p = tl.exp((v - tl.where(finite, m, 0.0)) / temp) / s
    p = tl.where(v == -inf, 0.0, p)
    if HAS_T:
        p = tl.where(finite, p, tl.where(m == inf, tl.where(v == inf, 1.0 / n_posinf.to(tl.float32), 0.0),
                                          1.0 / V.to(tl.float32)))
    else:
        p = tl.where(finite & (n_nan == 0) & (n_posinf == 0), p, 0.0)
    keep = slots < K
    tl.store(probs_ptr + row * K + slots, p, mask=keep)
    tl.store(ids_ptr + row * K + slots, ids, mask=keep)
