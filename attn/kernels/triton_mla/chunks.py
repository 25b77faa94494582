"""What one program of the split-KV MLA kernels works on (its request, query/head block and kv
rows) and which kv rows each of its query rows sees, shared by the Triton and the Gluon kernels
(plain Triton helpers: the Gluon kernel calls them on tensors that carry its layouts)."""

from attn.kernels.triton_lang import jit as _jit, tl


@_jit
def program_work(pid_m, b, cu_q_ptr, seq_lens_ptr, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr):
    """(q_block, h_block, q_start, q_len, kv_len) of row-block program pid_m on request b."""
    num_h_blocks: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    kv_len = tl.load(seq_lens_ptr + b)
    return pid_m // num_h_blocks, pid_m % num_h_blocks, q_start, q_len, kv_len


@_jit
def chunk_bounds(kv_len, q_len, q_block, split, num_splits, mask_len,
                 BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, HAS_MASK: tl.constexpr):
    """(lo, hi, full_end) of query block q_block's program in split `split` of a request.

    Splits cut the request's kv into chunks of a whole number of BLOCK_N tiles (at least MIN_CHUNK
    rows), so tiles start at multiples of BLOCK_N. The program attends kv [lo, hi): its chunk, cut
    to what its rows can see (empty when the block has no valid query). Every row sees all of
    [0, full_end), so tiles ending there need no mask.
    """
    chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    first_q = q_block * BLOCK_Q
    if HAS_MASK:
        full_end = kv_len - mask_len
    else:
        last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
        hi = tl.minimum(hi, kv_len - q_len + last_q + 1)
        full_end = kv_len - q_len + first_q + 1
    hi = tl.where(first_q < q_len, hi, lo)  # no valid rows: no work
    return lo, hi, full_end


@_jit
def visible_kv(offs_n, kv_len, q_pos, mask_rows_ptr, mask_start, row_valid, HAS_MASK: tl.constexpr):
    """[rows, BLOCK_N] bool: which of the kv positions ``offs_n`` [BLOCK_N] each query row sees.

    Positions from kv_len on are never visible. Causal (no mask): a row sees up to its own kv
    position ``q_pos`` [rows]. With a mask: positions before ``mask_start`` are visible, and position
    mask_start + j iff byte j of the row's mask row (``mask_rows_ptr`` [rows]) is set; the mask is
    read only for valid rows (``row_valid`` [rows]) and in-range positions.
    """
    in_range = offs_n < kv_len
    if HAS_MASK:
        rel = offs_n - mask_start
        in_region = rel >= 0
        bits = tl.load(mask_rows_ptr[:, None] + rel[None, :],
                       mask=row_valid[:, None] & (in_region & in_range)[None, :], other=0)
        visible = in_range[None, :] & ((~in_region)[None, :] | (bits != 0))
    else:
        visible = in_range[None, :] & (offs_n[None, :] <= q_pos[:, None])
    return visible
