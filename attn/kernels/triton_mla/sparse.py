"""Sparse MLA decode (DeepSeek-V3.2 DSA) as a Triton kernel: each query token attends over its own
K cache rows, given as slots (page * page_size + offset, -1: none) of the paged 576-wide cache.

Tokens share no kv rows (each has its own selection), so a program holds one token's heads (16-64
rows, the dense kernel's tiles) and gathers the token's rows BLOCK_N at a time; the work is the dense
kernel's over T requests of one query token and K kv rows each, so plan.plan_launch cuts K into
split chunks and kernel._merge_splits combines them. Where wgmma.supports_sparse and the plan takes
64-row tiles, the tile is the dense Gluon wgmma kernel's with its kv tiles gathered by cp.async
(SPARSE); fewer heads (V3.2's 16 a TP8 rank) run it padded to 64 rows, as FlashMLA does, from
PADDED_MIN_TOKENS tokens on, where its wgmma outruns the 16-row tiles' mma.sync despite the 4x
work; elsewhere _sparse_mla_kernel serves. The grid follows shapes only (T, heads, K): no host
sync, graph safe.
"""

import functools

import torch

from attn.base import KV_DIM, KV_LORA_RANK, QK_ROPE_DIM, const_arange
from attn.kernels.triton_mla.kernel import (_LOG2E, _expect, _has_pdl, _jit, _merge_splits, _num_sms,
                                            expect_one_device, online_softmax_step, store_rows, tl, triton)
from attn.kernels.triton_mla import wgmma as wgmma_tile
from attn.kernels.triton_mla.plan import MAX_SPLITS, chunk_len, min_split_len, plan_launch
from attn.kernels.triton_mla.tma import row_descriptors
from attn.values import is_int, is_positive_finite

PADDED_MIN_TOKENS = 16  # tokens from which fewer than 64 heads run the padded wgmma tile (docs/kernels.md)


@_jit
def _sparse_mla_kernel(
    q_ptr, kv_ptr, slots_ptr, o_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kv_page, stride_kv_row, stride_st,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    num_slots, chunk, qk_scale, v_scale,
    PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D_NOPE: tl.constexpr, D_PE: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (tokens x head blocks, splits). One program: BLOCK_H heads of one token over its slots
    ``[split * chunk, (split + 1) * chunk)`` (chunk a multiple of BLOCK_N), -1 slots skipped.

    DIRECT (one split): writes the normalised output [T, H, 512]; otherwise the normalised partial
    [T, H, S, 512] and its log2-sum-exp [T, H, S] (-inf: no row), as the dense kernel does.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
    num_h_blocks: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    token = (tl.program_id(0) // num_h_blocks).to(tl.int64)
    head = tl.program_id(0) % num_h_blocks * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    row_valid = head < NUM_HEADS
    offs_d = tl.arange(0, D_NOPE)
    offs_pe = tl.arange(0, D_PE)
    q_row_ptr = q_ptr + token * stride_qt + head.to(tl.int64) * stride_qh
    q_nope = tl.load(q_row_ptr[:, None] + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    q_pe = tl.load(q_row_ptr[:, None] + D_NOPE + offs_pe[None, :], mask=row_valid[:, None], other=0.0)

    lo = split * chunk
    hi = tl.minimum(lo + chunk, num_slots)
    slot_row_ptr = slots_ptr + token * stride_st
    acc = tl.zeros([BLOCK_H, D_NOPE], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_row_ptr + offs_n, mask=offs_n < hi, other=-1)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0).to(tl.int64)
        row_ptr = kv_ptr + slot // PAGE_SIZE * stride_kv_page + slot % PAGE_SIZE * stride_kv_row
        # An fp8 cache is widened to the query dtype; its scale is folded into qk_scale / v_scale.
        k_nope = tl.load(row_ptr[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0).to(q_nope.dtype)
        k_pe = tl.load(row_ptr[:, None] + D_NOPE + offs_pe[None, :], mask=valid[:, None], other=0.0).to(q_pe.dtype)
        qk = tl.dot(q_nope, tl.trans(k_nope))
        qk = tl.dot(q_pe, tl.trans(k_pe), qk)
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))  # log2 domain
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, qk, k_nope, num_slots, True)
    store_rows(o_ptr, lse_ptr, token, head, acc, m_i, l_i, v_scale, split, 0, offs_d, row_valid, row_valid,
               stride_ot, stride_oh, stride_os, stride_lt, stride_lh, DIRECT)


