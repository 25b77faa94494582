"""The 64-row MLA attention tile for Hopper, written in Gluon: TMA-fed, warp-specialised wgmma.

Same contract as ``_mla_attention_kernel`` in kernel.py (which launches it), for the tiles where
that kernel is compute-bound: 64 (query token x head) rows, a cache in the query's 16-bit dtype or
fp8 e4m3 whose pages hold whole 64-row kv tiles, a query and a cache whose rows TMA can address, on
SM90. Triton's own lowering of that tile keeps the query in registers next to the [64, 512] fp32
accumulator and spills; here the roles follow FlashInfer FA3-MLA's:

- the query tile ([64, 576] bf16) arrives by TMA in query_box_rows boxes (``q_ready``) and stays in
  shared memory; kv tiles ([64, 576]) arrive by TMA into NUM_STAGES stages of 72 KB.
- Warpgroup 0 (``_softmax_partition``): the [64, 64] QK^T of a tile, the online softmax, PV for
  output dims 0-255. Warpgroup 1 (``_pv_partition``): PV for dims 256-511, then each stage's next
  TMA once both PVs are off it. Each holds a [64, 256] fp32 accumulator; every wgmma is waited for
  where it is issued (docs/kernels.md says why).
- P ([64, 64]) overwrites the tile's rope rows and is both PVs' A operand; mbarriers: ``ready``
  (TMA landed), ``p_ready`` (P and rescale written), ``a_free`` (warpgroup 0's PV off a stage), ``done``.
- 16-bit stores leave through shared memory a warpgroup is done with (_store_half); an fp8 cache
  lands in two 36 KB slots and is widened in halves into one fp16 stage (wgmma_fp8.py).
- SPARSE (sparse_mla_decode, DeepSeek-V3.2): one token's 64 heads (fewer: padded) over its own
  slots, whose rows cp.async gathers into the stages (_gather_tile); the rest is the dense tile's.

Shared memory: 72 KB query + 2 x 72 KB kv (fp8: a 72 KB stage + 2 x 36 KB slots), one program per
SM, no spills (tests/test_triton_mla_wgmma.py). Timings and the designs dropped: docs/kernels.md.
"""

from __future__ import annotations

import torch

from attn.kernels.triton_mla.chunks import chunk_bounds, program_work, visible_kv
from attn.kernels.triton_mla.tma import flat_rows
from attn.kernels.triton_mla.wgmma_fp8 import QUERY_SCALE, query_to_fp16, widen_half

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # CPU-only install, or a Triton without Gluon: the Triton tile serves instead
    gluon = None

