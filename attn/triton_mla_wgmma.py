"""The 64-row MLA attention tile for Hopper, written in Gluon: TMA-fed, warp-specialised wgmma.

Same contract as ``_mla_attention_kernel`` in attn/triton_mla_kernel.py (which launches it), for
the tiles where that kernel is compute-bound: 64 (query token x head) rows, a cache in the
query's 16-bit dtype or fp8 e4m3 whose pages hold whole 64-row kv tiles, a query and a cache whose
rows TMA can address, on SM90.
Triton's own lowering of that tile keeps the query in registers next to the [64, 512] fp32
accumulator and spills; here the roles follow FlashInfer FA3-MLA's, spelled out:

- the query tile ([64, 512] + [64, 64] bf16) arrives by TMA, a box of one token's heads per query
  token, or with 1, 2 or 4 heads of several tokens' (query_box_rows) (``q_ready``), and sits in
  shared memory for the whole program;
- kv tiles ([64, 512] + [64, 64] bf16) arrive by TMA into NUM_STAGES stages (two of 72 KB);
- warpgroup 0 (``_softmax_partition``) computes the whole [64, 64] QK^T of a tile, the online
  softmax, and PV for output dims 0-255; warpgroup 1 (``_pv_partition``) computes PV for dims
  256-511 and issues each stage's next TMA as soon as both PVs are off it. The [64, 256] fp32
  accumulator a warpgroup holds is 128 registers a thread.
- QK^T at N = 64 in one warpgroup reads the query tile once per kv tile. Splitting it along N
  across both warpgroups (the previous version of this tile) read it twice, which made QK^T
  bound by shared-memory reads (~1.5x its MMA cycles) and needed a row-max exchange.
- P ([64, 64] bf16) overwrites the tile's rope rows, which QK^T has finished with, and is PV's A
  operand in both warpgroups; the per-row rescale factor goes through a 64-float slot per stage.
- mbarriers order the roles: ``ready`` (TMA landed), ``p_ready`` (P and the rescale factor of a
  stage written), ``a_free`` (warpgroup 0's PV done with a stage), ``done`` (final row sums).
- 16-bit stores (one-split outputs, and split partials where triton_mla_plan.narrow_partials
  says so) leave through shared memory a warpgroup is done with (warpgroup 0: the query tile;
  warpgroup 1: a kv stage, once warpgroup 0 is past its last PV), as whole rows a warp: stored
  from the wgmma layout they half-filled every sector (H100, 128 heads x q_len 4: 32 x 1k 84 ->
  72 us; nor are the latency-bound launches, whose staging is on the critical path, faster
  without it: 1 x 1k x 128 heads x q_len 4 17.1 against 10.6 us, 1 x 16k x 16 heads x q_len 4
  22.5 against 16.9). fp32 partials are stored from the wgmma layout, which fills whole sectors.
- Every wgmma is waited for where it is issued: one left in flight across other code made ptxas
  serialise all of them (warning C7515), which cost ~25% at 128 heads.
- An fp8 cache (KV_FP8) lands in two fp8 slots of 36 KB and one fp16 compute stage takes the
  second 72 KB (no room for a second). Each tile is widened into it in halves (e4m3 -> fp16 is
  exact and one instruction a pair, where bf16 needs several): warpgroup 0 latent columns 0-255
  (``w0_read``), warpgroup 1 the rest (``widened``) once warpgroup 0's PV of the tile before is
  off the stage; warpgroup 1 then refills the slot. Warpgroup 0 rewrites a bf16 query tile as fp16
  times Q_FP16_SCALE and divides the score scale by it (attn/triton_mla_wgmma_fp8.py). H100,
  against the Triton tile that served fp8 before (and bf16 on this tile): 128 x 4k x 16 heads x
  q_len 4 400.8 -> 173.7 us (211.8), 8 x 16k x 16 heads x q_len 4 117.4 -> 52.8 (65.0), 32 x 4k x
  128 heads 196.9 -> 93.5 (72.8), 8 x 4k x 128 heads x q_len 4 200.4 -> 91.6 (64.1). Measured and
  dropped: widening by warpgroup 1 alone (32 x 4k x 128 heads 100.1 us); QK^T by parts as they are
  widened (109.8); widening to bf16 (125.3 by bit moves and a bf16 multiply, 140.1 by Triton's
  cast).

Shared memory: 72 KB query + 2 x 72 KB kv (fp8: a 72 KB stage + 2 x 36 KB slots), one program per
SM; no spills (tests/test_triton_mla_wgmma.py compiles it for sm_90a on the CPU and checks both).
Measured and dropped (H100, graphs): 32-row kv tiles in 3 or 4 stages of 36 KB, to keep more kv in
flight in the same shared memory (P [64, 32] in a stage's rope rows): slower or no faster on every
shape tried, as QK^T at N = 32 reads the query tile once per 32 kv rows (32 x 4k x 128 heads
71.1 -> 86.4 us, 128 x 16k x 128 heads 1004 -> 1266, 128 x 1k x 16 heads x q_len 4 64.5 -> 64.7). The
softmax's share at 128 heads, as a bound (another H100, whose baselines ran slower): with its
arithmetic removed (P = the raw scores, wrong results)
128 x 16k x 128 heads ran 1071 -> 972 us (0.75 -> 0.83 of the roofline), 32 x 4k 75.7 -> 70.2
(0.66 -> 0.72), 128 x 1k 81.8 -> 78.2 (0.61 -> 0.64); hiding it under the other warpgroup's
wgmma (FlashMLA's seesaw) could gain no more, short of 0.8 where contexts are short.
Where the 128-head tile's time goes (ncu, H100 at its own clocks, 32 x 4k x 128 heads, q_len 1,
1.7 GHz): tensor pipe active 64% of the cycles, DRAM 68% of peak (2.25 TB/s), L2 70%, L1/shared
51%. By stall samples, warpgroup 0 is never idle for long: QK^T 39% of its samples, the softmax
19%, its PV 21%, waiting for kv 5%, the pipeline fill (query and first tiles) 12%; warpgroup 1
spends 49% of its samples waiting for P. The chain QK^T -> softmax -> PV of warpgroup 0 bounds
the tile, not the memory system. Measured and dropped (H100, graphs, one process): three
warpgroups, QK^T and the softmax alone in warpgroup 0 and a PV half in each of two more (ptxas
keeps setmaxnreg only with 160 registers for each PV warpgroup, which leaves 184 for warpgroup 0:
the whole query does not fit in its registers, its latent columns 0-255 do): slower on 14 of 15
shapes, 32 x 4k x 128 heads 70.9 -> 81.3 us (76.3 with the query half in registers), 8 x 16k x 128
heads 69.4 -> 78.6 (78.6), 128 x 4k x 128 heads 283.4 -> 292.2 (288.8), 32 x 4k x 128 heads x
q_len 4 255.2 -> 268.5 (270.3). Not tried: FA3's overlap of a tile's softmax with the PV of the
tile before in warpgroup 0 holds each stage one softmax longer, so with two stages the refill
would land after the QK^T that needs it; it wants a third stage, which shared memory cannot hold
beside the query. Also measured and dropped on the same shapes (outputs within 0.008 of this tile's;
all but the fourth below also passed tests/test_triton_mla_kernel.py's GPU tests):
- QK^T split along K, warpgroup 1 taking latent columns 256-511 and the rope columns and handing
  its scores over as bf16 hi + lo (over the tile's rope rows and an 8 KB buffer), then the next
  tile's QK^T under warpgroup 0's softmax: 32 x 4k x 128 heads 71.2 -> 106.2 us (100.8 with
  columns 384-511 only, 108.9 with 128-511), 128 x 16k x 128 heads 1063 -> 1504-1592;
- in warpgroup 0, the next tile's QK^T issued before this tile's rescale and PV, to run under
  them: 70.6 -> 99.8 us, 1071 -> 1452;
- row sums as a row vector (32 registers fewer) with P as PV's A operand from registers: 71.0 ->
  75.6 us (76.6 without the latter; 78.8 with the query's latent columns 0-127 in registers too);
- the scale folded into each exponent's fused multiply-add (30 fewer instructions a tile per
  thread): 70.6 -> 73.9 us, 1071 -> 1095, 286.5 -> 271.1 at 32 x 16k: noise, no gain.
- FlashMLA's seesaw: each warpgroup the QK^T and softmax of alternate tiles (one per stage) and its
  half of every tile's PV; row maxima, rescale factors and P go over through the stage, and the
  warpgroup that does not own a tile refills its stage. Both warpgroups then hold a [64, 256]
  accumulator beside the scores and the softmax: ptxas spills 432-456 bytes a thread at 255
  registers (mostly in the rare tail-zeroing path; a few loop-invariant scalars reload in the
  loop). 32 x 4k x 128 heads 71.2 -> 122.9 us, 128 x 16k x 128 heads 1076 -> 1740, 128 x 4k x 16
  heads 206.1 -> 286.7 (it passed the kernel's GPU tests). Not profiled; presumably as each
  softmax waits for the other warpgroup's row maxima, the softmaxes stay serial, now with an
  exchange between them, and a stage is refilled only after both PVs of its tile.

Where a one-wave 16-head launch's time goes (H100, graphs; a build that stored each program's
%globaltimer at its start, its query's and first kv tile's arrival, its loop's end and its
exit). 128 x 1k x 16 heads x q_len 4, 128 programs on 128 SMs, 64.4 us a call: the query lands
3.3-5.1 us after the programs start and the first kv tile 4.4-13.8 us (median 8.7: the SMs' first
copies, 28 MB, queue at the DRAM); the loops over equal kv take 43-53 us, as SMs stream at unequal
rates, so programs exit from 51.5 to 62.0 us, and the next launch's programs start 2.4 us after
the last has exited. 32 x 4k x q_len 4 (4 splits): exits at 49.2-56.8 us of a 63.4 us call; the
reduce and the launches take the rest. The 16 heads x q_len 4 rows short of 0.8 of the roofline
(62.8 us) lose it to that spread of exit times and to the query and output bytes the roofline
does not count (18 MB at 128 x 1k: 6 us of copy bandwidth); at q_len 1, 128 x 1k (4.4 MB of them)
exits at 46.6-55.3 us of 59.0. An SM's rate is its own, launch after launch: the per-SM loop times
of six launches in a row correlate at 0.81-0.97, and come in tiers by SM id (the two SMs of a TPC
alike; 128 x 4k x q_len 4: about 174, 183 and 197 us), unrelated to when the first tile landed
(correlation 0.0-0.3). More, shorter programs, for the hardware to hand the faster SMs more of them,
were slower still (each pays its query and pipeline fill; more partials): 128 x 1k x q_len 4 65.6
us at one split, 80.1 at 2, 91.0 at 4; 32 x 4k x q_len 4 66.1 at 4 splits, 75.4 at 8. Evening the
exits out among a request's splits by claiming kv tiles at run time gained nothing (the spread
presumably is the SMs' shares of a saturated DRAM, not idle time): measured and dropped (H200, graphs, one
process, split launches over a 16-bit cache): each program walked the first 1/2, 3/4 or 7/8 of its
even share and then claimed single tiles of the rest by an atomic counter per request and row
block (the last ticket reset it; warpgroup 1 claimed and published each tile's start to warpgroup
0 through a slot per stage). 3/4: 8 x 16k x 16 heads 45.5 -> 45.2 us, x q_len 4 47.6 -> 47.8, 32 x
4k 45.8 -> 45.7, x q_len 4 48.9 -> 49.1, 32 x 16k 154.2 -> 155.2, 1 x 16k 13.3 -> 14.3, 8 x 16k x 128
heads 74.2 -> 75.9; the other fractions within 1% of it, and the same code with no tiles left to
claim 0.5-1.5% slower than this tile. Across requests, each stolen run of tiles would need the other
request's query tile and a partial and merge of its own.

Where a latency-bound split launch's time goes (H200, graphs; a build that stored %globaltimer at
points of every program of this kernel and of the reduce; medians, microseconds from the first
program's start). 1 x 4k x 128 heads (64 splits, 128 programs of one kv tile each), 11.4 us a
call: programs start 0.9 us after the previous call's reduce stored its last row, are past the
dependent-launch wait at 0.4 and have their metadata at 0.6, issue the query and kv copies at 1.1;
the query lands at 1.4, the kv tile at 2.7. Its QK^T, softmax and PV end at 4.7 (2.0 us, of which
its MMAs take 1.2 at the SM's peak rate). Storing the 64 KB of 16-bit partials a program holds
takes until 6.5-7.1 (the last 7.9); the reduce's programs start at 8.9 and have read the partials
at 10.8 (the last 11.1). With 1 x 4k x 16 heads x q_len 4 (64 programs) and 1 x 1k x 128 heads x
q_len 4 (128) too: a warpgroup's half of the 64 KB takes 1.6-2.5 us to store, 0.9-1.0 us pass from
the last store to the reduce's start, and the reduce takes 1.4-1.9 us (the last 1.9-2.3). So at one
or two kv tiles a program, the partials' round trip through L2 and the two launch boundaries cost as
much as the attention; fewer bytes of partials means fewer splits, each program then walking more
tiles, which is the trade-off the split planning (and benchmarks/mla_tuning.py --plan-search) weighs.
An SM's stores are near its own limit there: a plain kernel storing 64 KB of bf16 rows a program
from registers takes 1.1 us to issue them alone, 1.25 (median) with 128 programs at once. Of the
half's store in this kernel, the staging through shared memory takes 0.5-0.6 us and the stores
1.2-1.7. Measured and dropped (H200, graphs, one process): the lse stored ahead of the rows, off
the tail of the store queue (1.4-3.4% slower on 11 of 12 split launches: its layout conversions
then delay the rows); that and the row sums published at the last tile's softmax, so that
warpgroup 1 stores without waiting for warpgroup 0's PV (2-5% slower on 20 of 21 launches, one-split
ones too, presumably from the branch it adds to the kv loop; it also failed a GPU test over an fp8
cache, which went unexamined).
"""

