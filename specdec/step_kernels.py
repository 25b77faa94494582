"""The spec step's bookkeeping, one Triton kernel each on a GPU, plain torch elsewhere.

Why: each is a handful of index ops over ``[B]`` or ``[B, num_steps + 1]`` values, and as torch ops
each was its own launch (about 1.5 us each on an H200, ~45 of a step's launches). The torch path is
the same arithmetic, what CPU runs and what the GPU tests compare to. rows_to_host replaces a
copy-engine node in a graphed step, which costs the step more than a one-block kernel.
"""

from __future__ import annotations

import torch

from attn.base import const_arange
from specdec.accept import AcceptResult
from specdec.triton_lang import jit as _jit, on_triton, tl, triton


# ------------------------------------------------------------------------------ pass slots
def pass_slots(req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, first: int,
               q_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A uniform pass's cache slots, kv lengths and kv indices: request b's q_len new tokens sit at
    kv indices ``lens[b] + first + [0, q_len)`` of req_to_token row ``rows[b]``.

    req_to_token ``[R, C]`` int32, rows / lens ``[B]`` int64 -> (out_cache_loc ``[B * q_len]``
    int64, seq_lens ``[B]`` int32 = lens + first + q_len, kv indices ``[B * q_len]`` int64: a
    chain's positions). E.g. lens [7], first 1, q_len 2: slots of kv indices 8 and 9, seq_lens
    [10], kv indices [8, 9]."""
    if on_triton(rows) and req_to_token.stride(1) == 1:
        return triton_pass_slots(req_to_token, rows, lens, first, q_len)
    index = lens[:, None] + first + const_arange(q_len, rows.device)[None, :]
    return req_to_token[rows[:, None], index].flatten().long(), (lens + first + q_len).int(), index.flatten()


def triton_pass_slots(req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, first: int,
                      q_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pass_slots' kernel (any device Triton runs on, its interpreter included)."""
    bs = rows.shape[0]
    loc = torch.empty(bs * q_len, dtype=torch.long, device=rows.device)
    index = torch.empty(bs * q_len, dtype=torch.long, device=rows.device)
    seq_lens = torch.empty(bs, dtype=torch.int32, device=rows.device)
    if bs:
        _pass_slots_kernel[(bs,)](req_to_token, rows, lens, loc, seq_lens, index, req_to_token.stride(0), first,
                                  q_len, Q_PAD=triton.next_power_of_2(q_len), num_warps=1)
    return loc, seq_lens, index


@_jit
def _pass_slots_kernel(r2t_ptr, rows_ptr, lens_ptr, loc_ptr, seq_ptr, index_ptr, stride_r2t, FIRST, Q_LEN,
                       Q_PAD: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    start = tl.load(lens_ptr + b).to(tl.int64) + FIRST
    i = tl.arange(0, Q_PAD)
    keep = i < Q_LEN
    slots = tl.load(r2t_ptr + row * stride_r2t + start + i, mask=keep, other=0)
    tl.store(loc_ptr + b * Q_LEN + i, slots.to(tl.int64), mask=keep)
    tl.store(index_ptr + b * Q_LEN + i, start + i, mask=keep)
    tl.store(seq_ptr + b, (start + Q_LEN).to(tl.int32))


# ---------------------------------------------------------------- greedy chain accept + report
def serves_chain_report(tokens: torch.Tensor, pred: torch.Tensor) -> bool:
    """chain_report runs here: CUDA tensors, pred contiguous, the tokens' rows of unit stride."""
    return on_triton(pred) and pred.is_contiguous() and tokens.stride(1) == 1


def chain_report(tokens: torch.Tensor, pred: torch.Tensor, seq_lens: torch.Tensor, limit: torch.Tensor,
                 eos: torch.Tensor) -> tuple[AcceptResult, torch.Tensor]:
    """specdec.accept.chain_accept, stop_at_limits and StepReport.pack in one kernel.

    tokens ``[B, S + 1]`` (a chain's, the root first); pred ``[B, S + 1]``: the target's argmax
    after each node; seq_lens / limit / eos ``[B]``; all int64. Returns (AcceptResult, the report
    ``[B, S + 4]`` int64: ``[emitted | accept_len | take | done]``); the result's emitted and
    accept_len are views of the report, its extend_ids pred itself. E.g. drafts [5, 6, 9], pred
    [5, 6, 7, 8], no eos, room left: [5, 6, 7, -1 | 2 | 3 | 0], bonus 7."""
    bs, width = pred.shape
    report = torch.empty(bs, width + 3, dtype=torch.long, device=pred.device)
    path = torch.empty(bs, width, dtype=torch.long, device=pred.device)
    bonus = torch.empty(bs, dtype=torch.long, device=pred.device)
    if bs:
        _chain_report_kernel[(bs,)](tokens, pred, seq_lens, limit, eos, report, path, bonus, tokens.stride(0), width,
                                    W_PAD=triton.next_power_of_2(width), num_warps=1)
    return AcceptResult(report[:, width], path, report[:, :width], bonus, pred), report


@_jit
def _chain_report_kernel(tokens_ptr, pred_ptr, lens_ptr, limit_ptr, eos_ptr, report_ptr, path_ptr, bonus_ptr,
                         stride_t, WIDTH, W_PAD: tl.constexpr):
    b = tl.program_id(0)
    i = tl.arange(0, W_PAD)
    col = i < WIDTH
    pred = tl.load(pred_ptr + b * WIDTH + i, mask=col, other=-1)
    # node i (1..S) is accepted while every draft up to it matched the target's argmax before it
    drafted = tl.load(tokens_ptr + b * stride_t + i, mask=(i >= 1) & col, other=-1)
    prev = tl.load(pred_ptr + b * WIDTH + i - 1, mask=(i >= 1) & col, other=-1)
    miss = (i >= 1) & col & (drafted != prev)
    accept_len = tl.min(tl.where(miss, i - 1, WIDTH - 1), axis=0).to(tl.int64)
    emitted = tl.where(i <= accept_len, pred, -1)
    tl.store(bonus_ptr + b, tl.sum(tl.where(i == accept_len, pred, 0), axis=0))
    seq_len = tl.load(lens_ptr + b)
    limit = tl.load(limit_ptr + b)
    take = tl.minimum(accept_len + 1, limit - seq_len)
    hit = (emitted == tl.load(eos_ptr + b)) & (i < take) & col
    first_eos = tl.min(tl.where(hit, i, WIDTH), axis=0).to(tl.int64)
    take = tl.minimum(take, first_eos + 1)
    done = ((first_eos < WIDTH) | (seq_len + take >= limit)).to(tl.int64)
    out = report_ptr + b * (WIDTH + 3)
    tl.store(out + i, emitted, mask=col)
    tl.store(out + WIDTH, accept_len)
    tl.store(out + WIDTH + 1, take)
    tl.store(out + WIDTH + 2, done)
    tl.store(path_ptr + b * WIDTH + i, tl.minimum(i.to(tl.int64), accept_len), mask=col)


# ------------------------------------------------------------------ the next state's counts
def next_counts(seq_lens: torch.Tensor, accept_len: torch.Tensor, counter: torch.Tensor, rows: torch.Tensor,
                padding_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The next step's N and counter: (seq_lens + accept_len + 1, 0 on the requests whose row is
    ``padding_row``; counter + 1), ``[B]`` int64 each; one kernel on a GPU, where torch took five.
    Padding rows (a graph bucket's unused ones) keep N = 0, so their kv indices stay in bounds.
    E.g. seq_lens [10, 3], accept_len [2, 1], counter [4, 4], rows [7, 0], padding 0: ([13, 0], [5, 5])."""
    if on_triton(seq_lens):
        return triton_next_counts(seq_lens, accept_len, counter, rows, padding_row)
    return torch.where(rows == padding_row, 0, seq_lens + accept_len + 1), counter + 1


def triton_next_counts(seq_lens: torch.Tensor, accept_len: torch.Tensor, counter: torch.Tensor, rows: torch.Tensor,
                       padding_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """next_counts' kernel (any device Triton runs on, its interpreter included)."""
    bs = seq_lens.shape[0]
    lens_out = torch.empty(bs, dtype=seq_lens.dtype, device=seq_lens.device)
    counter_out = torch.empty(bs, dtype=counter.dtype, device=counter.device)
    if bs:
        block = min(triton.next_power_of_2(bs), 1024)
        _next_counts_kernel[(triton.cdiv(bs, block),)](seq_lens, accept_len, counter, rows, lens_out, counter_out, bs,
                                                       seq_lens.stride(0), accept_len.stride(0), counter.stride(0),
                                                       rows.stride(0), padding_row, BLOCK=block, num_warps=4)
    return lens_out, counter_out


@_jit
def _next_counts_kernel(lens_ptr, accept_ptr, counter_ptr, rows_ptr, lens_out, counter_out, B, stride_lens,
                        stride_accept, stride_counter, stride_rows, PADDING_ROW, BLOCK: tl.constexpr):
    """The inputs at any stride (accept_len: a column of chain_report's report)."""
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = b < B
    lens = tl.load(lens_ptr + b * stride_lens, mask=keep) + tl.load(accept_ptr + b * stride_accept, mask=keep) + 1
    padding = tl.load(rows_ptr + b * stride_rows, mask=keep) == PADDING_ROW
    tl.store(lens_out + b, tl.where(padding, 0, lens), mask=keep)
    tl.store(counter_out + b, tl.load(counter_ptr + b * stride_counter, mask=keep) + 1, mask=keep)


# ------------------------------------------------------------------------- a row a request
def row_of_each(x: torch.Tensor, q_len: int, index: torch.Tensor) -> torch.Tensor:
    """Request b's row ``index[b]`` of its q_len rows: x ``[B * q_len, D]`` (request-major), index
    ``[B]`` int64 in [0, q_len) -> ``[B, D]``, one kernel on a GPU (for torch's slower gather of an
    expanded index). E.g. draft-extend's hidden state at each
    request's last accepted row: q_len 4, index [2, 0] -> rows 2 and 4 of x."""
    bs, dim = index.shape[0], x.shape[-1]
    if x.shape[0] != bs * q_len:
        raise ValueError(f"row_of_each: x has {x.shape[0]} rows, not {bs} requests x {q_len}")
    if on_triton(x) and x.dim() == 2 and x.stride(1) == 1:
        return triton_row_of_each(x, q_len, index)
    return x.view(bs, q_len, dim).gather(1, index[:, None, None].expand(-1, 1, dim)).squeeze(1)


def triton_row_of_each(x: torch.Tensor, q_len: int, index: torch.Tensor) -> torch.Tensor:
    """row_of_each's kernel (any device Triton runs on, its interpreter included): x ``[B * q_len,
    D]`` of unit-stride rows."""
    bs, dim = index.shape[0], x.shape[1]
    out = x.new_empty(bs, dim)
    if bs and dim:
        block = min(triton.next_power_of_2(dim), 8192)
        _row_of_each_kernel[(bs, triton.cdiv(dim, block))](x, index, out, dim, x.stride(0), index.stride(0), q_len,
                                                            BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out


@_jit
def _row_of_each_kernel(x_ptr, index_ptr, out_ptr, D, stride_x, stride_index, Q_LEN, BLOCK: tl.constexpr):
    """index at any stride (accept_len: a column of chain_report's report)."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = b * Q_LEN + tl.load(index_ptr + b * stride_index)
    tl.store(out_ptr + b * D + cols, tl.load(x_ptr + row * stride_x + cols, mask=cols < D), mask=cols < D)


# ------------------------------------------------------------------ rows to pinned host memory
def rows_to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Write src ``[b, w]`` int64 (rows of unit stride) into the first b rows of dst ``[>= b, w]``
    int64 (contiguous) with one kernel: dst may be pinned host memory, which a CUDA kernel writes
    through its unified address. Stream-ordered as a copy would be; the host reads dst after an
    event recorded behind it. E.g. src [[5, 6, -1, 1]] on the GPU -> dst[0] = [5, 6, -1, 1]."""
    rows, width = src.shape
    if dst.dim() != 2 or dst.shape[0] < rows or dst.shape[1] != width or not dst.is_contiguous():
        raise ValueError(f"rows_to_host: dst {tuple(dst.shape)} must be contiguous with >= {rows} rows of {width}")
    if src.dtype != torch.long or dst.dtype != torch.long or (rows and src.stride(1) != 1):
        raise ValueError(f"rows_to_host takes int64 rows of unit stride, got {src.dtype} -> {dst.dtype}, "
                         f"strides {src.stride()}")
    if rows:
        _rows_to_host_kernel[(rows,)](src, dst, src.stride(0), width, W_PAD=triton.next_power_of_2(width),
                                      num_warps=1)


@_jit
def _rows_to_host_kernel(src_ptr, dst_ptr, stride_src, WIDTH, W_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, W_PAD)
    col = i < WIDTH
    tl.store(dst_ptr + b * WIDTH + i, tl.load(src_ptr + b * stride_src + i, mask=col), mask=col)


# ------------------------------------------------------------------------- the next state
MAX_COPIES = 8  # tensor pairs copy_tensors moves in one launch (its kernel unrolls a branch a pair)


def copy_tensors(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dst.copy_(src) for each pair: one kernel on a GPU where every pair is contiguous tensors of
    one shape and dtype and there are at most MAX_COPIES (the graphed step's next state: six pairs,
    which torch._foreach_copy_ makes six memcpy nodes); else torch._foreach_copy_."""
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_tensors: {len(dsts)} destinations for {len(srcs)} sources")
    if dsts and on_triton(*dsts, *srcs) and all(t.is_cuda for t in (*dsts, *srcs)) and _copies_as_bytes(dsts, srcs):
        triton_copy_tensors(dsts, srcs)
    elif dsts:
        torch._foreach_copy_(dsts, srcs)


def _copies_as_bytes(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> bool:
    return len(dsts) <= MAX_COPIES and all(d.shape == s.shape and d.dtype == s.dtype and d.is_contiguous()
                                           and s.is_contiguous() for d, s in zip(dsts, srcs))


def triton_copy_tensors(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """copy_tensors' kernel (any device Triton runs on, its interpreter included): each pair's
    bytes, program (i, p) the i-th COPY_BLOCK bytes of pair p."""
    if len(dsts) != len(srcs) or not _copies_as_bytes(dsts, srcs):
        raise ValueError(f"copy_tensors' kernel takes at most {MAX_COPIES} pairs of contiguous tensors of one shape "
                         f"and dtype, got {[(tuple(d.shape), d.dtype) for d in dsts]} <- "
                         f"{[(tuple(s.shape), s.dtype) for s in srcs]}")
    if not dsts:
        return
    srcs_b = tuple(s.reshape(-1).view(torch.uint8) for s in srcs)
    dsts_b = tuple(d.reshape(-1).view(torch.uint8) for d in dsts)
    sizes = tuple(s.numel() for s in srcs_b)
    if max(sizes):
        _copy_kernel[(triton.cdiv(max(sizes), COPY_BLOCK), len(dsts))](srcs_b, dsts_b, sizes, PAIRS=len(dsts),
                                                                       BLOCK=COPY_BLOCK, num_warps=4)


COPY_BLOCK = 4096  # bytes a program copies


@_jit
def _copy_kernel(srcs, dsts, sizes, PAIRS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, p) copies bytes [i * BLOCK, (i + 1) * BLOCK) of pair p: srcs[p] -> dsts[p], of
    sizes[p] bytes (tuples of PAIRS)."""
    pair = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    for p in tl.static_range(PAIRS):
        if pair == p:
            tl.store(dsts[p] + offs, tl.load(srcs[p] + offs, mask=offs < sizes[p]), mask=offs < sizes[p])