BLOCK_M = 64  # rows of one program: one wgmma M
BLOCK_N = 64  # kv rows per tile; a page must hold whole tiles
MIN_QUERY_BOX = 8  # rows of the smallest query box the tile compiles for (query_box_rows)
NUM_WARPS = 4  # the softmax warpgroup; the PV warpgroup is a 4-warp worker on top
D_NOPE = 512
D_PE = 64
# The same sizes as kernel-visible constants; each warpgroup accumulates half of the output dims.
_constexpr = gl.constexpr if gluon is not None else (lambda value: value)
_BLOCK_M, _D_NOPE, _D_PE, _D_HALF = _constexpr(BLOCK_M), _constexpr(D_NOPE), _constexpr(D_PE), _constexpr(D_NOPE // 2)
NUM_WARPS_ = _constexpr(NUM_WARPS)


def _reads(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """What every launch of this tile needs: Gluon present, an SM90 device, a cache in q's 16-bit
    dtype or fp8 e4m3, and a cache and a query that flatten to TMA-addressable [rows, 576] rows."""
    if gluon is None or not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return (kv_cache.dtype in (q.dtype, torch.float8_e4m3fn) and flat_rows(kv_cache) is not None
            and flat_rows(q) is not None)


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this tile can serve a dense launch: _reads, heads it serves (serves_heads), and pages
    that hold whole kv tiles."""
    return _reads(q, kv_cache) and serves_heads(q.shape[1]) and kv_cache.shape[1] % BLOCK_N == 0


def supports_sparse(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this tile can serve a sparse pass (sparse_mla_decode): _reads, and heads in whole
    64-row tiles or fewer (one padded tile); pages of any size (their rows are gathered)."""
    return _reads(q, kv_cache) and (q.shape[1] % BLOCK_M == 0 or q.shape[1] < BLOCK_M)


def serves_heads(num_heads: int) -> bool:
    """Whether a request's heads fill query boxes of at least MIN_QUERY_BOX rows (query_box_rows):
    below 8 rows a box's shared-memory layout has no 128-byte swizzle, and the kernel over such
    boxes does not compile (Triton 3.6, sm_90a: "PassManager::run failed" in
    ConvertTritonGPUToLLVM). 1, 2 or 4 heads fill one with several tokens' heads; 3 heads cannot
    (a token's heads are a 4-row box with one row of the next token), so the Triton tiles serve
    them."""
    return num_heads > MIN_QUERY_BOX // 2 or num_heads in (1, 2, 4)


def query_box_rows(block_h: int) -> int:
    """Rows of one TMA box of a query tile whose tokens hold ``block_h`` heads each: one token's
    heads, or (fewer than MIN_QUERY_BOX heads, all of a request's: serves_heads) the heads of
    MIN_QUERY_BOX // block_h consecutive tokens, which are consecutive rows of the flat query (so
    1, 2 and 4 heads run this tile, not the Triton ones: docs/kernels.md)."""
    return max(block_h, MIN_QUERY_BOX)


def _jit(fn):
    return gluon.jit(fn) if gluon is not None else fn


@_jit
def _load_tile(kv_nope_desc, kv_pe_desc, kv_nope_smem, kv_pe_smem, ready, stage, page, start, pred,
               PAGE_SIZE: gl.constexpr):
    """TMA of the kv tile at sequence position ``start`` (in page ``page``) into ``stage``."""
    row = page * PAGE_SIZE + start % PAGE_SIZE
    bar = ready.index(stage)
    mbarrier.expect(bar, kv_nope_desc.block_type.nbytes + kv_pe_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(kv_nope_desc, [row, 0], bar, kv_nope_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(kv_pe_desc, [row, 0], bar, kv_pe_smem.index(stage), pred=pred)


@_jit
def _gather_tile(kv_ptr, stride_kv_page, stride_kv_row, slot_row_ptr, kv_nope_smem, kv_pe_smem, ready, stage,
                 start, hi, PAGE_SIZE: gl.constexpr):
    """A sparse pass's kv tile: the rows of slots ``[start, start + 64)`` (page * PAGE_SIZE + offset;
    zeros where a slot is -1 or at ``hi`` and past) into ``stage`` by cp.async, 16 bytes a copy and
    8 (16-bit) or 4 (fp8) copies a 128-byte swizzle row; each of the warpgroup's 128 threads
    arrives on ``ready`` once its own copies have landed (the barrier counts 128)."""
    _BLOCK_N: gl.constexpr = kv_nope_smem.shape[1]
    VEC: gl.constexpr = 128 // kv_nope_smem.dtype.primitive_bitwidth
    COL_THREADS: gl.constexpr = 64 // VEC
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[32 // COL_THREADS, COL_THREADS],
                                            warps_per_cta=[4, 1], order=[1, 0])
    offs = start + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, layout))
    slot = gl.load(slot_row_ptr + offs, mask=offs < hi, other=-1)
    valid = slot >= 0
    slot = gl.where(valid, slot, 0).to(gl.int64)
    row_ptr = kv_ptr + slot // PAGE_SIZE * stride_kv_page + slot % PAGE_SIZE * stride_kv_row
    ptrs = row_ptr[:, None] + gl.arange(0, 64, layout=gl.SliceLayout(0, layout))[None, :]
    mask = valid[:, None]
    for c in gl.static_range(_D_NOPE // 64):
        async_copy.async_copy_global_to_shared(kv_nope_smem.index(stage).slice(c * 64, 64, dim=1), ptrs + c * 64,
                                               mask=mask)
    async_copy.async_copy_global_to_shared(kv_pe_smem.index(stage), ptrs + _D_NOPE, mask=mask)
    async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)


@_jit
def _next_tile(kv_nope_desc, kv_pe_desc, kv_nope_smem, kv_pe_smem, ready, stage, page, start, pred,
               kv_ptr, stride_kv_page, stride_kv_row, slot_row_ptr, hi, PAGE_SIZE: gl.constexpr,
               SPARSE: gl.constexpr):
    """The kv tile at ``start`` into ``stage`` where ``pred``: a dense pass's page rows by TMA
    (_load_tile), a sparse pass's slots' rows by cp.async (_gather_tile)."""
    if SPARSE:
        if pred:
            _gather_tile(kv_ptr, stride_kv_page, stride_kv_row, slot_row_ptr, kv_nope_smem, kv_pe_smem, ready, stage,
                         start, hi, PAGE_SIZE)
    else:
        _load_tile(kv_nope_desc, kv_pe_desc, kv_nope_smem, kv_pe_smem, ready, stage, page, start, pred, PAGE_SIZE)


@_jit
def _load_query(q_nope_desc, q_pe_desc, q_nope_smem, q_pe_smem, q_ready, q_block, h_block, q_start, q_len,
                num_tiles, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_Q: gl.constexpr):
    """TMA of the program's query tile into shared memory, boxes of flat query rows (token *
    NUM_HEADS + head): a [BLOCK_H, .] box per query token of the request, or with fewer heads
    than a box's rows (query_box_rows) a box of the heads of several consecutive tokens;
    completes q_ready. Nothing is loaded for a program without kv tiles.

    Rows of no query are never stored from, so they may hold anything: the heads past NUM_HEADS of
    a box are the next token's, a box of several tokens may reach past q_len (into the next
    request's tokens, or past the query, which TMA fills with zeros), and boxes whose first token
    is past q_len are not loaded at all (a widened tile reads only its query rows)."""
    BOX_ROWS: gl.constexpr = q_nope_desc.block_type.shape[0]
    BOX_Q: gl.constexpr = BOX_ROWS // BLOCK_H  # query tokens a box
    num_q = gl.where(num_tiles > 0, gl.minimum(q_len - q_block * BLOCK_Q, BLOCK_Q), 0)
    # q_ready counts BLOCK_Q // BOX_Q arrivals: a loaded box's with its bytes, a skipped one's without.
    for i in gl.static_range(BLOCK_Q // BOX_Q):
        load = i * BOX_Q < num_q
        row = (q_start + q_block * BLOCK_Q + i * BOX_Q) * NUM_HEADS + h_block * BLOCK_H
        mbarrier.expect(q_ready, q_nope_desc.block_type.nbytes + q_pe_desc.block_type.nbytes, pred=load)
        tma.async_copy_global_to_shared(q_nope_desc, [row, 0], q_ready, q_nope_smem.slice(i * BOX_ROWS, BOX_ROWS),
                                        pred=load)
        tma.async_copy_global_to_shared(q_pe_desc, [row, 0], q_ready, q_pe_smem.slice(i * BOX_ROWS, BOX_ROWS),
                                        pred=load)
        mbarrier.arrive(q_ready, count=1, pred=i * BOX_Q >= num_q)


@_jit
def _store_half(acc, l_i, m_i, half, smem, o_ptr, lse_ptr, q_block, h_block, q_start, q_len, split,
                stride_ot, stride_oh, stride_os, stride_lt, stride_lh, v_scale,
                NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_Q: gl.constexpr, DIRECT: gl.constexpr,
                WRITE_LSE: gl.constexpr):
    """Store output dims [half * 256, half * 256 + 256) of the tile (acc [64, 256] fp32), normalised
    by the row sums l_i, in o_ptr's dtype; with WRITE_LSE (and split partials) also the rows'
    log2-sum-exp.

    16-bit values (the output, or 16-bit partials) go through a _staging view of ``smem`` (shared
    memory the warpgroup is done with) into rows a warp writes whole, 8 dims a thread: from
    the wgmma layout a warp store writes 4-byte pieces of 8 rows, half-filling every sector it
    touches. fp32 partials fill theirs from the wgmma layout. (Stores by TMA were no faster: a
    launch ends only once its stores have landed; docs/kernels.md.)"""
    o_layout: gl.constexpr = acc.type.layout
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_i = gl.convert_layout(l_i, row_l)
    saw_any = l_i > 0
    o = acc * (v_scale / gl.where(saw_any, l_i, 1.0))[:, None]
    if o_ptr.dtype.element_ty.primitive_bitwidth == 16:
        store_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                                      warps_per_cta=[4, 1], order=[1, 0])
        staging = _staging(smem, o_ptr.dtype.element_ty)
        staging.store(o.to(o_ptr.dtype.element_ty))
        gl.thread_barrier()
        o = staging.load(store_layout)
    else:
        store_layout: gl.constexpr = o_layout
    rows_o = gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(1, store_layout))
    q_idx_o = q_block * BLOCK_Q + rows_o // BLOCK_H
    head_o = h_block * BLOCK_H + rows_o % BLOCK_H
    valid_o = (q_idx_o < q_len) & (head_o < NUM_HEADS)
    token_o = (q_start + q_idx_o).to(gl.int64)
    offs_d = half * _D_HALF + gl.arange(0, _D_HALF, layout=gl.SliceLayout(0, store_layout))
    o_row_ptr = o_ptr + token_o * stride_ot + head_o.to(gl.int64) * stride_oh  # the caller's stride: int64
    if DIRECT:
        gl.store(o_row_ptr[:, None] + offs_d[None, :], o, mask=valid_o[:, None])
    else:
        gl.store(o_row_ptr[:, None] + split * stride_os + offs_d[None, :], o, mask=valid_o[:, None])
        if WRITE_LSE:
            m_o = gl.convert_layout(m_i, row_l)
            lse = gl.where(saw_any, m_o + gl.log2(gl.where(saw_any, l_i, 1.0)), float("-inf"))
            lse = gl.convert_layout(lse, gl.SliceLayout(1, store_layout))
            gl.store(lse_ptr + token_o * stride_lt + head_o * stride_lh + split, lse, mask=valid_o)


@_jit
def _staging(smem, dtype: gl.constexpr):
    """A [64, 256] view in 16-bit ``dtype`` of at least 33 KB of shared memory, rows padded by 8
    elements so that a wgmma-layout store of 8 rows hits distinct banks (the 128-byte swizzle of a
    wgmma operand, stored by stmatrix, was no faster overall: docs/kernels.md)."""
    layout: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[_D_HALF, 8]], [_BLOCK_M, _D_HALF], [1, 0])
    return smem._reinterpret(dtype, [_BLOCK_M, _D_HALF], layout)


