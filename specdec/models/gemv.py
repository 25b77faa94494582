"""Decode GEMMs of a few rows as weight reads: one Triton kernel streams each weight once; for the
MLP's down projection it computes SwiGLU's silu(gate) * up as it loads its input, so that step
costs no launch of its own (also from partial sums of the gate/up GEMM: silu_linear_partials).

Why our own kernel: cuBLAS runs GEMMs of a few rows at about half the read bandwidth. The silu
fold computes on the block's real rows only (repeated to the 16 rows a dot takes): on all 16 it
cost more than the launch it saves. Larger and fp32 GEMMs go to cuBLAS (fp32: tensor cores would
round it to tf32); CPU and autograd take the torch path.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from specdec.models import ops
from specdec.triton_lang import jit as _jit, on_triton, tl, triton

GEMV_MAX_ROWS = 16  # decode GEMMs of at most this many rows stream the weight once in the GEMV


def _streams(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The GEMV serves: a 16-bit x of at most GEMV_MAX_ROWS unit-stride rows, a contiguous weight of
    x's dtype."""
    return (on_triton(x, weight) and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and weight.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x ``[M, K]`` @ weight ``[N, K]``^T -> ``[M, N]`` in x's dtype, then in ``out_dtype`` if given
    (logits: rounded to x's dtype, then widened, as ``linear(x, w).float()``)."""
    if _streams(x, weight):
        return triton_linear(x, weight, out_dtype=out_dtype)
    out = F.linear(x, weight)
    return out if out_dtype is None else out.to(out_dtype)


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(ops.silu_mul(gate_up), weight): gate_up ``[M, 2I]`` (gate ++ up), weight ``[N, I]``
    -> ``[M, N]``; silu * up computed as the GEMV loads it where the GEMV serves."""
    if _streams(gate_up, weight):
        return triton_silu_linear(gate_up, weight)
    return linear(ops.silu_mul(gate_up), weight)


def silu_linear_partials(partials: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_linear of a gate/up GEMM's output given as partial sums: partials ``[S, M, 2I]`` fp32
    (unit stride in 2I: moe_kernels.router_logits' extra columns), weight ``[N, I]`` 16-bit ->
    ``[M, N]`` in weight's dtype. gate_up is the S partials summed in order in fp32, rounded to
    weight's dtype as linear's output is; the GEMV sums them as it loads its input where it serves.
    E.g. the rank slice's shared expert: ``[14, 1, 512]`` and ``[7168, 256]`` -> ``[1, 7168]``."""
    if (on_triton(partials, weight) and partials.dim() == 3 and partials.dtype == torch.float32
            and partials.shape[1] <= GEMV_MAX_ROWS and partials.stride(2) == 1 and weight.is_contiguous()
            and weight.dtype in (torch.bfloat16, torch.float16)):
        return triton_silu_linear_partials(partials, weight)
    return silu_linear(summed_in_order(partials).to(weight.dtype), weight)


def summed_in_order(partials: torch.Tensor) -> torch.Tensor:
    """``[S, ...]`` -> their sum, added first to last (the order the kernels add them in)."""
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    return total


def gemv_config(n: int, k: int, sms: int = 132, silu: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight ``[n, k]`` on ``sms`` multiprocessors.

    The weight streams at the bandwidth only with every SM reading: the narrowest tile of 16-64 rows
    whose programs fit one wave, e.g. qkv_a ``[2112, 7168]``: 132 programs of 16 rows, not 33 of 64.
    silu: K tiles of at most 256 (the fold's registers), 4 stages.
    """
    block_n = next((b for b in (16, 32) if -(-n // b) <= sms), 64)
    fit = 1 << max(4, (k - 1).bit_length())  # no K tile past the weight's next power of two
    if silu:
        return block_n, min(fit, 256), 4, 4
    if block_n < 64:
        return block_n, min(fit, 512 if block_n == 16 else 256), 4, 4
    return 64, min(fit, 256 if k >= 4096 else 128), 4, (5 if k >= 4096 else 6)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, config: Optional[tuple[int, int, int, int]] = None,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """linear's GEMV: rows of unit stride, a contiguous weight; ``config`` as gemv_config gives it."""
    return _launch(x, weight, False, config, out_dtype)


def triton_silu_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                       config: Optional[tuple[int, int, int, int]] = None) -> torch.Tensor:
    """silu_linear's GEMV: gate_up of unit-stride rows."""
    return _launch(gate_up, weight, True, config, None)


def triton_silu_linear_partials(partials: torch.Tensor, weight: torch.Tensor,
                                config: Optional[tuple[int, int, int, int]] = None) -> torch.Tensor:
    """silu_linear_partials' GEMV: fp32 partials ``[S, M, 2I]`` of unit stride in 2I."""
    if partials.dim() != 3 or partials.dtype != torch.float32:
        raise ValueError(f"silu_linear_partials: partials {tuple(partials.shape)} {partials.dtype}: expected fp32 "
                         "[S, M, 2I]")
    return _launch(partials, weight, True, config, weight.dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, silu: bool, config, out_dtype) -> torch.Tensor:
    """x ``[M, K]`` (``[M, 2K]`` for silu), or for silu ``[S, M, 2K]`` partial sums of it."""
    splits = x.shape[0] if x.dim() == 3 else 1
    m = x.shape[-2]
    n, k = weight.shape
    if x.shape[-1] != (2 * k if silu else k) or (x.dim() == 3 and not silu):
        raise ValueError(f"linear: the input is {tuple(x.shape)}, the weight {tuple(weight.shape)}")
    out = x.new_empty(m, n, dtype=out_dtype or x.dtype)
    if m:
        block_n, block_k, warps, stages = config or gemv_config(n, k, _multiprocessors(x.device), silu)
        if splits > 1:  # S partial tiles a K step would not fit shared memory as a pipeline's stages
            stages = 1
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, 16))
        _gemv_kernel[grid](x, weight, out, m, n, k, x.stride(-2), x.stride(0) if splits > 1 else 0, SILU=silu,
                           SPLITS=splits, ROUND_IN=x.dtype != weight.dtype, ROUND_OUT=out.dtype != weight.dtype,
                           ROWS=min(16, 1 << (m - 1).bit_length()) if silu else 1, ONE_BLOCK=m if m <= 16 else 0,
                           BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@_jit
def _summed(ptrs, stride, mask, SPLITS: tl.constexpr):
    """The SPLITS tensors at ``ptrs + s * stride`` added in order, in fp32."""
    total = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLITS):
        total += tl.load(ptrs + s * stride, mask=mask, other=0.0).to(tl.float32)
    return total


@_jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_xs, SILU: tl.constexpr, SPLITS: tl.constexpr,
                 ROUND_IN: tl.constexpr, ROUND_OUT: tl.constexpr, ROWS: tl.constexpr, ONE_BLOCK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: BLOCK_N output columns of BLOCK_M rows, over all of K (no split: no second
    pass); the weight tile streams through once, the few x rows come from L2. SILU: x is
    silu(gate) * up of the ``[M, 2K]`` input, computed on ROWS rows (a power of two >= the block's
    rows) and repeated to BLOCK_M for the dot; the input is the sum of SPLITS partials
    ``stride_xs`` apart, rounded to the weight's dtype where ROUND_IN. ROUND_OUT: the fp32 output
    rounded to the weight's dtype, then widened (fp32 logits). ONE_BLOCK: M itself where it is at
    most BLOCK_M (one row block; 0 else), so that the rows' masks are compile-time constants and
    the input's copies carry no per-row predicates (docs/kernels.md)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row0 = 0 if ONE_BLOCK else tl.program_id(1) * BLOCK_M
    if ONE_BLOCK:
        M = ONE_BLOCK
    rm = row0 + tl.arange(0, BLOCK_M)
    dtype = w_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn < N)[:, None] & (rk < K)[None, :], other=0.0)
        if SILU:
            rs = row0 + tl.arange(0, ROWS)
            mask = (rs < M)[:, None] & (rk < K)[None, :]
            rows = x_ptr + rs[:, None] * stride_xm + rk[None, :]
            gate = _summed(rows, stride_xs, mask, SPLITS)
            up = _summed(rows + K, stride_xs, mask, SPLITS)
            if ROUND_IN:
                gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # rounded as torch's F.silu
            xs = (act * up).to(dtype)
            x = tl.reshape(tl.broadcast_to(xs[None, :, :], [BLOCK_M // ROWS, ROWS, BLOCK_K]), [BLOCK_M, BLOCK_K])
            x = tl.where((tl.arange(0, BLOCK_M) < ROWS)[:, None], x, tl.zeros_like(x))  # the copies past ROWS: 0
        else:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None] & (rk < K)[None, :],
                        other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if ROUND_OUT:
        acc = acc.to(dtype).to(tl.float32)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])
