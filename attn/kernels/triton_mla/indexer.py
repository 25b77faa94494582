"""DeepSeek-V3.2's lightning indexer on the GPU: a Triton kernel scores every cached key each query
token sees into a ``[tokens, table width]`` fp32 buffer (-inf where unseen), torch.topk selects the
best positions, a second kernel maps them to cache slots.

Positions index the buffer in kv order, as indexer_topk_reference's scores do, so equal scores give
the reference's very selection (torch.topk breaks ties alike on the same device). One program scores
one token's heads against BLOCK_N keys at a time (q ``[heads, D]`` x keys ``[D, BLOCK_N]``), over a
run of tiles; tiles past what the token sees are only stored as -inf. Tokens find their request on
the device (cu_seqlens_q), so ragged prefill, tree verify and padding tokens take one launch shape;
the buffer is cut into chunks of tokens of at most SCORE_BUFFER_BYTES. No host sync, graph safe.
"""

import functools

import torch

from attn.kernels.triton_mla.chunks import visible_kv
from attn.kernels.triton_mla.kernel import _expect, _jit, _num_sms, expect_one_device, tl, triton
from attn.kernels.triton_mla.plan import next_pow2
from attn.values import is_int

SCORE_BUFFER_BYTES = 256 << 20  # fp32 scores of one chunk of query tokens (one token at least)
BLOCK_N = 64  # keys a tile (16-bit and fp8 caches, 4 warps; fp32 products: 32 keys, 8 warps, without spills)
SLOTS_BLOCK = 1024  # selected positions one step of the slot kernel maps


@_jit
def _token_request(token, cu_q_ptr, batch_size, BLOCK_B: tl.constexpr):
    """(request, is_query) of packed query ``token``: the requests ending at or before it (requests of
    no token included); a token from cu_seqlens_q[B] on is padding (request clamped to B - 1)."""
    offs = tl.arange(0, BLOCK_B)
    ends = tl.load(cu_q_ptr + 1 + offs, mask=offs < batch_size, other=2**31 - 1)
    b = tl.sum((ends <= token).to(tl.int32), 0)
    return tl.minimum(b, batch_size - 1), b < batch_size