@_jit
def _softmax_partition(q_nope_smem, q_pe_smem, q_ready, kv_nope_smem, kv_pe_smem, ready, land_nope, land_pe, landed,
                       w0_read, p_ready, a_free, done, row_smem, mask_ptr, b, stride_mb, stride_mq,
                       q_block, h_block, q_start, q_len, kv_len, lo, hi, full_end, num_tiles, mask_len, qk_scale,
                       o_ptr, lse_ptr, split, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, v_scale,
                       slot_row_ptr, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_Q: gl.constexpr,
                       HAS_MASK: gl.constexpr, DIRECT: gl.constexpr, NUM_STAGES: gl.constexpr,
                       NUM_LOADS: gl.constexpr, KV_FP8: gl.constexpr, SPARSE: gl.constexpr):
    """Warpgroup 0: per kv tile, QK^T, the masked online softmax, P and its rescale factor into the
    stage, PV for output dims 0-255; then the final row sums and maxima for warpgroup 1.

    ``ready``: a stage holds its tile. KV_FP8: first widen the tile's latent columns 0-255 from its
    fp8 slot (``landed``) into the stage and say so (``w0_read``), while warpgroup 1 widens the
    rest (ready: ``widened``). SPARSE: the tile's columns are its slots' rows (slot_row_ptr), a
    -1 slot's masked; cp.async wrote them, so they are fenced before the wgmma reads them."""
    _BLOCK_N: gl.constexpr = kv_nope_smem.shape[1]
    dtype: gl.constexpr = kv_nope_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, _BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, _D_HALF, 16])
    zero_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                 warps_per_cta=[4, 1], order=[1, 0])

    rows_s = gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    q_idx_s = q_block * BLOCK_Q + rows_s // BLOCK_H
    q_pos = kv_len - q_len + q_idx_s
    cols_s = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    mask_rows_ptr = mask_ptr + b.to(gl.int64) * stride_mb + q_idx_s.to(gl.int64) * stride_mq
    mask_start = kv_len - mask_len
    row_valid_s = (q_idx_s < q_len) & (h_block * BLOCK_H + rows_s % BLOCK_H < NUM_HEADS)

    acc = gl.zeros([_BLOCK_M, _D_HALF], gl.float32, o_layout)
    s_zero = gl.zeros([_BLOCK_M, _BLOCK_N], gl.float32, s_layout)
    l_acc = gl.zeros([_BLOCK_M, _BLOCK_N], gl.float32, s_layout)  # per-column partial row sums
    m_i = gl.full([_BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    # Also where there are no tiles: the query tile is the staging of the stores at the end.
    mbarrier.wait(q_ready, 0)
    if q_nope_smem.dtype != dtype:  # the fp16 stages of an fp8 cache
        q_nope_op, q_pe_op = query_to_fp16(q_nope_smem, q_pe_smem, zero_layout)
        qk_scale = qk_scale / QUERY_SCALE
    else:
        q_nope_op = q_nope_smem
        q_pe_op = q_pe_smem
    for j in range(num_tiles):
        stage = j % NUM_STAGES
        start = lo + j * _BLOCK_N
        if SPARSE:
            tile_slots = gl.load(slot_row_ptr + start + cols_s, mask=start + cols_s < hi, other=-1)
        kv_nope = kv_nope_smem.index(stage)
        kv_pe = kv_pe_smem.index(stage)
        if KV_FP8:
            slot = j % NUM_LOADS
            mbarrier.wait(landed.index(slot), (j // NUM_LOADS) & 1)
            widen_half(land_nope.index(slot), land_pe.index(slot), kv_nope, kv_pe, 0)
            mbarrier.arrive(w0_read.index(slot), count=1)
        mbarrier.wait(ready.index(stage), (j // NUM_STAGES) & 1)
        if SPARSE:
            if not KV_FP8:
                fence_async_shared()
        elif start + _BLOCK_N > kv_len:
            # Rows past the sequence hold whatever the page held (maybe NaN): P is 0 there, but
            # 0 * NaN is not, so zero those V rows before either PV reads them.
            n_valid = kv_len - start
            rows_z = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, zero_layout))
            for c in gl.static_range(_D_NOPE // 64):
                part = kv_nope.slice(c * 64, 64, dim=1)
                part.store(gl.where(rows_z[:, None] < n_valid, part.load(zero_layout), 0.0).to(dtype))
            fence_async_shared()
            gl.thread_barrier()
        s = warpgroup_mma(q_nope_op, kv_nope.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_pe_op, kv_pe.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

        qk = s * qk_scale  # log2 domain
        if SPARSE:
            qk = gl.where(tile_slots[None, :] >= 0, qk, float("-inf"))
        elif start + _BLOCK_N > gl.minimum(hi, full_end):
            visible = visible_kv(start + cols_s, kv_len, q_pos, mask_rows_ptr, mask_start, row_valid_s, HAS_MASK)
            qk = gl.where(visible, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet stays 0
        p = gl.exp2(qk - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_acc = l_acc * alpha[:, None] + p
        m_i = m_new
        # P replaces the rope rows its QK^T has finished with; the rescale factor has a slot per
        # stage, which the next tile of the stage reaches only after warpgroup 1 has read it.
        kv_pe.store(p.to(dtype))
        row_smem.index(stage).store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(p_ready.index(stage), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(kv_pe, kv_nope.slice(0, _D_HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(a_free.index(stage), count=1)
    l_i = gl.sum(l_acc, 1)
    # Warpgroup 1 normalises its half with the same row sums and maxima.
    row_smem.index(NUM_STAGES).store(l_i)
    row_smem.index(NUM_STAGES + 1).store(m_i)
    gl.thread_barrier()
    mbarrier.arrive(done, count=1)
    # The query tile is done with: the staging of the stores.
    _store_half(acc, l_i, m_i, 0, q_nope_smem, o_ptr, lse_ptr, q_block, h_block, q_start, q_len,
                split, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, v_scale,
                NUM_HEADS, BLOCK_H, BLOCK_Q, DIRECT, True)


@_jit
def _pv_partition(kv_nope_desc, kv_pe_desc, land_nope, land_pe, kv_nope_smem, kv_pe_smem, ready, widened, w0_read,
                  p_ready, a_free, done, row_smem, bt_row_ptr, lo, num_tiles, o_ptr, lse_ptr, q_block, h_block, q_start,
                  q_len, split, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, v_scale,
                  kv_ptr, stride_kv_page, stride_kv_row, slot_row_ptr, hi,
                  PAGE_SIZE: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_Q: gl.constexpr,
                  DIRECT: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_LOADS: gl.constexpr, KV_FP8: gl.constexpr,
                  SPARSE: gl.constexpr):
    """Warpgroup 1: per kv tile, once P is written, rescale and accumulate PV for output dims
    256-511; with a 16-bit cache then load the tile NUM_STAGES ahead into the stage once warpgroup
    0's PV is off it too (it is otherwise idle, so the copy goes out as early as it can). At the
    end, normalise with warpgroup 0's row sums and store.

    KV_FP8: the copies land in NUM_LOADS fp8 slots (land_nope, land_pe) and the one compute stage
    is 16-bit: first, once warpgroup 0's PV is off the stage (the rope rows hold its P), widen the
    latent columns 256-511 and the rope columns into it (``widened``; warpgroup 0 widens 0-255),
    and refill the slot with the tile NUM_LOADS ahead once warpgroup 0 is off it too (w0_read, one
    barrier a slot: a tile's arrival can then never be taken for the one two tiles later).
    SPARSE: each copy is a gather of the tile's slots' rows (_gather_tile)."""
    _BLOCK_N: gl.constexpr = kv_nope_smem.shape[1]
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, _D_HALF, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([_BLOCK_M, _D_HALF], gl.float32, o_layout)
    for j in range(num_tiles):
        stage = j % NUM_STAGES
        slot = j % NUM_LOADS  # a 16-bit cache's copies land in the stages: the same index
        refill = j + NUM_LOADS < num_tiles
        next_start = lo + (j + NUM_LOADS) * _BLOCK_N
        if SPARSE:
            page = 0
        else:
            page = gl.load(bt_row_ptr + next_start // PAGE_SIZE, mask=refill, other=0)
        if KV_FP8:
            mbarrier.wait(ready.index(slot), (j // NUM_LOADS) & 1)
            mbarrier.wait(a_free.index(stage), (j - 1) & 1, pred=j > 0)
            widen_half(land_nope.index(slot), land_pe.index(slot), kv_nope_smem.index(stage),
                        kv_pe_smem.index(stage), 1)
            mbarrier.arrive(widened.index(stage), count=1)
            mbarrier.wait(w0_read.index(slot), (j // NUM_LOADS) & 1)
            _next_tile(kv_nope_desc, kv_pe_desc, land_nope, land_pe, ready, slot, page, next_start, refill,
                       kv_ptr, stride_kv_page, stride_kv_row, slot_row_ptr, hi, PAGE_SIZE, SPARSE)
        mbarrier.wait(p_ready.index(stage), (j // NUM_STAGES) & 1)
        alpha = row_smem.index(stage).load(row_l)
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(kv_pe_smem.index(stage), kv_nope_smem.index(stage).slice(_D_HALF, _D_HALF, dim=1), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        if not KV_FP8:
            mbarrier.wait(a_free.index(stage), (j // NUM_STAGES) & 1, pred=refill)
            _next_tile(kv_nope_desc, kv_pe_desc, land_nope, land_pe, ready, slot, page, next_start, refill,
                       kv_ptr, stride_kv_page, stride_kv_row, slot_row_ptr, hi, PAGE_SIZE, SPARSE)
    mbarrier.wait(done, 0)
    l_i = row_smem.index(NUM_STAGES).load(row_l)
    m_i = row_smem.index(NUM_STAGES + 1).load(row_l)
    # Warpgroup 0 is past its last PV: the kv stages are free for the staging of the stores.
    _store_half(acc, l_i, m_i, 1, kv_nope_smem.index(0), o_ptr, lse_ptr, q_block, h_block, q_start,
                q_len, split, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, v_scale,
                NUM_HEADS, BLOCK_H, BLOCK_Q, DIRECT, False)


@_jit
def _mla_wgmma_kernel(
    q_nope_desc, q_pe_desc, kv_nope_desc, kv_pe_desc, bt_ptr, seq_lens_ptr, cu_q_ptr, mask_ptr, o_ptr, lse_ptr,
    stride_bt, stride_mb, stride_mq,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    num_splits, mask_len, qk_scale, v_scale,
    kv_ptr, stride_kv_page, stride_kv_row, slots_ptr, stride_st, num_slots, chunk,
    PAGE_SIZE: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_Q: gl.constexpr,
    MIN_CHUNK: gl.constexpr, HAS_MASK: gl.constexpr, DIRECT: gl.constexpr, NUM_STAGES: gl.constexpr,
    KV_FP8: gl.constexpr, PDL: gl.constexpr, SPARSE: gl.constexpr,
):
    """Grid (head blocks x query blocks, splits, batch); see _mla_attention_kernel. Loads the query
    tile and then the first kv tiles, and forks into the two warpgroup roles. PDL: a programmatic
    dependent launch, which sets up its shared memory and barriers, then waits for the kernel
    before it ahead of its first load.

    SPARSE (sparse_mla_decode's pass): grid (tokens x head blocks, splits, 1), fewer heads than a
    tile's rows padded (the query box's other rows, the next tokens', are computed, never stored);
    a program's kv tiles
    are its token's slots ``[split * chunk, split * chunk + chunk)`` of ``slots_ptr`` ([T, K] int32,
    row stride stride_st, num_slots a token), gathered from the cache at kv_ptr (its page and row
    strides; the kv descriptors give only the tiles' dtype and layouts), where bt_ptr, seq_lens_ptr,
    cu_q_ptr and mask_ptr are unused."""
    gl.static_assert(BLOCK_H * BLOCK_Q == _BLOCK_M)
    BOX_ROWS: gl.constexpr = q_nope_desc.block_type.shape[0]  # query_box_rows(BLOCK_H)
    gl.static_assert(BOX_ROWS % BLOCK_H == 0 and _BLOCK_M % BOX_ROWS == 0)
    gl.static_assert(BOX_ROWS == BLOCK_H or BLOCK_H == NUM_HEADS)  # several tokens' heads: consecutive rows
    _BLOCK_N: gl.constexpr = kv_nope_desc.block_type.shape[0]
    gl.static_assert(_BLOCK_N == _BLOCK_M)  # P [64, BLOCK_N] takes the place of the rope rows [BLOCK_N, 64]
    gl.static_assert(SPARSE or PAGE_SIZE % _BLOCK_N == 0)  # (a sparse pass gathers rows of any page size)
    gl.static_assert(NUM_STAGES >= 2)  # a tile's copy must never land in the stage being computed
    gl.static_assert(not KV_FP8 or NUM_STAGES == 2)  # two fp8 slots and the fp16 stage fill shared memory
    # An fp8 cache: NUM_STAGES fp8 landing slots for the copies and one fp16 compute stage, which
    # both warpgroups widen each tile into (two 16-bit stages and fp8 slots do not fit).
    STAGES: gl.constexpr = 1 if KV_FP8 else NUM_STAGES
    dtype: gl.constexpr = gl.float16 if KV_FP8 else q_nope_desc.dtype

    q_nope_smem = gl.allocate_shared_memory(q_nope_desc.dtype, [_BLOCK_M, _D_NOPE], q_nope_desc.layout)
    q_pe_smem = gl.allocate_shared_memory(q_pe_desc.dtype, [_BLOCK_M, _D_PE], q_pe_desc.layout)
    # The query's layouts are those of any 16-bit [rows, 512] / [rows, 64] tile.
    kv_nope_smem = gl.allocate_shared_memory(dtype, [STAGES, _BLOCK_N, _D_NOPE], q_nope_desc.layout)
    kv_pe_smem = gl.allocate_shared_memory(dtype, [STAGES, _BLOCK_N, _D_PE], q_pe_desc.layout)
    # Per-row floats: a rescale factor per stage, then the final row sums and maxima.
    row_smem = gl.allocate_shared_memory(gl.float32, [STAGES + 2, _BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # ``widened``: a compute stage holds its tile (with a 16-bit cache, the copy itself).
    if KV_FP8:
        land_nope = gl.allocate_shared_memory(kv_nope_desc.dtype, [NUM_STAGES, _BLOCK_N, _D_NOPE],
                                              kv_nope_desc.layout)
        land_pe = gl.allocate_shared_memory(kv_pe_desc.dtype, [NUM_STAGES, _BLOCK_N, _D_PE], kv_pe_desc.layout)
        widened = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(widened.index(0), count=1)
        w0_read = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(w0_read.index(i), count=1)
    else:
        land_nope = kv_nope_smem
        land_pe = kv_pe_smem
        widened = ready
        w0_read = ready  # unused
    p_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        if SPARSE:  # every thread of the copying warpgroup arrives
            mbarrier.init(ready.index(i), count=NUM_WARPS_ * 32)
        else:
            mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(a_free.index(i), count=1)
    mbarrier.init(done, count=1)
    mbarrier.init(q_ready, count=_BLOCK_M // BOX_ROWS)
    fence_async_shared()  # the barriers, before the first TMA
    gl.thread_barrier()
    # Nothing is prefetched ahead of the wait: neither the TMA descriptors nor the first tiles into
    # L2 gained (docs/kernels.md).
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    split = gl.program_id(1)
    b = gl.program_id(2)
    if SPARSE:  # one query token's heads over a chunk of its slots
        gl.static_assert(BLOCK_Q == 1 and (NUM_HEADS % BLOCK_H == 0 or NUM_HEADS < BLOCK_H))
        q_start = gl.program_id(0) // gl.cdiv(NUM_HEADS, BLOCK_H)
        h_block = gl.program_id(0) % gl.cdiv(NUM_HEADS, BLOCK_H)
        q_block = 0
        q_len = 1
        kv_len = 0
        lo = split * chunk
        hi = gl.minimum(lo + chunk, num_slots)
        full_end = hi
        slot_row_ptr = slots_ptr + q_start.to(gl.int64) * stride_st
    else:
        q_block, h_block, q_start, q_len, kv_len = program_work(gl.program_id(0), b, cu_q_ptr, seq_lens_ptr,
                                                                NUM_HEADS, BLOCK_H)
        lo, hi, full_end = chunk_bounds(kv_len, q_len, q_block, split, num_splits, mask_len,
                                        BLOCK_Q, _BLOCK_N, MIN_CHUNK, HAS_MASK)
        slot_row_ptr = slots_ptr
    num_tiles = gl.maximum(gl.cdiv(hi - lo, _BLOCK_N), 0)
    # A program of an empty chunk (a split past a short request's length) runs through, storing a
    # zero partial by the staging: returning here with only its lse written left the reduce's
    # loads of that partial (which do not wait for the lse) to miss L2 (docs/kernels.md).

    bt_row_ptr = bt_ptr + b.to(gl.int64) * stride_bt
    # The query tile goes out before the first kv tiles: an SM's copies land about in the order they
    # were issued, and the first QK^T needs both; as a TMA copy, the kv copies do not wait for its
    # round trip either (docs/kernels.md).
    _load_query(q_nope_desc, q_pe_desc, q_nope_smem, q_pe_smem, q_ready, q_block, h_block, q_start, q_len,
                num_tiles, NUM_HEADS, BLOCK_H, BLOCK_Q)
    for i in gl.static_range(NUM_STAGES):
        if SPARSE:
            page = 0
        else:
            page = gl.load(bt_row_ptr + (lo + i * _BLOCK_N) // PAGE_SIZE, mask=i < num_tiles, other=0)
        _next_tile(kv_nope_desc, kv_pe_desc, land_nope, land_pe, ready, i, page, lo + i * _BLOCK_N, i < num_tiles,
                   kv_ptr, stride_kv_page, stride_kv_row, slot_row_ptr, hi, PAGE_SIZE, SPARSE)
    gl.warp_specialize([
        (_softmax_partition, (q_nope_smem, q_pe_smem, q_ready, kv_nope_smem, kv_pe_smem, widened, land_nope, land_pe,
                              ready, w0_read, p_ready, a_free, done, row_smem, mask_ptr, b, stride_mb, stride_mq,
                              q_block, h_block, q_start, q_len, kv_len, lo, hi, full_end, num_tiles, mask_len,
                              qk_scale, o_ptr, lse_ptr, split, stride_ot, stride_oh, stride_os, stride_lt,
                              stride_lh, v_scale, slot_row_ptr, NUM_HEADS, BLOCK_H, BLOCK_Q, HAS_MASK, DIRECT,
                              STAGES, NUM_STAGES, KV_FP8, SPARSE)),
        (_pv_partition, (kv_nope_desc, kv_pe_desc, land_nope, land_pe, kv_nope_smem, kv_pe_smem, ready, widened,
                         w0_read, p_ready, a_free, done, row_smem, bt_row_ptr, lo, num_tiles, o_ptr, lse_ptr, q_block,
                         h_block, q_start, q_len, split, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                         v_scale, kv_ptr, stride_kv_page, stride_kv_row, slot_row_ptr, hi,
                         PAGE_SIZE, NUM_HEADS, BLOCK_H, BLOCK_Q, DIRECT, STAGES, NUM_STAGES, KV_FP8, SPARSE)),
    ], [4], [232])
