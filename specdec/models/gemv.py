"""Decode GEMMs of up to 32 rows as weight reads: one Triton kernel streams each weight once, as
weight tile @ x tile^T (a wgmma at 64 weight rows). Its epilogues: silu(gate) * up for the MLP's
gate/up GEMM (linear_silu), so down is a plain GEMV; the head's per-program argmax and softmax sums
(triton_linear_argmax), so a greedy token is one small reduce; a per-token table row added
(linear_add_rows); or fp32 partial sums over parts of K for a weight of few rows (linear_parts,
summed by the kernel that reads them).

Why our own kernel: cuBLAS runs GEMMs of a few rows at about half the read bandwidth. Larger and
fp32 GEMMs go to cuBLAS (fp32: tensor cores would round it to tf32); CPU and autograd take the
torch path. Numbers: docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from specdec.models import ops
from specdec.triton_lang import jit as _jit, on_triton, tl, triton

GEMV_MAX_ROWS = 32  # decode GEMMs of at most this many rows stream the weight once in the GEMV
PARTS_MAX_ROWS = 128  # linear_parts' GEMV serves up to this many rows, past 32 in one block of them all


def streams(x: torch.Tensor, weight: torch.Tensor, max_rows: int = GEMV_MAX_ROWS) -> bool:
    """The GEMV serves: a 16-bit x of at most max_rows unit-stride rows, a contiguous weight of x's
    dtype."""
    return (on_triton(x, weight) and x.dim() == 2 and x.shape[0] <= max_rows and weight.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x ``[M, K]`` @ weight ``[N, K]``^T -> ``[M, N]`` in x's dtype, then in ``out_dtype`` if given
    (logits: rounded to x's dtype, then widened, as ``linear(x, w).float()``)."""
    if streams(x, weight):
        return triton_linear(x, weight, out_dtype=out_dtype)
    out = F.linear(x, weight)
    return out if out_dtype is None else out.to(out_dtype)


def linear_parts(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x ``[M, K]`` @ weight ``[N, K]``^T as ``[S, M, N]`` fp32 partial sums over S parts of K,
    where the GEMV serves and a weight of few rows would leave SMs idle (k_parts > 1); their sum
    added in order and rounded to x's dtype is the product (ops.product_values: the consumer adds
    them as it loads). Else linear(x, weight), ``[M, N]``. E.g. qkv_a ``[2112, 7168]``: 33 tiles of
    64 rows x 4 parts of 1792 fill 132 SMs, where 132 tiles of 16 rows ran mma.sync, not a wgmma.
    Up to PARTS_MAX_ROWS rows (a verify's 128 tokens), where cuBLAS splits K as well and adds its
    parts in a kernel of its own, the consumer adds them."""
    if streams(x, weight, PARTS_MAX_ROWS):
        parts = k_parts(*weight.shape, _multiprocessors(x.device))
        if parts > 1:
            return triton_linear_parts(x, weight, parts)
    return linear(x, weight)


def k_parts(n: int, k: int, sms: int = 132) -> int:
    """How many parts of K linear_parts sums a weight ``[n, k]`` over: as many as the 64-row
    tiles' programs fit one wave (at most 8, each part at least 2 K tiles of 128), 1 where the
    weight's tiles alone fill the SMs (gemv_config's 64-row tiles)."""
    if gemv_config(n, k, sms)[0] == 64:
        return 1
    return max(1, min(8, sms // -(-n // 64), k // 256))


def triton_linear_parts(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """linear_parts' GEMV (any device Triton runs on, its interpreter included): ``[parts, M, N]``
    fp32, in 64-row tiles of 128-column K steps (past GEMV_MAX_ROWS rows, one block of up to
    PARTS_MAX_ROWS: 8 warps, 4 stages)."""
    if x.shape[0] > PARTS_MAX_ROWS:
        raise ValueError(f"linear_parts: at most {PARTS_MAX_ROWS} rows, not {x.shape[0]}")
    if x.shape[0] <= GEMV_MAX_ROWS:
        return _launch(x, weight, (64, 128, 4, 6), None, parts=parts)
    return _launch(x, weight, (64, 128, 8, 4), None, parts=parts, block_m=PARTS_MAX_ROWS)


def triton_linear_argmax(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, "HeadPick"]:
    """linear(x, weight, torch.float32) (a head's logits ``[M, N]``) from the GEMV (where it
    streams, or under the interpreter) and its HeadPick: the argmax and the top-1 softmax of each
    row from the GEMV's per-program parts."""
    pick = HeadPick.empty(x.shape[0], weight.shape[0], x.device)
    return _launch(x, weight, None, torch.float32, pick), pick


