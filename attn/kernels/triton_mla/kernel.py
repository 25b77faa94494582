"""Paged MLA attention in absorbed form as Triton kernels, tuned for Hopper (SM90).

MLA keeps one shared 576-wide KV row per token (512 latent dims, which are also V, plus 64 rope
dims) for all query heads, so attention is MQA-like: a program stacks (query tokens x heads) of
one request on the M side of its matrix products and streams tiles of BLOCK_N kv rows, gathered
through the block table, through them once. Long sequences are cut into split-KV chunks
(flash-decoding); a second kernel merges the chunks by their log-sum-exp. Every launch grid is a
function of host-side sizes only (batch, heads, max_q_len, splits), all per-request metadata is
read on the GPU, so a call never synchronises with the host and can be captured in a CUDA graph.
On SM90, 64-row tiles (compute-bound at 128 heads or q_len 4) run the Gluon twin of the attention
kernel in wgmma.py instead; the split planning (plan.py) and the reduce are shared.

The module imports without Triton (CPU-only installs): planning and input checks still work.
"""

import functools
import torch

from attn.base import KV_DIM, KV_LORA_RANK, QK_ROPE_DIM
from attn.kernels.triton_mla import wgmma as wgmma_tile
from attn.kernels.triton_mla.chunks import chunk_bounds, program_work, visible_kv
from attn.kernels.triton_mla.plan import (
    MAX_SPLITS,
    KernelConfig,
    LaunchPlan,
    TileShape,
    discard_line_values,
    launch_config,
    min_split_len,
    narrow_partials,
    next_pow2,
    num_row_blocks,
    plan_bounds,
    plan_launch,
)
from attn.kernels.triton_lang import jit as _jit, tl, triton
from attn.kernels.triton_mla.tma import row_descriptors
from attn.values import is_int, is_positive_finite


_LOG2E = 1.4426950408889634