def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, sm_scale: float, kv_scale: float,
                  out: torch.Tensor | None, num_splits: int | None) -> None:
    """Shape, dtype, layout, device and scalar checks; reads no GPU value."""
    expect = functools.partial(_expect, caller="sparse_mla_decode")
    expect(q.dim() == 3 and q.shape[2] == KV_DIM and q.dtype in (torch.bfloat16, torch.float16) and q.stride(2) == 1,
           f"q must be [T, H, {KV_DIM}] bf16/fp16, last dim contiguous, got {tuple(q.shape)} {q.dtype} "
           f"strides {q.stride()}")
    expect(kv_cache.dim() == 3 and kv_cache.shape[2] == KV_DIM and kv_cache.stride(2) == 1
           and kv_cache.dtype in (q.dtype, torch.float8_e4m3fn),
           f"kv_cache must be [num_pages, page_size, {KV_DIM}] in q's dtype ({q.dtype}) or float8_e4m3fn, last dim "
           f"contiguous, got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    expect(slots.dim() == 2 and slots.shape[0] == q.shape[0] and slots.dtype == torch.int32 and slots.stride(1) == 1,
           f"slots must be [T={q.shape[0]}, K] int32, last dim contiguous, got {tuple(slots.shape)} {slots.dtype}")
    for name, scale in (("sm_scale", sm_scale), ("kv_scale", kv_scale)):
        expect(is_positive_finite(scale), f"{name} must be a finite positive float, got {scale!r}")
    expected_out = (q.shape[0], q.shape[1], KV_LORA_RANK)
    if out is not None:
        expect(tuple(out.shape) == expected_out and out.dtype == q.dtype and out.stride(2) == 1,
               f"out must be {list(expected_out)} {q.dtype}, last dim contiguous, got {tuple(out.shape)} {out.dtype}")
    if num_splits is not None:
        expect(is_int(num_splits) and 1 <= num_splits <= MAX_SPLITS,
               f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    expect_one_device((q, kv_cache, slots, out), "sparse_mla_decode")


def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, sm_scale: float,
                      kv_scale: float = 1.0, out: torch.Tensor | None = None,
                      num_splits: int | None = None) -> torch.Tensor:
    """Attention of absorbed MLA queries over their own cache rows; no host sync, graph-safe.

    q ``[T, H, 576]`` bf16/fp16; kv_cache ``[num_pages, page_size, 576]`` in q's dtype or
    float8_e4m3fn (times kv_scale; K the row, V its first 512); slots ``[T, K]`` int32: token t's
    rows as page * page_size + offset, -1 for none, in any order (slots past the cache are undefined).
    Returns out ``[T, H, 512]`` in q's dtype (in place if given): fp32 softmax by sm_scale, 0 for a
    token with no row (sparse_mla_reference's contract). num_splits overrides the plan's cut of K.
    """
    _check_inputs(q, kv_cache, slots, sm_scale, kv_scale, out, num_splits)
    sm_scale, kv_scale = float(sm_scale), float(kv_scale)  # (Triton refuses numpy float32 arguments)
    if triton is None:
        raise RuntimeError("sparse_mla_decode needs Triton, which is not installed")
    num_tokens, num_heads, _ = q.shape
    out = q.new_empty(num_tokens, num_heads, KV_LORA_RANK) if out is None else out
    num_slots = slots.shape[1]
    if num_tokens == 0 or num_slots == 0:
        return out.zero_()
    wgmma = wgmma_tile.supports_sparse(q, kv_cache)
    padded = wgmma and num_heads < wgmma_tile.BLOCK_M and num_tokens >= PADDED_MIN_TOKENS
    plan = plan_launch(num_tokens, wgmma_tile.BLOCK_M if padded else num_heads, 1, num_slots, _num_sms(q.device),
                       wide_tiles=wgmma)
    block_h = plan.tile.rows  # (a tile of several tokens: one token's heads)
    wgmma = wgmma and block_h == wgmma_tile.BLOCK_M
    block_n = wgmma_tile.BLOCK_N if wgmma else plan.config.block_n
    splits = num_splits or plan.num_splits
    chunk = chunk_len(num_slots, splits, block_n, min_split_len(plan.tile, narrow=True))
    direct = splits == 1
    if direct:
        o_part, lse = out, out.new_empty(0, 0, 0, dtype=torch.float32)
        o_strides = (out.stride(0), out.stride(1), 0)
    else:  # 16-bit partials (plan.narrow_partials)
        o_part = q.new_empty(num_tokens, num_heads, splits, KV_LORA_RANK)
        lse = q.new_empty(num_tokens, num_heads, splits, dtype=torch.float32)
        o_strides = o_part.stride()[:3]
    pdl = _has_pdl(q.device)
    qk_scale = sm_scale * kv_scale * _LOG2E
    grid = (num_tokens * triton.cdiv(num_heads, block_h), splits)
    if wgmma:
        q_descs = row_descriptors(q, wgmma_tile.query_box_rows(block_h))
        kv_descs = row_descriptors(kv_cache, block_n)  # the kv tiles' dtype and layouts; the rows are gathered
        wgmma_tile._mla_wgmma_kernel[(*grid, 1)](
            *q_descs, *kv_descs, slots, slots, slots, slots, o_part, lse, 0, 0, 0,
            *o_strides, lse.stride(0), lse.stride(1), splits, 0, qk_scale, kv_scale,
            kv_cache, kv_cache.stride(0), kv_cache.stride(1), slots, slots.stride(0), num_slots, chunk,
            PAGE_SIZE=kv_cache.shape[1], NUM_HEADS=num_heads, BLOCK_H=block_h, BLOCK_Q=1, MIN_CHUNK=block_n,
            HAS_MASK=False, DIRECT=direct, NUM_STAGES=2, KV_FP8=kv_cache.dtype == torch.float8_e4m3fn, PDL=pdl,
            SPARSE=True, num_warps=wgmma_tile.NUM_WARPS, launch_pdl=pdl,
        )
    else:
        _sparse_mla_kernel[grid](
            q, kv_cache, slots, o_part, lse,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), slots.stride(0),
            *o_strides, lse.stride(0), lse.stride(1),
            num_slots, chunk, qk_scale, kv_scale,
            PAGE_SIZE=kv_cache.shape[1], NUM_HEADS=num_heads, BLOCK_H=block_h, BLOCK_N=block_n,
            D_NOPE=KV_LORA_RANK, D_PE=QK_ROPE_DIM, DIRECT=direct, PDL=pdl,
            num_warps=plan.config.num_warps, num_stages=plan.config.num_stages, launch_pdl=pdl,
        )
    if not direct:
        every_token = const_arange(2 * num_tokens, q.device, num_tokens, torch.int32)  # [0, T]: one "request"
        _merge_splits(o_part, lse, out, every_token, splits, plan.discard_partials)
    return out