class HeadPick:
    """The head GEMV's parts of a greedy pick, one per program (BLOCK_N logits) and row: keys
    ``[M, P]`` int64, the row's best logit of the program as an integer that orders (value, then
    the lower column; NaN above all, as torch.argmax), and sums ``[M, P, 2]`` fp32, (max, sum of
    exp(logit - max)) over the program's logits, NaN as -inf. E.g. logits [[1.0, 3.0 | 3.0, 2.0]]
    in programs of 2: keys of (3.0, col 1) and (3.0, col 2); argmax [1]."""

    def __init__(self, keys: torch.Tensor, sums: torch.Tensor) -> None:
        self.keys, self.sums = keys, sums

    @staticmethod
    def empty(m: int, n: int, device: torch.device) -> "HeadPick":
        p = triton.cdiv(n, gemv_config(n, 16, _multiprocessors(device))[0])
        return HeadPick(torch.empty(m, p, dtype=torch.long, device=device),
                        torch.empty(m, p, 2, dtype=torch.float32, device=device))

    def argmax(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each row's argmax ``[M]`` int64 (into ``out`` if given), as logits.argmax(-1)."""
        return self._reduce(out, None)

    def top1(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs ``[M, 1]`` fp32, ids ``[M, 1]`` int64): tree.topk_probs(logits, 1) to fp32 rounding;
        a row holding NaN or no finite maximum scores 0, its id the argmax."""
        probs = torch.empty(self.keys.shape[0], 1, dtype=torch.float32, device=self.keys.device)
        return probs, self._reduce(None, probs)[:, None]

    def _reduce(self, out: Optional[torch.Tensor], probs: Optional[torch.Tensor]) -> torch.Tensor:
        """The argmax into out (a new tensor if None), and the top-1 probabilities into probs if given."""
        m, p = self.keys.shape
        if out is None:
            out = torch.empty(m, dtype=torch.long, device=self.keys.device)
        if out.shape != (m,) or out.dtype != torch.long or not out.is_contiguous():
            raise ValueError(f"HeadPick.argmax: out must be [{m}] int64 contiguous, got {tuple(out.shape)} {out.dtype}")
        if m:
            _pick_kernel[(m,)](self.keys, self.sums, out, probs if probs is not None else self.sums, p,
                               PROBS=probs is not None, P_PAD=triton.next_power_of_2(p), num_warps=1)
        return out


def linear_add_rows(x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x ``[M, K]`` @ weight ``[N, K]``^T + table[ids] -> ``[M, N]`` in x's dtype, rounded once:
    table ``[V, N]`` of x's dtype (rows of unit stride), ids ``[M]`` int64 in [0, V). The GEMV adds
    the rows to its fp32 sums before it rounds (an id outside the table adds nothing); elsewhere
    cuBLAS's addmm does (its beta = 1 epilogue; the lookup raises there). E.g. the MTP layer's
    eh_proj with its embedding half from a per-token table."""
    if streams(x, weight) and table.dtype == x.dtype and table.stride(1) == 1:
        return triton_linear_add_rows(x, weight, table, ids)
    return torch.addmm(table.index_select(0, ids), x, weight.t())


def triton_linear_add_rows(x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor,
                           ids: torch.Tensor) -> torch.Tensor:
    """linear_add_rows' GEMV (any device Triton runs on, its interpreter included)."""
    if table.shape[1] != weight.shape[0] or ids.shape != (x.shape[0],):
        raise ValueError(f"linear_add_rows: table {tuple(table.shape)} and ids {tuple(ids.shape)} for x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    return _launch(x, weight, None, None, rows=(table, ids.contiguous()))  # the kernel reads ids at unit stride


def linear_silu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """ops.silu_mul(linear(x, gate_up)): x ``[M, K]``, gate_up ``[2I, K]`` (gate rows, then up) ->
    silu(gate) * up ``[M, I]``, each rounded as torch rounds them. Where the GEMV serves, its
    programs take I / 32 pairs of 32 gate and 32 up rows and pair them in the epilogue: no silu
    kernel, and the down projection a plain GEMV."""
    if streams(x, gate_up):
        return triton_linear_silu(x, gate_up)
    return ops.silu_mul(linear(x, gate_up))


def triton_linear_silu(x: torch.Tensor, gate_up: torch.Tensor,
                       config: Optional[tuple[int, int, int, int]] = None) -> torch.Tensor:
    """linear_silu's GEMV: x of unit-stride rows, a contiguous ``[2I, K]`` weight; ``config`` as
    gemv_config gives it for the weight."""
    return _launch(x, gate_up, config, None, glu=True)


def gemv_config(n: int, k: int, sms: int = 132) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight ``[n, k]`` on ``sms`` multiprocessors.

    The weight streams at the bandwidth only with every SM reading: the narrowest tile of 16-32 rows
    whose programs fit one wave, e.g. qkv_a ``[2112, 7168]``: 132 programs of 16 rows, not 33 of 64.
    Else 64 rows (a wgmma), K tiles of 128 in 6 stages, or 4 where two programs must share an SM
    (more programs than SMs: the head).
    """
    block_n = next((b for b in (16, 32) if -(-n // b) <= sms), 64)
    fit = max(16, ops.pow2(k))  # no K tile past the weight's next power of two
    if block_n < 64:
        return block_n, min(fit, 256 if block_n == 32 else 512), 4, 4
    return 64, min(fit, 128), 4, (6 if -(-n // 64) <= sms else 4)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, config: Optional[tuple[int, int, int, int]] = None,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """linear's GEMV: rows of unit stride, a contiguous weight; ``config`` as gemv_config gives it."""
    return _launch(x, weight, config, out_dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, config, out_dtype,
            pick: Optional[HeadPick] = None, rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
            parts: int = 1, glu: bool = False, block_m: Optional[int] = None) -> torch.Tensor:
    """x ``[M, K]``; pick: the HeadPick whose parts the programs write (gemv_config's tiles);
    rows: (table, ids) whose
    rows the output adds before its rounding (linear_add_rows); parts > 1: the output is
    ``[parts, M, N]`` fp32, the sums over K's parts of config's K tiles (linear_parts); glu: the
    output is silu(gate) * up ``[M, N / 2]`` of the weight's halves (linear_silu); block_m: x's rows
    a program takes (None: 16, or 32 past 16 rows)."""
    m = x.shape[0]
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"linear: the input is {tuple(x.shape)}, the weight {tuple(weight.shape)}")
    if glu and n % 2:
        raise ValueError(f"linear_silu: the weight {tuple(weight.shape)} must be [2I, K], gate then up")
    shape = (parts, m, n) if parts > 1 else (m, n // 2 if glu else n)
    out = x.new_empty(shape, dtype=torch.float32 if parts > 1 else out_dtype or x.dtype)
    if m:
        block_n, block_k, warps, stages = config or gemv_config(n, k, _multiprocessors(x.device))
        k_part = triton.cdiv(triton.cdiv(k, parts), block_k) * block_k
        block_m = block_m or (16 if m <= 16 else 32)
        grid = (triton.cdiv(n // 2 if glu else n, block_n // 2 if glu else block_n), triton.cdiv(m, block_m), parts)
        if pick is not None and pick.keys.shape[1] != grid[0]:
            raise ValueError(f"triton_linear_argmax: {grid[0]} programs for {pick.keys.shape[1]} parts")
        table, ids = rows if rows is not None else (out, out)
        _gemv_kernel[grid](x, weight, out, pick.keys if pick else out, pick.sums if pick else out, table, ids, m, n, k,
                           k_part, x.stride(0), table.stride(0), table.shape[0],
                           ROUND_OUT=parts == 1 and out.dtype != weight.dtype,
                           ONE_BLOCK=m if m <= block_m else 0, PICK=pick is not None, ADD_ROWS=rows is not None,
                           GLU=glu, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                           num_stages=stages)
    return out


def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@_jit
def _argmax_keys(x, cols):
    """One int64 a value that orders (value, then the lower column) as an integer, NaN above all
    (torch.argmax's order): the fp32 bits made monotonic in the high word, the complemented
    column in the low word."""
    bits = x.to(tl.int32, bitcast=True)
    mono = tl.where(x != x, 0x7FFFFFFF, bits ^ ((bits >> 31) & 0x7FFFFFFF))
    low = tl.full([], 0xFFFFFFFF, tl.int64)
    return (mono.to(tl.int64) << 32) + (low - cols.to(tl.int64))


@_jit
def _pick_kernel(keys_ptr, sums_ptr, ids_ptr, probs_ptr, P, PROBS: tl.constexpr, P_PAD: tl.constexpr):
    """Row r of a HeadPick: the best of its P keys, and (PROBS) the softmax of that logit from the
    P (max, sum) pairs: 1 / sum_p(s_p * exp(m_p - max)), 0 where the best is NaN or the max is
    not finite."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, P_PAD)
    keys = tl.load(keys_ptr + r * P + p, mask=p < P, other=-2**63)
    best = tl.max(keys, axis=0)
    low = tl.full([], 0xFFFFFFFF, tl.int64)
    tl.store(ids_ptr + r, low - (best & low))
    if PROBS:
        inf = float("inf")
        m = tl.load(sums_ptr + (r * P + p) * 2, mask=p < P, other=-inf)
        s = tl.load(sums_ptr + (r * P + p) * 2 + 1, mask=p < P, other=0.0)
        top = tl.max(m, axis=0)
        total = tl.sum(tl.where(m == -inf, 0.0, s * tl.exp(m - top)), axis=0)
        nan = (best >> 32).to(tl.int32) == 0x7FFFFFFF
        tl.store(probs_ptr + r, tl.where((top > -inf) & (top < inf) & ~nan, 1.0 / total, 0.0))


@_jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, keys_ptr, sums_ptr, table_ptr, ids_ptr, M, N, K, K_PART, stride_xm,
                 stride_table, TABLE_ROWS, ROUND_OUT: tl.constexpr, ONE_BLOCK: tl.constexpr, PICK: tl.constexpr,
                 ADD_ROWS: tl.constexpr, GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """One program: BLOCK_N weight rows against BLOCK_M rows of x, over K_PART columns of K, the
    program_id(2)-th part (K_PART >= K: all of it; else the fp32 partial sum goes to part
    program_id(2) of out ``[parts, M, N]``, no epilogue). The weight tile streams through once, the
    few x rows come from L2. The product is weight tile @ x tile^T (``[BLOCK_N, BLOCK_M]``): at 64
    weight rows a wgmma whose operands the pipeline's copies leave in shared memory.
    - GLU: the weight is ``[gate; up]`` (N = 2I rows) and the output silu(gate) * up ``[M, I]``:
      a program's tile is BLOCK_N / 2 gate rows and the same up rows, paired in its epilogue.
    - ROUND_OUT: the fp32 output rounded to the weight's dtype, then widened (fp32 logits).
    - ONE_BLOCK: M itself where it is at most BLOCK_M (one row block; 0 else), so that the rows'
      masks are compile-time constants and the input's copies carry no per-row predicates
      (docs/kernels.md).
    - PICK: also the HeadPick parts of its BLOCK_N columns, at ``[row, program]`` of keys_ptr /
      sums_ptr. ADD_ROWS: row m of the output adds the table's row ids[m] to its fp32 sums (none
      for an id outside its TABLE_ROWS rows)."""
    if GLU:  # output columns rn of silu(gate) * up: weight rows rn (gate) and I + rn (up)
        r = tl.arange(0, BLOCK_N)
        rn = tl.program_id(0) * (BLOCK_N // 2) + (r % (BLOCK_N // 2))
        rw = tl.where(r < BLOCK_N // 2, rn, rn + N // 2)
        w_in = rn < N // 2
    else:
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rw = rn
        w_in = rn < N
    row0 = 0 if ONE_BLOCK else tl.program_id(1) * BLOCK_M
    if ONE_BLOCK:
        M = ONE_BLOCK
    rm = row0 + tl.arange(0, BLOCK_M)
    dtype = w_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_lo = tl.program_id(2) * K_PART
    for k0 in range(0, K_PART, BLOCK_K):
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rw[:, None] * K + rk[None, :], mask=w_in[:, None] & (rk < K)[None, :], other=0.0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None] & (rk < K)[None, :],
                    other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    rows_in = (rm < M)[None, :]
    if GLU:
        gate, up = tl.split(tl.permute(tl.reshape(acc, [2, BLOCK_N // 2, BLOCK_M]), (1, 2, 0)))
        cols = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        act = ops.silu_times(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
        tl.store(out_ptr + rm[None, :] * (N // 2) + cols[:, None], act, mask=rows_in & (cols < N // 2)[:, None])
        return
    cols_in = (rn < N)[:, None]
    out_ptr += tl.program_id(2).to(tl.int64) * M * N
    if ADD_ROWS:
        ids = tl.load(ids_ptr + rm, mask=rm < M, other=-1).to(tl.int64)
        known = (rm < M) & (ids >= 0) & (ids < TABLE_ROWS)
        acc += tl.load(table_ptr + ids[None, :] * stride_table + rn[:, None], mask=known[None, :] & cols_in,
                       other=0.0).to(tl.float32)
    if ROUND_OUT:
        acc = acc.to(dtype).to(tl.float32)
    tl.store(out_ptr + rm[None, :] * N + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=rows_in & cols_in)
    if PICK:
        inf = float("inf")
        part = rm.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
        keys = tl.where(cols_in, _argmax_keys(acc, rn[:, None]), -2**63)
        tl.store(keys_ptr + part, tl.max(keys, axis=0), mask=rm < M)
        v = tl.where(cols_in & (acc == acc), acc, -inf)
        top = tl.max(v, axis=0)
        total = tl.sum(tl.where(v == -inf, 0.0, tl.exp(v - top[None, :])), axis=0)
        tl.store(sums_ptr + part * 2, top, mask=rm < M)
        tl.store(sums_ptr + part * 2 + 1, total, mask=rm < M)