@_jit
def _attend_tile(
    acc, m_i, l_i, q_nope, q_oth, q_pe, own_off, oth_off,
    kv_ptr, bt_row_ptr, start, kv_len, stride_kv_page, stride_kv_row,
    q_pos, mask_rows_ptr, mask_start, row_valid, qk_scale,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D_V: tl.constexpr, D_PE: tl.constexpr,
    MASKED: tl.constexpr, HAS_MASK: tl.constexpr, V_SPLIT: tl.constexpr,
):
    """One online-softmax step over kv rows [start, start + BLOCK_N) of one request.

    MASKED=False is the fast path for tiles every row of the program fully sees (no bounds or
    mask checks at all); MASKED=True applies the kv length and the causal or custom mask.
    q_nope / the result hold the D_V latent dims at own_off; with V_SPLIT=2, q_oth holds the other
    half (at oth_off), which only enters the scores.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_V)
    offs_pe = tl.arange(0, D_PE)
    in_range = offs_n < kv_len
    if PAGE_SIZE % BLOCK_N == 0:
        # Tiles start at multiples of BLOCK_N, so the whole tile lies in one page: one block-table
        # read and rows at a fixed stride from it (rows past kv_len stay inside the page).
        page = tl.load(bt_row_ptr + start // PAGE_SIZE).to(tl.int64)
        first = kv_ptr + page * stride_kv_page + (start % PAGE_SIZE) * stride_kv_row
        row_ptr = first + tl.arange(0, BLOCK_N) * stride_kv_row
    else:
        if MASKED:
            page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=in_range, other=0)
        else:
            page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE)
        row_ptr = kv_ptr + page.to(tl.int64) * stride_kv_page + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kv_row
    if MASKED:
        k_nope = tl.load(row_ptr[:, None] + own_off + offs_d[None, :], mask=in_range[:, None], other=0.0)
        k_pe = tl.load(row_ptr[:, None] + D_V * V_SPLIT + offs_pe[None, :], mask=in_range[:, None], other=0.0)
    else:
        k_nope = tl.load(row_ptr[:, None] + own_off + offs_d[None, :])
        k_pe = tl.load(row_ptr[:, None] + D_V * V_SPLIT + offs_pe[None, :])
    # An fp8 cache is widened to the query dtype; its scale is folded into qk_scale / v_scale.
    k_nope = k_nope.to(q_nope.dtype)
    k_pe = k_pe.to(q_pe.dtype)

    qk = tl.dot(q_nope, tl.trans(k_nope))
    if V_SPLIT == 2:
        if MASKED:
            k_oth = tl.load(row_ptr[:, None] + oth_off + offs_d[None, :], mask=in_range[:, None], other=0.0)
        else:
            k_oth = tl.load(row_ptr[:, None] + oth_off + offs_d[None, :])
        qk = tl.dot(q_oth, tl.trans(k_oth.to(q_oth.dtype)), qk)
    qk = tl.dot(q_pe, tl.trans(k_pe), qk)
    qk = qk * qk_scale  # log2 domain
    if MASKED:
        visible = visible_kv(offs_n, kv_len, q_pos, mask_rows_ptr, mask_start, row_valid, HAS_MASK)
        qk = tl.where(visible, qk, float("-inf"))
    return online_softmax_step(acc, m_i, l_i, qk, k_nope, kv_len, MASKED)


@_jit
def online_softmax_step(acc, m_i, l_i, qk, v, guard, MASKED: tl.constexpr):
    """(acc, m_i, l_i) after one kv tile: scores ``qk`` [rows, BLOCK_N] fp32 in the log2 domain
    over V rows ``v`` [BLOCK_N, D] (16-bit); acc [rows, D] fp32, m_i / l_i [rows] the running
    maximum and sum. MASKED: qk may hold -inf (unseen rows), and a row that saw nothing yet keeps
    acc = l = 0. guard: any runtime value >= 0 (see the PV product).
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet stays 0
    else:
        m_use = m_new
    p = tl.math.exp2(qk - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # Always true. For 16/32-row tiles (mma.sync) the nested region hides the QK product from
    # the PV product, so Triton does not lay them out as a chained pair with every warp on the
    # M axis (which replicates both products in every warp); each splits its N axis over the
    # warps instead. 64-row (wgmma) tiles keep the chained layout either way.
    if guard >= 0:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@_jit
def _mla_attention_kernel(
    q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, mask_ptr, o_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kv_page, stride_kv_row, stride_bt, stride_mb, stride_mq,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    num_splits, mask_len, qk_scale, v_scale,
    PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr, D_NOPE: tl.constexpr, D_PE: tl.constexpr,
    HAS_MASK: tl.constexpr, DIRECT: tl.constexpr, V_SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (head blocks x query blocks x V_SPLIT, splits, batch). One program: BLOCK_Q query tokens x
    BLOCK_H heads of request b over the kv chunk of split s.

    DIRECT (one split): writes the normalised output [T, H, 512]. Otherwise writes the normalised
    partial output [T, H, S, 512] (o_ptr's dtype: 16-bit or fp32) and its log2-sum-exp [T, H, S]
    fp32 (-inf: saw nothing). PDL: launched as a programmatic dependent of the kernel before it,
    waits for it before the first load (every input may be that kernel's output).
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid_m = tl.program_id(0) // V_SPLIT
    v_part = tl.program_id(0) % V_SPLIT  # which D_NOPE // V_SPLIT output dims this program owns
    split = tl.program_id(1)
    b = tl.program_id(2)
    q_block, h_block, q_start, q_len, kv_len = program_work(pid_m, b, cu_q_ptr, seq_lens_ptr, NUM_HEADS, BLOCK_H)

    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    q_idx = q_block * BLOCK_Q + rows // BLOCK_H
    head = h_block * BLOCK_H + rows % BLOCK_H
    row_valid = (q_idx < q_len) & (head < NUM_HEADS)
    token = (q_start + q_idx).to(tl.int64)
    q_pos = kv_len - q_len + q_idx  # kv index of each row's query token

    D_V: tl.constexpr = D_NOPE // V_SPLIT
    own_off = v_part * D_V
    oth_off = (V_SPLIT - 1 - v_part) * D_V
    offs_d = tl.arange(0, D_V)
    offs_pe = tl.arange(0, D_PE)
    # int64 products: q's and out's strides are the caller's (a head stride of a transposed view
    # times 127 heads passes 2**31).
    q_row_ptr = q_ptr + token * stride_qt + head.to(tl.int64) * stride_qh
    q_nope = tl.load(q_row_ptr[:, None] + own_off + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    if V_SPLIT == 2:
        q_oth = tl.load(q_row_ptr[:, None] + oth_off + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    else:
        q_oth = q_nope  # unused
    q_pe = tl.load(q_row_ptr[:, None] + D_NOPE + offs_pe[None, :], mask=row_valid[:, None], other=0.0)

    lo, hi, full_end = chunk_bounds(kv_len, q_len, q_block, split, num_splits, mask_len,
                                    BLOCK_Q, BLOCK_N, MIN_CHUNK, HAS_MASK)
    mid = lo + tl.maximum(tl.minimum(hi, full_end) - lo, 0) // BLOCK_N * BLOCK_N

    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_bt
    mask_rows_ptr = mask_ptr + b.to(tl.int64) * stride_mb + q_idx.to(tl.int64) * stride_mq
    mask_start = kv_len - mask_len

    acc = tl.zeros([BLOCK_Q * BLOCK_H, D_V], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q_nope, q_oth, q_pe, own_off, oth_off, kv_ptr, bt_row_ptr, start, kv_len,
            stride_kv_page, stride_kv_row, q_pos, mask_rows_ptr, mask_start, row_valid, qk_scale,
            PAGE_SIZE, BLOCK_N, D_V, D_PE, False, HAS_MASK, V_SPLIT,
        )
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q_nope, q_oth, q_pe, own_off, oth_off, kv_ptr, bt_row_ptr, start, kv_len,
            stride_kv_page, stride_kv_row, q_pos, mask_rows_ptr, mask_start, row_valid, qk_scale,
            PAGE_SIZE, BLOCK_N, D_V, D_PE, True, HAS_MASK, V_SPLIT,
        )

    # Every V part computes the same lse: the first one writes it.
    store_rows(o_ptr, lse_ptr, token, head, acc, m_i, l_i, v_scale, split, own_off, offs_d, row_valid,
               row_valid & (v_part == 0), stride_ot, stride_oh, stride_os, stride_lt, stride_lh, DIRECT)


@_jit
def store_rows(o_ptr, lse_ptr, token, head, acc, m_i, l_i, v_scale, split, own_off, offs_d, row_valid, lse_valid,
               stride_ot, stride_oh, stride_os, stride_lt, stride_lh, DIRECT: tl.constexpr):
    """Store a program's rows (query ``token`` [rows] or one, ``head`` [rows]) after its last kv tile:
    DIRECT, the output ``acc / l * v_scale`` at dims ``own_off + offs_d`` of out [T, H, 512];
    otherwise that partial at split ``split`` of [T, H, S, 512] and, where lse_valid, its
    log2-sum-exp into [T, H, S] (-inf: saw nothing). A row that saw nothing (acc == 0, l == 0)
    stores exactly 0."""
    saw_any = l_i > 0
    o = acc * (v_scale / tl.where(saw_any, l_i, 1.0))[:, None]
    o_row_ptr = o_ptr + token * stride_ot + head.to(tl.int64) * stride_oh
    o = o.to(o_ptr.dtype.element_ty)
    if DIRECT:
        tl.store(o_row_ptr[:, None] + own_off + offs_d[None, :], o, mask=row_valid[:, None])
    else:
        tl.store(o_row_ptr[:, None] + split * stride_os + own_off + offs_d[None, :], o, mask=row_valid[:, None])
        lse = tl.where(saw_any, m_i + tl.math.log2(tl.where(saw_any, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=lse_valid)


@_jit
def _mla_reduce_kernel(
    o_part_ptr, lse_ptr, out_ptr, cu_q_ptr, batch_size, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    SPLIT_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, LINE_VALUES: tl.constexpr,
):
    """Grid (tokens, heads, 512 / BLOCK_D): merge one row's split partials by their lse.

    Streams SPLIT_BLOCK splits at a time with a running maximum (as the online softmax does), so
    a block's lse and partial loads are independent and go out together: one memory round trip
    per block, not two. Tokens past cu_seqlens_q[B] belong to no request and are left untouched;
    their rows are read all the same (they are allocated), so that the check is not one more
    round trip ahead of the loads. PDL: launched as a programmatic dependent of the attention
    kernel, it waits for that kernel's partials here, after the loads that do not need them.
    LINE_VALUES (partial values a 128-byte line, BLOCK_D a multiple; 0: off): once every thread
    has its loads, discard the program's partial lines from L2, unwritten to HBM.
    """
    t = tl.program_id(0)
    h = tl.program_id(1)
    d_block = tl.program_id(2)
    is_query = t < tl.load(cu_q_ptr + batch_size)
    if PDL:
        tl.extra.cuda.gdc_wait()
    t64 = t.to(tl.int64)
    lse_row_ptr = lse_ptr + t64 * stride_lt + h * stride_lh
    part_row_ptr = o_part_ptr + t64 * stride_pt + h * stride_ph
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, SPLIT_BLOCK)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    denom = tl.full([], 0.0, dtype=tl.float32)
    m = tl.full([], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        s = s0 + offs_s
        lse = tl.load(lse_row_ptr + s, mask=s < num_splits, other=float("-inf"))
        part = tl.load(part_row_ptr + s[:, None] * stride_ps + offs_d[None, :], mask=(s < num_splits)[:, None],
                       other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.math.exp2(m - m_use)
        weight = tl.math.exp2(lse - m_use)
        # An empty chunk (lse -inf) has no weight; where() keeps whatever its row holds (even NaN) out.
        part = tl.where((lse > float("-inf"))[:, None], part, 0.0)
        acc = acc * scale + tl.sum(part * weight[:, None], 0)
        denom = denom * scale + tl.sum(weight, 0)
        m = m_new
    o = acc / tl.where(denom > 0, denom, 1.0)
    if LINE_VALUES > 0:
        tl.debug_barrier()
        offs_line = d_block * BLOCK_D + tl.arange(0, BLOCK_D // LINE_VALUES) * LINE_VALUES
        for s0 in range(0, num_splits, SPLIT_BLOCK):
            s = tl.minimum(s0 + offs_s, num_splits - 1)  # past the last split: its lines again
            lines = part_row_ptr + s[:, None] * stride_ps + offs_line[None, :]
            tl.inline_asm_elementwise("discard.global.L2 [$1], 128; // $0", "=r,l", [lines], dtype=tl.int32,
                                      is_pure=False, pack=1)
    tl.store(out_ptr + t64 * stride_ot + h.to(tl.int64) * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=is_query)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: SM90 and later (not the Triton interpreter)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _expect(ok: bool, message: str, caller: str = "mla_paged_attention") -> None:
    if not ok:
        raise ValueError(f"{caller}: {message}")


def expect_one_device(tensors, caller: str) -> None:
    """ValueError naming ``caller`` unless every tensor of ``tensors`` (None: skipped) is on one device."""
    devices = {t.device for t in tensors if t is not None}
    _expect(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}", caller)


def _check_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_q_len: int,
    custom_mask: torch.Tensor | None,
    out: torch.Tensor | None,
    num_splits: int | None,
    max_kv_len: int | None,
    sm_scale: float = 1.0,
    kv_scale: float = 1.0,
) -> None:
    """Shape, dtype, layout, device and scalar checks; reads no GPU value."""
    _expect(q.dim() == 3 and q.shape[2] == KV_DIM, f"q must be [T, H, {KV_DIM}], got {tuple(q.shape)}")
    _expect(q.dtype in (torch.bfloat16, torch.float16), f"q must be bfloat16 or float16, got {q.dtype}")
    _expect(q.stride(2) == 1, f"q's last dim must be contiguous, got strides {q.stride()}")
    _expect(kv_cache.dim() == 3 and kv_cache.shape[2] == KV_DIM and kv_cache.shape[1] >= 1,
            f"kv_cache must be [num_pages, page_size, {KV_DIM}], got {tuple(kv_cache.shape)}")
    _expect(kv_cache.dtype in (q.dtype, torch.float8_e4m3fn),
            f"kv_cache dtype must be q's ({q.dtype}) or float8_e4m3fn, got {kv_cache.dtype}")
    _expect(kv_cache.stride(2) == 1, f"kv_cache's last dim must be contiguous, got strides {kv_cache.stride()}")
    # Row offsets within a page stay int32 products in the kv loop, once per row of every tile.
    _expect(kv_cache.shape[1] * kv_cache.stride(1) < 2**31,
            f"kv_cache's row stride {kv_cache.stride(1)} x page size {kv_cache.shape[1]} must stay below 2**31")
    _expect(block_tables.dim() == 2 and block_tables.dtype == torch.int32,
            f"block_tables must be [B, max_pages] int32, got {tuple(block_tables.shape)} {block_tables.dtype}")
    batch_size = block_tables.shape[0]
    _expect(block_tables.stride(1) == 1 or block_tables.shape[1] <= 1,
            f"block_tables' last dim must be contiguous, got strides {block_tables.stride()}")
    _expect(seq_lens.shape == (batch_size,) and seq_lens.dtype == torch.int32,
            f"seq_lens must be [B={batch_size}] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    _expect(cu_seqlens_q.shape == (batch_size + 1,) and cu_seqlens_q.dtype == torch.int32,
            f"cu_seqlens_q must be [B+1={batch_size + 1}] int32, got {tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}")
    _expect(seq_lens.is_contiguous() and cu_seqlens_q.is_contiguous(), "seq_lens and cu_seqlens_q must be contiguous")
    _expect(is_int(max_q_len) and max_q_len >= 1, f"max_q_len must be a positive int, got {max_q_len!r}")
    for name, scale in (("sm_scale", sm_scale), ("kv_scale", kv_scale)):
        # A tensor failed inside Triton; NaN or inf made every output non-finite.
        _expect(is_positive_finite(scale), f"{name} must be a finite positive float, got {scale!r}")
    if custom_mask is not None:
        _expect(custom_mask.dtype == torch.bool, f"custom_mask must be bool, got {custom_mask.dtype}")
        _expect(custom_mask.dim() == 3 and custom_mask.shape[:2] == (batch_size, max_q_len) and custom_mask.shape[2] >= 1,
                f"custom_mask must be [B={batch_size}, max_q_len={max_q_len}, M>=1], got {tuple(custom_mask.shape)}")
        _expect(custom_mask.stride(2) == 1, f"custom_mask's last dim must be contiguous, got strides {custom_mask.stride()}")
    expected_out = (q.shape[0], q.shape[1], KV_LORA_RANK)
    if out is not None:
        _expect(out.shape == expected_out and out.dtype == q.dtype,
                f"out must be {list(expected_out)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
        _expect(out.stride(2) == 1, f"out's last dim must be contiguous, got strides {out.stride()}")
    if num_splits is not None:
        _expect(is_int(num_splits) and 1 <= num_splits <= MAX_SPLITS,
                f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if max_kv_len is not None:
        _expect(is_int(max_kv_len) and max_kv_len >= 1, f"max_kv_len must be a positive int, got {max_kv_len!r}")
    expect_one_device([q, kv_cache, block_tables, seq_lens, cu_seqlens_q, custom_mask, out], "mla_paged_attention")


def mla_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_q_len: int,
    sm_scale: float,
    custom_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kv_scale: float = 1.0,
    num_splits: int | None = None,
    max_kv_len: int | None = None,
) -> torch.Tensor:
    """Attention of packed absorbed MLA queries over a paged latent cache; no host sync, graph-safe.

    q ``[T, H, 576]`` bf16/fp16 packed by cu_seqlens_q ``[B + 1]`` int32; kv_cache ``[num_pages,
    page_size, 576]`` in q's dtype or float8_e4m3fn (times kv_scale; K the row, V its first 512);
    block_tables ``[B, max_pages]`` int32; seq_lens ``[B]`` int32 kv lengths, new tokens included and
    cached: query i of request b is kv index ``seq_lens[b] - q_len_b + i`` (q_len_b <= max_q_len).
    custom_mask ``[B, max_q_len, M]`` bool shows the last M kv indices, or None: causal. Returns out
    ``[T, H, 512]`` in q's dtype (in place if given): fp32 softmax by sm_scale, 0 where a query sees
    nothing, rows past cu_seqlens_q[B] unwritten. The grid follows shapes only, so device metadata
    goes unchecked: more queries than max_q_len, a seq_len past its table row, a decreasing
    cu_seqlens_q or page ids past num_pages are undefined. num_splits overrides the plan's;
    max_kv_len bounds the kv lengths the plan is for (default: the table's capacity; a longer request
    is still exact): graph callers pass a bucket's bound (kv_plan_bounds; docs/kernels.md).
    """
    _check_inputs(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, custom_mask, out, num_splits,
                  max_kv_len, sm_scale, kv_scale)
    sm_scale, kv_scale = float(sm_scale), float(kv_scale)  # (Triton refuses numpy float32 arguments)
    if triton is None:
        raise RuntimeError("mla_paged_attention needs Triton, which is not installed")
    num_tokens, num_heads, _ = q.shape
    if out is None:
        out = q.new_empty(num_tokens, num_heads, KV_LORA_RANK)
    if num_tokens == 0 or block_tables.shape[0] == 0:
        return out
    plan, config = plan_for(q, kv_cache, block_tables, max_q_len, max_kv_len)
    _launch(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, sm_scale, custom_mask, out,
            kv_scale, num_splits or plan.num_splits, plan.tile, config,
            plan_min_chunk(plan, config, num_heads, max_q_len), plan.discard_partials)
    return out


def plan_for(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, max_q_len: int,
             max_kv_len: int | None = None) -> tuple[LaunchPlan, KernelConfig]:
    """The plan and kernel config mla_paged_attention launches with for these (checked) inputs:
    for max_kv_len, at most the longest sequence the block table and the cache can hold (the
    default), on the wgmma kernel where it serves (wgmma_tile.supports, asked once)."""
    capacity = _capacity(kv_cache, block_tables.shape[1])
    max_kv_len = capacity if max_kv_len is None else min(max_kv_len, capacity)
    wgmma = wgmma_tile.supports(q, kv_cache)
    plan = plan_launch(block_tables.shape[0], q.shape[1], max_q_len, max_kv_len, _num_sms(q.device), wide_tiles=wgmma)
    return plan, launch_config(plan, wgmma)


def kv_plan_bounds(q: torch.Tensor, kv_cache: torch.Tensor, table_width: int, batch_size: int,
                   max_q_len: int) -> tuple[int, ...]:
    """plan.plan_bounds of mla_paged_attention's launches over queries like ``q``
    ([T, H, 576]), this cache and block tables ``table_width`` pages wide: the max_kv_len values
    below the tables' capacity for which plan_for plans other launches than the next longer one."""
    return plan_bounds(batch_size, q.shape[1], max_q_len, _capacity(kv_cache, table_width),
                       _num_sms(q.device), wgmma_tile.supports(q, kv_cache))


def _capacity(kv_cache: torch.Tensor, table_width: int) -> int:
    """The longest sequence block tables table_width pages wide can hold in this cache."""
    return min(table_width, kv_cache.shape[0]) * kv_cache.shape[1]


def plan_min_chunk(plan: LaunchPlan, config: KernelConfig, num_heads: int, max_q_len: int) -> int:
    """The shortest kv chunk of a split that mla_paged_attention launches the plan with:
    min_split_len of its tile, for the partials ``config`` writes (narrow_partials)."""
    return min_split_len(plan.tile, narrow_partials(config, num_heads, max_q_len))


def _launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_q_len: int,
    sm_scale: float,
    custom_mask: torch.Tensor | None,
    out: torch.Tensor,
    kv_scale: float,
    num_splits: int,
    tile: TileShape,
    config: KernelConfig,
    min_chunk: int,
    discard_partials: bool = False,
    reduce: bool = True,
) -> None:
    """Launch the attention (and, with several splits, the reduce) kernel on checked inputs.

    A request's kv is cut into num_splits chunks of at least min_chunk (a multiple of BLOCK_N);
    discard_partials: see plan_launch. reduce=False launches the attention kernel alone, leaving
    several splits' partials unmerged and ``out`` unwritten (to time it: benchmarks/mla_tuning.py
    --breakdown).
    """
    num_tokens, num_heads, _ = q.shape
    batch_size = block_tables.shape[0]
    direct = num_splits == 1
    if direct:
        o_part, lse = out, out.new_empty(0, 0, dtype=torch.float32)
        o_strides = (out.stride(0), out.stride(1), 0)
    else:
        part_dtype = q.dtype if narrow_partials(config, num_heads, max_q_len) else torch.float32
        o_part = q.new_empty(num_tokens, num_heads, num_splits, KV_LORA_RANK, dtype=part_dtype)
        lse = q.new_empty(num_tokens, num_heads, num_splits, dtype=torch.float32)
        o_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2))
    has_mask = custom_mask is not None
    mask = custom_mask.view(torch.uint8) if has_mask else seq_lens  # placeholder pointer, never read
    mask_strides = (mask.stride(0), mask.stride(1)) if has_mask else (0, 0)
    # Scores in the log2 domain; the fp8 scale multiplies K (here) and V (in the output scale).
    qk_scale = sm_scale * kv_scale * _LOG2E
    # Arguments both attention kernels take, after their pointers and the block-table stride.
    scalars = (*mask_strides, *o_strides, *((0, 0) if direct else (lse.stride(0), lse.stride(1))),
               num_splits, custom_mask.shape[2] if has_mask else 0, qk_scale, kv_scale)
    # Both attention kernels are programmatic dependents of the kernel before them (SM90+): they are
    # set up as its programs exit, not after it completes, and wait for it before their first load
    # (a fraction of a microsecond off every latency-bound launch: docs/kernels.md).
    pdl = _has_pdl(q.device)
    constants = dict(PAGE_SIZE=kv_cache.shape[1], NUM_HEADS=num_heads, BLOCK_H=tile.block_h, BLOCK_Q=tile.block_q,
                     MIN_CHUNK=min_chunk, HAS_MASK=has_mask, DIRECT=direct, PDL=pdl)
    row_blocks = num_row_blocks(num_heads, max_q_len, tile)
    if config.wgmma:
        q_descs = row_descriptors(q, wgmma_tile.query_box_rows(tile.block_h))
        kv_descs = row_descriptors(kv_cache, config.block_n)
        wgmma_tile._mla_wgmma_kernel[(row_blocks, num_splits, batch_size)](
            *q_descs, *kv_descs, block_tables, seq_lens, cu_seqlens_q, mask, o_part, lse,
            block_tables.stride(0), *scalars, kv_cache, 0, 0, block_tables, 0, 0, 0,  # (a sparse pass's: unused)
            **constants, NUM_STAGES=config.num_stages, KV_FP8=kv_cache.dtype == torch.float8_e4m3fn, SPARSE=False,
            num_warps=wgmma_tile.NUM_WARPS, launch_pdl=pdl,
        )
    else:
        _mla_attention_kernel[(row_blocks * config.v_split, num_splits, batch_size)](
            q, kv_cache, block_tables, seq_lens, cu_seqlens_q, mask, o_part, lse,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0), *scalars,
            **constants, BLOCK_N=config.block_n, D_NOPE=KV_LORA_RANK, D_PE=QK_ROPE_DIM, V_SPLIT=config.v_split,
            num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
        )
    if reduce and not direct:
        _merge_splits(o_part, lse, out, cu_seqlens_q, num_splits, discard_partials)


def _merge_splits(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  num_splits: int, discard: bool = False) -> None:
    """out[t, h] = the lse-weighted mean of the first num_splits partials of row (t, h).

    o_part: [T, H, >= num_splits, 512] 16-bit or fp32 partial outputs, each normalised over its own
        chunk (merged in fp32).
    lse: [T, H, >= num_splits] fp32 log2-sum-exp of each chunk's scores; -inf marks an empty chunk,
        whose partial is never used (it may hold anything). A row of only empty chunks outputs 0.
    out: [T, H, 512]; tokens t >= cu_seqlens_q[-1] are left untouched.
    discard: drop the partials from L2 once read (their contents are then undefined), where each
        program's row slices are whole 128-byte lines (discard_line_values); on a GPU only (the
        Triton interpreter runs no PTX).
    """
    num_tokens, num_heads, _ = out.shape
    # Tiles of ~4096 partial values: all splits in one load up to 128 (MAX_SPLITS), with narrower
    # row slices as splits grow, so more programs share the work; a second load, a dependent round
    # trip, cost more than the 64-byte slices of 128 splits. Past 128 splits, loads of 128 in a stream.
    splits_p2 = next_pow2(num_splits)
    block_d = max(32, min(KV_LORA_RANK, 4096 // splits_p2))
    split_block = min(splits_p2, 4096 // block_d)
    line_values = 0
    if discard and o_part.is_cuda:
        line_values = discard_line_values(o_part.element_size(), block_d, o_part.data_ptr(), o_part.stride()[:3])
    # 16-bit partials: warps only along the row slice. Their loads are 8 values a thread, and with
    # warps along the splits the sum over them is a shared-memory exchange of 8 fp32 a thread,
    # whose bank conflicts cost more than the loads. fp32 partials (4 values a thread) keep 4 warps:
    # in small grids the extra warps' loads gain more than their exchange costs.
    num_warps = 4 if o_part.element_size() == 4 else max(1, min(4, block_d // 256))
    # A programmatic dependent launch (SM90+) is set up as the attention kernel's programs exit,
    # not after the kernel completes, and waits for the partials in the kernel. Merging in the
    # attention grid, in thread-block clusters, or with earlier launch_dependents was slower
    # (docs/kernels.md).
    pdl = _has_pdl(out.device)
    _mla_reduce_kernel[(num_tokens, num_heads, KV_LORA_RANK // block_d)](
        o_part, lse, out, cu_seqlens_q, cu_seqlens_q.shape[0] - 1, num_splits,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        SPLIT_BLOCK=split_block, BLOCK_D=block_d, PDL=pdl,
        LINE_VALUES=line_values,
        num_warps=num_warps, launch_pdl=pdl,
    )