from __future__ import annotations

import torch

from attn.triton_mla_chunks import chunk_bounds, program_work, visible_kv
from attn.triton_mla_tma import flat_rows
from attn.triton_mla_wgmma_fp8 import QUERY_SCALE, query_to_fp16, widen_half

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
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


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this tile can serve a launch: Gluon present, an SM90 device, heads it serves
    (serves_heads), a cache in q's 16-bit dtype or fp8 e4m3 whose pages hold whole kv tiles, and a
    cache and a query that flatten to TMA-addressable [rows, 576] rows (flat_rows)."""
    if gluon is None or not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return (serves_heads(q.shape[1]) and kv_cache.dtype in (q.dtype, torch.float8_e4m3fn)
            and kv_cache.shape[1] % BLOCK_N == 0 and flat_rows(kv_cache) is not None and flat_rows(q) is not None)


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
    MIN_QUERY_BOX // block_h consecutive tokens, which are consecutive rows of the flat query.
    Against the Triton tiles that served 1-4 heads before (H100, graphs, one process): 4 heads x
    q_len 16 1.33-1.67x (8 x 16k 103.5 -> 62.1 us, 128 x 16k 1127 -> 802), x q_len 1 and 4 (tiles
    widened to 64 rows) 1.01-1.12x; 2 heads x q_len 64 1.35-2.29x, 1 head x q_len 64 1.32-1.63x;
    latency-bound launches keep their 16-row tiles."""
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
    touches. fp32 partials fill theirs from the wgmma layout. Storing by TMA instead (staged in the
    descriptor's swizzled layout by stmatrix, a box per query token, the warpgroup waiting only for
    shared memory to be read) was no faster (H100: within 0.3 us on 14 launches, 1 x 1k to 128 x
    1k): a program exits sooner, but the launch still ends only once its stores have landed."""
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
    elements so that a wgmma-layout store of 8 rows hits distinct banks. Measured and dropped (H200,
    graphs, one process): the 128-byte swizzle of a wgmma operand instead, which ptxas stores by
    stmatrix (16 a thread, not 64 4-byte stores): 0.7-1.7% faster on 8 latency-bound split
    launches (0.1-0.2 us), 0.8-1.5% slower on 3 of 4 larger ones (128 x 4k x 16 heads x q_len 4
    158.1 -> 160.5 us). Not tried: the conversion in registers. Triton 3.6 lowers a
    convert_layout from the wgmma layout to 8 dims a thread through shared memory as well, though
    both layouts give each warp the same rows (seen in the sm_90a PTX); by hand it is a transpose
    within each 4-lane quad by shuffles whose sources and targets depend on the lane (~500
    instructions a thread for its half), which could save at most ~0.3 us of the staging's 0.5-0.6."""
    layout: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[_D_HALF, 8]], [_BLOCK_M, _D_HALF], [1, 0])
    return smem._reinterpret(dtype, [_BLOCK_M, _D_HALF], layout)