@_jit
def _index_score_kernel(
    q_ptr, w_ptr, k_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, mask_ptr, score_ptr,
    first_token, batch_size, num_positions, tiles_per_program, mask_len,
    stride_qt, stride_qh, stride_wt, stride_k_page, stride_k_row, stride_bt, stride_mb, stride_mq, stride_st,
    PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (tokens of the chunk, runs of tiles_per_program tiles): scores row ``r`` of the buffer
    (token first_token + r) over its positions ``[run * tiles_per_program * BLOCK_N, ...)``:
    ``sum_h w[t, h] * relu(q[t, h] . k)`` in fp32 where the token sees the position, else -inf."""
    row = tl.program_id(0)
    token = first_token + row
    b, is_query = _token_request(token, cu_q_ptr, batch_size, BLOCK_B)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    kv_len = tl.where(is_query, tl.load(seq_lens_ptr + b), 0)  # padding sees nothing
    q_idx = token - q_start
    q_pos = kv_len - q_len + q_idx
    # The positions from `end` on are unseen: causal, past the token's own; with a tree mask, past kv_len.
    if HAS_MASK:
        end = kv_len
    else:
        end = tl.minimum(kv_len, q_pos + 1)
    # visible_kv's row vectors, of one row
    q_pos_rows = tl.zeros([1], tl.int32) + q_pos
    mask_rows_ptr = mask_ptr + (tl.zeros([1], tl.int64) + b.to(tl.int64) * stride_mb + q_idx.to(tl.int64) * stride_mq)
    valid_rows = (tl.zeros([1], tl.int32) == 0) & is_query

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    t64 = token.to(tl.int64)
    q = tl.load(q_ptr + t64 * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=(heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    w = tl.load(w_ptr + t64 * stride_wt + heads, mask=heads < NUM_HEADS, other=0.0)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_bt
    score_row_ptr = score_ptr + row.to(tl.int64) * stride_st

    lo = tl.program_id(1) * tiles_per_program * BLOCK_N
    hi = tl.minimum(lo + tiles_per_program * BLOCK_N, num_positions)
    mid = tl.minimum(hi, lo + tl.cdiv(tl.maximum(end - lo, 0), BLOCK_N) * BLOCK_N)  # tiles with a seen position
    for start in range(lo, mid, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < end
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=in_range, other=0).to(tl.int64)
        key_ptr = k_ptr + page * stride_k_page + (offs_n % PAGE_SIZE).to(tl.int64) * stride_k_row
        keys = tl.load(key_ptr[:, None] + dims[None, :], mask=in_range[:, None] & (dims < HEAD_DIM)[None, :],
                       other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N] fp32
        score = tl.sum(tl.maximum(qk, 0.0) * w[:, None], 0)
        seen = visible_kv(offs_n, kv_len, q_pos_rows, mask_rows_ptr, kv_len - mask_len, valid_rows, HAS_MASK)
        score = tl.where(seen, score[None, :], float("-inf"))
        tl.store(score_row_ptr + offs_n[None, :], score, mask=(offs_n < hi)[None, :])
    for start in range(mid, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        tl.store(score_row_ptr + offs_n, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=offs_n < hi)


@_jit
def _slots_kernel(pos_ptr, val_ptr, bt_ptr, cu_q_ptr, out_ptr, first_token, batch_size, found, topk,
                  stride_pt, stride_vt, stride_bt, stride_ot,
                  PAGE_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr):
    """Grid (tokens of the chunk): row r's ``found`` best positions (values: their scores) as cache
    slots of token first_token + r's request into out ``[T, topk]``, -1 for an unseen one (-inf)
    and past ``found``."""
    row = tl.program_id(0)
    token = first_token + row
    b, _ = _token_request(token, cu_q_ptr, batch_size, BLOCK_B)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_bt
    for start in range(0, topk, BLOCK_K):
        offs = start + tl.arange(0, BLOCK_K)
        pos = tl.load(pos_ptr + row.to(tl.int64) * stride_pt + offs, mask=offs < found, other=0)
        seen = tl.load(val_ptr + row.to(tl.int64) * stride_vt + offs, mask=offs < found,
                       other=float("-inf")) > float("-inf")
        page = tl.load(bt_row_ptr + pos // PAGE_SIZE, mask=seen, other=0)
        slot = tl.where(seen, page * PAGE_SIZE + (pos % PAGE_SIZE).to(tl.int32), -1)
        tl.store(out_ptr + token.to(tl.int64) * stride_ot + offs, slot, mask=offs < topk)


def _check_inputs(q, weights, index_cache, block_tables, seq_lens, cu_seqlens_q, topk, custom_mask) -> None:
    """Shape, dtype, layout, device and scalar checks; reads no GPU value."""
    expect = functools.partial(_expect, caller="indexer_topk")
    floats = (torch.bfloat16, torch.float16, torch.float32)
    expect(q.dim() == 3 and q.dtype in floats and q.stride(2) == 1,
           f"q must be [T, heads, D] bf16/fp16/fp32, last dim contiguous, got {tuple(q.shape)} {q.dtype}")
    num_tokens, heads, dim = q.shape
    expect(tuple(weights.shape) == (num_tokens, heads) and weights.dtype == torch.float32 and weights.stride(1) == 1,
           f"weights must be [{num_tokens}, {heads}] fp32, last dim contiguous, got {tuple(weights.shape)} "
           f"{weights.dtype}")
    expect(index_cache.dim() == 3 and index_cache.shape[2] == dim and index_cache.stride(2) == 1
           and index_cache.dtype in (*floats, torch.float8_e4m3fn),
           f"index_cache must be [num_pages, page_size, {dim}] bf16/fp16/fp32/float8_e4m3fn, last dim contiguous, "
           f"got {tuple(index_cache.shape)} {index_cache.dtype}")
    expect(block_tables.dim() == 2 and block_tables.dtype == torch.int32 and block_tables.shape[1] >= 1
           and block_tables.stride(1) == 1,
           f"block_tables must be [B, max_pages >= 1] int32, got {tuple(block_tables.shape)} {block_tables.dtype}")
    batch_size = block_tables.shape[0]
    for name, t, n in (("seq_lens", seq_lens, batch_size), ("cu_seqlens_q", cu_seqlens_q, batch_size + 1)):
        expect(tuple(t.shape) == (n,) and t.dtype == torch.int32 and t.is_contiguous(),
               f"{name} must be [{n}] int32, contiguous, got {tuple(t.shape)} {t.dtype}")
    expect(is_int(topk) and topk >= 1, f"topk must be an int >= 1, got {topk!r}")
    if custom_mask is not None:
        expect(custom_mask.dtype == torch.bool and custom_mask.dim() == 3 and custom_mask.shape[0] == batch_size
               and custom_mask.shape[2] >= 1 and custom_mask.stride(2) == 1,
               f"custom_mask must be [B={batch_size}, max_q_len, M >= 1] bool, last dim contiguous, got "
               f"{tuple(custom_mask.shape)} {custom_mask.dtype}")
    expect_one_device((q, weights, index_cache, block_tables, seq_lens, cu_seqlens_q, custom_mask), "indexer_topk")


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    topk: int,
    custom_mask: torch.Tensor | None = None,
    max_kv_len: int | None = None,
) -> torch.Tensor:
    """indexer_topk_reference's contract on the GPU; no host sync, graph-safe.

    q ``[T, Hi, D]`` bf16/fp16/fp32; weights ``[T, Hi]`` fp32; index_cache ``[num_pages, page_size,
    D]`` bf16/fp16/fp32 or float8_e4m3fn (unscaled); block_tables ``[B, max_pages]`` int32; seq_lens
    ``[B]`` int32; cu_seqlens_q ``[B + 1]`` int32; custom_mask ``[B, max_q_len, M]`` bool or None
    (causal). Token i of request b sits at kv position ``seq_lens[b] - q_len_b + i``. Returns ``[T,
    topk]`` int32 slots, best first, -1 past the positions a token sees (all -1 for tokens from
    cu_seqlens_q[B] on). Scores are fp32 sums over products in the promoted dtype of q and the cache
    (q's own over an fp8 cache). max_kv_len: a host bound of every seq_lens (None: the tables'
    width), the positions scored: a pool sized for 128k scores a 4k pass's 4k. Memory: a ``[chunk,
    positions]`` fp32 buffer.
    """
    _check_inputs(q, weights, index_cache, block_tables, seq_lens, cu_seqlens_q, topk, custom_mask)
    _expect(max_kv_len is None or (is_int(max_kv_len) and max_kv_len >= 1),
            f"max_kv_len must be None or an int >= 1, got {max_kv_len!r}", caller="indexer_topk")
    if triton is None:
        raise RuntimeError("indexer_topk needs Triton, which is not installed")
    num_tokens, heads, dim = q.shape
    slots = torch.empty(num_tokens, topk, dtype=torch.int32, device=q.device)
    if num_tokens == 0 or block_tables.shape[0] == 0:  # (no request: every token is padding)
        return slots.fill_(-1)
    batch_size, table_width = block_tables.shape
    page_size = index_cache.shape[1]
    num_positions = table_width * page_size
    if max_kv_len is not None:
        num_positions = min(num_positions, max_kv_len)
    dtype = q.dtype if index_cache.dtype == torch.float8_e4m3fn else torch.promote_types(q.dtype, index_cache.dtype)
    q = q.to(dtype)
    chunk = max(1, min(num_tokens, SCORE_BUFFER_BYTES // (4 * num_positions)))
    scores = torch.empty(chunk, num_positions, dtype=torch.float32, device=q.device)
    ieee = dtype == torch.float32
    block_n, num_warps = (BLOCK_N // 2, 8) if ieee else (BLOCK_N, 4)
    # Runs of tiles: about four programs an SM in all, each scoring a run of keys against its query.
    tiles = triton.cdiv(num_positions, block_n)
    runs = max(1, min(tiles, triton.cdiv(4 * _num_sms(q.device), chunk)))
    tiles_per_program = triton.cdiv(tiles, runs)
    has_mask = custom_mask is not None
    mask = custom_mask.view(torch.uint8) if has_mask else seq_lens  # placeholder pointer, never read
    block_b = next_pow2(batch_size)
    found = min(topk, num_positions)
    for first in range(0, num_tokens, chunk):
        rows = min(chunk, num_tokens - first)
        _index_score_kernel[(rows, triton.cdiv(tiles, tiles_per_program))](
            q, weights, index_cache, block_tables, seq_lens, cu_seqlens_q, mask, scores,
            first, batch_size, num_positions, tiles_per_program, custom_mask.shape[2] if has_mask else 0,
            q.stride(0), q.stride(1), weights.stride(0), index_cache.stride(0), index_cache.stride(1),
            block_tables.stride(0), *((mask.stride(0), mask.stride(1)) if has_mask else (0, 0)), scores.stride(0),
            PAGE_SIZE=page_size, NUM_HEADS=heads, HEAD_DIM=dim, BLOCK_H=max(16, next_pow2(heads)),
            BLOCK_D=max(16, next_pow2(dim)), BLOCK_N=block_n, BLOCK_B=block_b, HAS_MASK=has_mask,
            DOT_PRECISION="ieee" if ieee else "tf32", num_warps=num_warps,
        )
        best = scores[:rows].topk(found, dim=1)
        _slots_kernel[(rows,)](
            best.indices, best.values, block_tables, cu_seqlens_q, slots, first, batch_size, found, topk,
            best.indices.stride(0), best.values.stride(0), block_tables.stride(0), slots.stride(0),
            PAGE_SIZE=page_size, BLOCK_K=min(SLOTS_BLOCK, next_pow2(topk)), BLOCK_B=block_b,
        )
    return slots