@_jit
def _softmax_partition(q_nope_smem, q_pe_smem, q_ready, kv_nope_smem, kv_pe_smem, ready, land_nope, land_pe, landed,
                       w0_read, p_ready, a_free, done, row_smem, mask_ptr, b, stride_mb, stride_mq,
                       q_block, h_block, q_start, q_len, kv_len, lo, hi, full_end, num_tiles, mask_len, qk_scale,
                       o_ptr, lse_ptr, split, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, v_scale,
                       NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_Q: gl.constexpr,
                       HAS_MASK: gl.constexpr, DIRECT: gl.constexpr, NUM_STAGES: gl.constexpr,
                       NUM_LOADS: gl.constexpr, KV_FP8: gl.constexpr):
    """Warpgroup 0: per kv tile, QK^T, the masked online softmax, P and its rescale factor into the
    stage, PV for output dims 0-255; then the final row sums and maxima for warpgroup 1.

    ``ready``: a stage holds its tile. KV_FP8: first widen the tile's latent columns 0-255 from its
    fp8 slot (``landed``) into the stage and say so (``w0_read``), while warpgroup 1 widens the
    rest (ready: ``widened``)."""
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
        kv_nope = kv_nope_smem.index(stage)
        kv_pe = kv_pe_smem.index(stage)
        if KV_FP8:
            slot = j % NUM_LOADS
            mbarrier.wait(landed.index(slot), (j // NUM_LOADS) & 1)
            widen_half(land_nope.index(slot), land_pe.index(slot), kv_nope, kv_pe, 0)
            mbarrier.arrive(w0_read.index(slot), count=1)
        mbarrier.wait(ready.index(stage), (j // NUM_STAGES) & 1)
        if start + _BLOCK_N > kv_len:
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
        if start + _BLOCK_N > gl.minimum(hi, full_end):
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
                  PAGE_SIZE: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_Q: gl.constexpr,
                  DIRECT: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_LOADS: gl.constexpr, KV_FP8: gl.constexpr):
    """Warpgroup 1: per kv tile, once P is written, rescale and accumulate PV for output dims
    256-511; with a 16-bit cache then load the tile NUM_STAGES ahead into the stage once warpgroup
    0's PV is off it too (it is otherwise idle, so the copy goes out as early as it can). At the
    end, normalise with warpgroup 0's row sums and store.

    KV_FP8: the copies land in NUM_LOADS fp8 slots (land_nope, land_pe) and the one compute stage
    is 16-bit: first, once warpgroup 0's PV is off the stage (the rope rows hold its P), widen the
    latent columns 256-511 and the rope columns into it (``widened``; warpgroup 0 widens 0-255),
    and refill the slot with the tile NUM_LOADS ahead once warpgroup 0 is off it too (w0_read, one
    barrier a slot: a tile's arrival can then never be taken for the one two tiles later)."""
    _BLOCK_N: gl.constexpr = kv_nope_smem.shape[1]
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, _D_HALF, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([_BLOCK_M, _D_HALF], gl.float32, o_layout)
    for j in range(num_tiles):
        stage = j % NUM_STAGES
        slot = j % NUM_LOADS  # a 16-bit cache's copies land in the stages: the same index
        refill = j + NUM_LOADS < num_tiles
        page = gl.load(bt_row_ptr + (lo + (j + NUM_LOADS) * _BLOCK_N) // PAGE_SIZE, mask=refill, other=0)
        if KV_FP8:
            mbarrier.wait(ready.index(slot), (j // NUM_LOADS) & 1)
            mbarrier.wait(a_free.index(stage), (j - 1) & 1, pred=j > 0)
            widen_half(land_nope.index(slot), land_pe.index(slot), kv_nope_smem.index(stage),
                        kv_pe_smem.index(stage), 1)
            mbarrier.arrive(widened.index(stage), count=1)
            mbarrier.wait(w0_read.index(slot), (j // NUM_LOADS) & 1)
            _load_tile(kv_nope_desc, kv_pe_desc, land_nope, land_pe, ready, slot, page,
                       lo + (j + NUM_LOADS) * _BLOCK_N, refill, PAGE_SIZE)
        mbarrier.wait(p_ready.index(stage), (j // NUM_STAGES) & 1)
        alpha = row_smem.index(stage).load(row_l)
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(kv_pe_smem.index(stage), kv_nope_smem.index(stage).slice(_D_HALF, _D_HALF, dim=1), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        if not KV_FP8:
            mbarrier.wait(a_free.index(stage), (j // NUM_STAGES) & 1, pred=refill)
            _load_tile(kv_nope_desc, kv_pe_desc, land_nope, land_pe, ready, slot, page,
                       lo + (j + NUM_LOADS) * _BLOCK_N, refill, PAGE_SIZE)
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
    PAGE_SIZE: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_Q: gl.constexpr,
    MIN_CHUNK: gl.constexpr, HAS_MASK: gl.constexpr, DIRECT: gl.constexpr, NUM_STAGES: gl.constexpr,
    KV_FP8: gl.constexpr, PDL: gl.constexpr,
):
    """Grid (head blocks x query blocks, splits, batch); see _mla_attention_kernel. Loads the query
    tile and then the first kv tiles, and forks into the two warpgroup roles. PDL: a programmatic
    dependent launch, which sets up its shared memory and barriers, then waits for the kernel
    before it ahead of its first load."""
    gl.static_assert(BLOCK_H * BLOCK_Q == _BLOCK_M)
    BOX_ROWS: gl.constexpr = q_nope_desc.block_type.shape[0]  # query_box_rows(BLOCK_H)
    gl.static_assert(BOX_ROWS % BLOCK_H == 0 and _BLOCK_M % BOX_ROWS == 0)
    gl.static_assert(BOX_ROWS == BLOCK_H or BLOCK_H == NUM_HEADS)  # several tokens' heads: consecutive rows
    _BLOCK_N: gl.constexpr = kv_nope_desc.block_type.shape[0]
    gl.static_assert(_BLOCK_N == _BLOCK_M)  # P [64, BLOCK_N] takes the place of the rope rows [BLOCK_N, 64]
    gl.static_assert(PAGE_SIZE % _BLOCK_N == 0)
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
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(a_free.index(i), count=1)
    mbarrier.init(done, count=1)
    mbarrier.init(q_ready, count=_BLOCK_M // BOX_ROWS)
    fence_async_shared()  # the barriers, before the first TMA
    gl.thread_barrier()
    # Prefetching the four TMA descriptors here (prefetch.tensormap), ahead of the wait, changed
    # nothing (H100: within 0.2 us on 14 latency-bound launches). Nor does the wait hide a prefetch
    # of the first kv tiles and the query tile into L2 (cp.async.bulk.prefetch.L2, addresses from
    # the metadata read ahead of the wait and read again after it): its dependent loads outlast the
    # wait, and every launch ran slower (H200, one process: 1 x 16k x 16 heads 13.4 -> 15.3 us,
    # 1 x 4k x 16 heads x q_len 4 10.5 -> 11.0, 128 x 1k x 16 heads x q_len 4 48.4 -> 50.5), though
    # the first two took 10.8 and 9.3 us over a cache already in L2.
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    split = gl.program_id(1)
    b = gl.program_id(2)
    q_block, h_block, q_start, q_len, kv_len = program_work(gl.program_id(0), b, cu_q_ptr, seq_lens_ptr,
                                                            NUM_HEADS, BLOCK_H)
    lo, hi, full_end = chunk_bounds(kv_len, q_len, q_block, split, num_splits, mask_len,
                                    BLOCK_Q, _BLOCK_N, MIN_CHUNK, HAS_MASK)
    num_tiles = gl.maximum(gl.cdiv(hi - lo, _BLOCK_N), 0)
    # A program of an empty chunk (a split past a short request's length) runs through, storing a
    # zero partial by the staging. Returning here with only its lse written left the reduce's
    # loads of that partial (which do not wait for the lse) to miss L2 (H100, tables 128k tokens
    # wide: 1 x 1k x 128 heads 10.3 -> 11.4 us, 1 x 1k x 16 heads 10.6 -> 11.5, though 1 x 4k x
    # 16 heads x q_len 4 13.6 -> 11.7); with the zeros stored directly before returning, 11.3,
    # 11.0 and 14.0 us.

    bt_row_ptr = bt_ptr + b.to(gl.int64) * stride_bt
    # The query tile goes out before the first kv tiles: an SM's copies land about in the order they
    # were issued, and the first QK^T needs both (H100, a query loaded through registers ahead of
    # the kv copies: 16 heads x q_len 4, 128 x 1k 71.3 -> 68.8 us). As a copy too, the kv copies no
    # longer wait for its round trip (1 x 1k x 128 heads x q_len 4 11.6 -> 11.0 us, 1 x 4k x 128
    # heads 12.6 -> 12.0, 8 x 1k x 128 heads 15.0 -> 14.4; widened tiles, which used to load their
    # query after the kv, within 0.2 us: 1 x 16k x 16 heads 14.4 -> 14.6).
    _load_query(q_nope_desc, q_pe_desc, q_nope_smem, q_pe_smem, q_ready, q_block, h_block, q_start, q_len,
                num_tiles, NUM_HEADS, BLOCK_H, BLOCK_Q)
    for i in gl.static_range(NUM_STAGES):
        page = gl.load(bt_row_ptr + (lo + i * _BLOCK_N) // PAGE_SIZE, mask=i < num_tiles, other=0)
        _load_tile(kv_nope_desc, kv_pe_desc, land_nope, land_pe, ready, i, page, lo + i * _BLOCK_N,
                   i < num_tiles, PAGE_SIZE)
    gl.warp_specialize([
        (_softmax_partition, (q_nope_smem, q_pe_smem, q_ready, kv_nope_smem, kv_pe_smem, widened, land_nope, land_pe,
                              ready, w0_read, p_ready, a_free, done, row_smem, mask_ptr, b, stride_mb, stride_mq,
                              q_block, h_block, q_start, q_len, kv_len, lo, hi, full_end, num_tiles, mask_len,
                              qk_scale, o_ptr, lse_ptr, split, stride_ot, stride_oh, stride_os, stride_lt,
                              stride_lh, v_scale, NUM_HEADS, BLOCK_H, BLOCK_Q, HAS_MASK, DIRECT,
                              STAGES, NUM_STAGES, KV_FP8)),
        (_pv_partition, (kv_nope_desc, kv_pe_desc, land_nope, land_pe, kv_nope_smem, kv_pe_smem, ready, widened,
                         w0_read, p_ready, a_free, done, row_smem, bt_row_ptr, lo, num_tiles, o_ptr, lse_ptr, q_block,
                         h_block, q_start, q_len, split, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                         v_scale, PAGE_SIZE, NUM_HEADS, BLOCK_H, BLOCK_Q, DIRECT, STAGES, NUM_STAGES, KV_FP8)),
    ], [4], [232])
