"""The routed experts' kernels: the block layout, a grouped GEMM, the combine (the router's are
specdec/models/moe_router.py's).

A token's k routing choices are k pairs; pair ``p = t * k + j`` is token t's j-th choice. The pairs
are sorted by expert (stable) and laid out in blocks of ``block_m`` rows, each block one expert's,
the last block of an expert padded (:func:`sort_into_blocks`). Both paths of ``MoE`` compute over
this layout: the Triton kernels here on a GPU, ``torch.bmm`` in specdec/models/moe.py elsewhere.

After the router's two launches, a decode step's routed experts are four, each one kernel where
torch takes many small ops: :func:`triton_sort_into_blocks` (one program lays out every pair), the
two GEMM kernels of :func:`grouped_experts`, and :func:`triton_combine` (each token's k outputs
summed in order, plus the shared expert's; given the next norm, that too); where the shared
expert's gate/up rides in the router's launch, kernel 2, the shared down GEMV and the combine are
one launch (:func:`decode_tail`). Kernel 1 gathers a block's token rows of x and multiplies them by
its expert's gate and up rows, silu(gate) * up in the epilogue, into ``h`` (a row per block row);
kernel 2 multiplies h by the expert's down projection, scales by the routing weight and writes each
pair's output at row p of ``[P, D]`` fp32, so the sum over a token's k pairs has a fixed order (no
atomics: the same inputs give the same bits). The GEMMs' launch grid is ``(max_blocks, N tiles)``,
a function of host-side sizes only; a program whose block is past those in use returns before
reading any weight, so a decode step reads only the chosen experts' weights. Nothing reads a device
value on the host: the layout and the launches capture in a CUDA graph. Temporaries are O(E)
(counts), ``[rows, I]`` (h) and ``[P, D]``; none is ``[E, T, ...]``.

The module imports without Triton (CPU-only installs): the layout and the tile choice still work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn.base import const_arange
from specdec.models.ops import AddNorm, add_and_norm, dot_precision, norm_weight, pow2, row_launch, silu_times, summed
from specdec.triton_lang import jit as _jit, tl, triton  # without Triton the torch path in moe.py serves


# ------------------------------------------------------------------------------ tiles
@dataclass(frozen=True)
class Tiles:
    """Block sizes and launch options of the two kernels (tiles powers of two, at least 16: tl.dot's
    minimum).

    ``block_m`` rows of pairs per block (the layout's too); kernel 1 tiles I by ``n1`` (a gate and
    an up accumulator each) and D by ``k1``, launched with ``warps1`` / ``stages1``; kernel 2 tiles
    D by ``n2`` and I by ``k2``, launched with ``warps2`` / ``stages2``.
    """

    block_m: int
    n1: int
    k1: int
    n2: int
    k2: int
    warps1: int
    stages1: int
    warps2: int
    stages2: int


def tiles_for(num_pairs: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
              sms: int = 132) -> Tiles:
    """The tiles for P pairs over E experts in ``dtype``, for SM90 (H200, ``sms`` multiprocessors)
    at D = 7168, I = 256..2048.

    ``block_m`` follows the mean rows of a chosen expert, P / min(E, P): 16 at decode (a block per
    chosen expert, mostly padding: the weights dominate the bytes), up to 64 for prefill. At 16 rows
    both kernels are weight-bandwidth bound. Kernel 1: where its blocks in 16-wide N tiles fit one
    wave (one token: 8 blocks x I / 16 = 128 programs at I = 256), those, each streaming 1 KB a
    row a K step with 2 warps; else 32-wide tiles, 256-byte K steps, 4 warps. Kernel 2: 64-wide D
    tiles, 256-byte K steps, its few K steps all in flight (2 stages at I = 256). The choices come
    from a sweep of both kernels at the rank slice's shapes (docs/benchmarks.md). Every choice stays
    under ~200 KB of shared memory (H200: 227 KB a block). Clamped to the shape, so any D and I work
    (masks cover the rest).
    """
    rows = -(-num_pairs // max(1, min(num_experts, num_pairs)))
    block_m = min(64, max(16, pow2(rows)))

    def fit(tile: int, size: int) -> int:
        return max(16, min(tile, pow2(size)))

    if block_m > 16:
        k_step = (256 if block_m < 64 else 128) // dtype.itemsize
        warps = 4 if block_m < 64 else 8
        return Tiles(block_m=block_m, n1=fit(64, inter), k1=fit(k_step, hidden), n2=fit(128, hidden),
                     k2=fit(k_step, inter), warps1=warps, stages1=3, warps2=warps, stages2=3)
    one_wave = max_blocks(num_pairs, num_experts, block_m) * -(-inter // 16) <= sms
    n1, k1_bytes, warps1 = (16, 1024, 2) if one_wave else (32, 256, 4)
    k2 = fit(256 // dtype.itemsize, inter)
    return Tiles(block_m=16, n1=fit(n1, inter), k1=fit(k1_bytes // dtype.itemsize, hidden), n2=fit(64, hidden),
                 k2=k2, warps1=warps1, stages1=4, warps2=4, stages2=2 if -(-inter // k2) <= 2 else 4)


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class ExpertBlocks:
    """P = T * k pairs sorted by expert into ``num_blocks`` blocks of ``block_m`` rows (one
    token's: a block a pair, in pair order, single_token_blocks).

    ``row_pair`` ``[num_blocks * block_m]`` int64: the pair in each row, in expert order (stable:
    by pair within an expert); P in padding rows. ``block_expert`` ``[num_blocks]`` int64: each
    block's expert; ``num_experts`` for the blocks past those in use (always the trailing ones).
    ``pair_row`` ``[P]`` int64: the row of each pair (row_pair's inverse on real rows).
    """

    row_pair: torch.Tensor
    block_expert: torch.Tensor
    pair_row: torch.Tensor
    block_m: int
    num_experts: int
    top_k: int

    @property
    def num_pairs(self) -> int:
        return self.pair_row.numel()

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """A static bound on the blocks in use: an expert with c > 0 pairs takes ceil(c / block_m) <=
    c // block_m + 1 blocks, at most min(E, P) experts have pairs, and every block holds a pair."""
    return min(num_pairs, min(num_experts, num_pairs) + num_pairs // block_m)


def sort_into_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Expert ids ``[T, k]`` (int64, in [0, E)) -> their pairs' block layout, on ids' device.

    Fixed-size tensors throughout (``max_blocks`` blocks, O(E) counts), no host read of a value.
    E.g. E = 3, block_m = 2, ids.flatten() = [2, 0, 2, 2]: sorted experts [0, 2, 2, 2], pairs
    [1, 0, 2, 3]; each expert's first sorted position [0, 1, 1, 4] -> blocks [1, 0, 2], first rows
    [0, 2, 2], rows of the sorted pairs [0, 2, 3, 4]; row_pair [1, 4 | 0, 2 | 3, 4 | 4, 4],
    block_expert [0, 2, 2, 3] (block 3 unused), pair_row [2, 0, 3, 4].
    """
    top_k = ids.shape[-1]
    flat = ids.reshape(-1)
    pairs, device = flat.numel(), flat.device
    expert_of, pair_of = torch.sort(flat, stable=True)  # [P] each
    starts = torch.searchsorted(expert_of, torch.arange(num_experts + 1, device=device))  # [E + 1]
    blocks = (starts.diff() + block_m - 1) // block_m  # [E]
    block_end = blocks.cumsum(0)  # [E]
    shift = (block_end - blocks) * block_m - starts[:-1]  # [E]: an expert's first row less its first position
    row_of = shift[expert_of] + torch.arange(pairs, device=device)  # [P]: the row of each sorted pair
    num_blocks = max_blocks(pairs, num_experts, block_m)
    block_expert = torch.searchsorted(block_end, torch.arange(num_blocks, device=device), right=True)
    row_pair = torch.full((num_blocks * block_m,), pairs, dtype=torch.int64, device=device).scatter_(0, row_of, pair_of)
    pair_row = torch.empty_like(pair_of).scatter_(0, pair_of, row_of)
    return ExpertBlocks(row_pair, block_expert, pair_row, block_m, num_experts, top_k)


_SINGLE_TOKEN: dict[tuple, torch.Tensor] = {}  # row_pair of (k, block_m, device)


def single_token_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """One token's expert ids ``[1, k]`` (int64, in [0, E)) -> a layout with no kernel: block j
    holds pair j alone, of expert ids[0, j] (a view of ids).

    Not in expert order, which no kernel needs: each pair's output is its own row's (a repeated
    expert just has two blocks). row_pair and pair_row are constants of (k, block_m), built once
    per device except under stream capture (pair_row by attn.base.const_arange, row_pair by its
    rule). E.g. k = 2, block_m = 2, ids [[5, 1]]: row_pair [0, 2 | 1, 2], block_expert [5, 1],
    pair_row [0, 2].
    """
    top_k = ids.shape[-1] if ids.dim() else 0
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.dtype != torch.int64 or top_k > max(1, num_experts):
        raise ValueError(f"single_token_blocks: ids {tuple(ids.shape)} {ids.dtype}: expected one token's "
                         f"int64 ids [1, k], k <= {num_experts} experts")
    pair_row = const_arange(top_k * block_m, ids.device, step=block_m)
    key = (top_k, block_m, ids.device)
    row_pair = _SINGLE_TOKEN.get(key)
    if row_pair is None:
        with torch.inference_mode(False):
            row = torch.arange(top_k * block_m, device=ids.device)
            row_pair = torch.where(row % block_m == 0, row // block_m, top_k)
        if not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            _SINGLE_TOKEN[key] = row_pair
    return ExpertBlocks(row_pair, ids.view(-1), pair_row, block_m, num_experts, top_k)


LAYOUT_MAX_PAIRS = 4096  # the most pairs the layout kernel lays out: each program counts them all
LAYOUT_CHUNK = 64  # pairs a program of the layout kernel places


def triton_sort_into_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """sort_into_blocks by one kernel (any device Triton runs on, its interpreter included): the
    same ExpertBlocks, tensor for tensor.

    ids ``[T, k]`` int64 in [0, E), T * k <= LAYOUT_MAX_PAIRS (moe.MoE gives a prefill's pairs to the
    torch ops, whose GEMMs dwarf them). A counting sort in one step: a program a LAYOUT_CHUNK of
    pairs counts every pair's expert (for the blocks) and those of the pairs before its chunk, so
    each pair's row is its expert's first row plus the expert's pairs before it; no program waits
    for another.
    """
    top_k = ids.shape[-1]
    flat = ids.reshape(-1)
    pairs, device = flat.numel(), flat.device
    if flat.dtype != torch.int64:
        raise TypeError(f"expert ids must be int64, not {ids.dtype}")
    if pairs > LAYOUT_MAX_PAIRS:
        raise ValueError(f"the layout kernel lays out at most {LAYOUT_MAX_PAIRS} pairs, not {pairs} "
                         f"({tuple(ids.shape)} ids): lay a prefill's out by sort_into_blocks")
    num_blocks = max_blocks(pairs, num_experts, block_m)
    row_pair = torch.empty(num_blocks * block_m, dtype=torch.int64, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int64, device=device)
    pair_row = torch.empty(pairs, dtype=torch.int64, device=device)
    if pairs:
        _layout_kernel[(triton.cdiv(pairs, LAYOUT_CHUNK),)](
            flat, row_pair, block_expert, pair_row, pairs, num_experts, num_blocks, BLOCK_M=block_m,
            CHUNK=LAYOUT_CHUNK, P_BLOCK=max(32, pow2(pairs)), E_BLOCK=max(32, pow2(num_experts)),
            NB_BLOCK=max(32, pow2(num_blocks)), ROWS_BLOCK=min(1024, max(32, pow2(row_pair.numel()))))
    return ExpertBlocks(row_pair, block_expert, pair_row, block_m, num_experts, top_k)


@_jit
def _layout_kernel(ids_ptr, row_pair_ptr, block_expert_ptr, pair_row_ptr, P, E, NUM_BLOCKS,
                   BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, P_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                   NB_BLOCK: tl.constexpr, ROWS_BLOCK: tl.constexpr):
    """The comments show sort_into_blocks' example: E = 3, block_m = 2, ids [2, 0, 2, 2], a chunk
    of 2 pairs (program 1's values)."""
    c0 = tl.program_id(0) * CHUNK
    every = tl.arange(0, P_BLOCK)
    all_experts = tl.load(ids_ptr + every, mask=every < P, other=0).to(tl.int32)
    counts = tl.histogram(all_experts, E_BLOCK, mask=every < P)  # [1, 0, 3]
    earlier = tl.histogram(all_experts, E_BLOCK, mask=every < c0)  # the pairs before the chunk: [1, 0, 1]
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [1, 0, 2]
    block_end = tl.cumsum(blocks, 0)  # [1, 1, 3]
    first_row = (block_end - blocks) * BLOCK_M  # [0, 2, 2]
    lane = tl.arange(0, CHUNK)
    pair = c0 + lane
    real = pair < P  # the chunk's real lanes lead, so padding lanes precede none of them
    expert = tl.load(ids_ptr + pair, mask=real, other=0).to(tl.int32)  # [2, 2]
    before = (expert[None, :] == expert[:, None]) & (lane[None, :] < lane[:, None])  # [CHUNK, CHUNK]
    pair_rows = tl.gather(first_row + earlier, expert, 0) + tl.sum(before.to(tl.int32), axis=1)  # [3, 4]
    tl.store(row_pair_ptr + pair_rows, pair.to(tl.int64), mask=real)
    tl.store(pair_row_ptr + pair, pair_rows.to(tl.int64), mask=real)
    if tl.program_id(0) != 0:  # program 0 writes the blocks' experts and the padding rows
        return
    end_row = first_row + counts  # past each expert's pairs: [1, 2, 5]
    # A block's expert: how many experts' blocks end at or before it ([0, 2, 2, 3]: block 3 unused).
    experts = tl.arange(0, E_BLOCK)
    block_expert = tl.cumsum(tl.histogram(block_end, NB_BLOCK, mask=(experts < E) & (block_end < NB_BLOCK)), 0)
    block = tl.arange(0, NB_BLOCK)
    tl.store(block_expert_ptr + block, block_expert.to(tl.int64), mask=block < NUM_BLOCKS)
    # Padding rows, past an expert's pairs or in an unused block, hold P: rows no pair's store wrote.
    for r0 in range(0, NUM_BLOCKS * BLOCK_M, ROWS_BLOCK):
        row = r0 + tl.arange(0, ROWS_BLOCK)
        row_expert = tl.gather(block_expert, tl.minimum(row // BLOCK_M, NB_BLOCK - 1), 0)
        end = tl.gather(end_row, tl.minimum(row_expert, E_BLOCK - 1), 0)  # past the expert's pairs: [1, 2, 5]
        pad = (row < NUM_BLOCKS * BLOCK_M) & ((row_expert >= E) | (row >= end))
        tl.store(row_pair_ptr + row, tl.zeros([ROWS_BLOCK], dtype=tl.int64) + P, mask=pad)


# ----------------------------------------------------------------------- grouped GEMM
def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    blocks: ExpertBlocks, tiles: Tiles) -> torch.Tensor:
    """Each pair's weighted expert output, ``[P, D]`` fp32 (row p: pair p), by the two kernels.

    x ``[T, D]``; gate_up ``[E, 2I, D]`` (each expert's gate rows, then its up rows) and down
    ``[E, D, I]`` in x's dtype (bf16, fp16 or fp32), unit stride in their last dim; weights
    ``[T, k]`` fp32; blocks laid out with ``tiles.block_m``. Runs on any device Triton runs on
    (its interpreter included). fp32 products are IEEE (no TF32), as torch's default matmul.
    """
    _check_gate_up(x, gate_up, blocks, tiles)
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    if (down.dtype != x.dtype or tuple(down.shape) != (num_experts, hidden, inter) or down.stride(-1) != 1
            or tuple(weights.shape) != (x.shape[0], blocks.top_k)):
        raise ValueError(f"grouped_experts: down {tuple(down.shape)} {down.dtype}, weights {tuple(weights.shape)} for "
                         f"x {tuple(x.shape)} {x.dtype} and gate_up {tuple(gate_up.shape)}: expected down [E, D, I] "
                         "in x's dtype, unit stride in I, and weights [T, k]")
    pairs = blocks.num_pairs
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    if pairs == 0:
        return out
    h = _gate_up(x, gate_up, blocks, tiles)
    _down_kernel[(blocks.num_blocks, triton.cdiv(hidden, tiles.n2))](
        h, down, out, weights.reshape(-1).float(), blocks.row_pair, blocks.block_expert, pairs, num_experts, hidden,
        inter, h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.n2, BLOCK_K=tiles.k2, PRECISION=dot_precision(x.dtype),
        num_warps=tiles.warps2, num_stages=tiles.stages2)
    return out


def grouped_gate_up(x: torch.Tensor, gate_up: torch.Tensor, blocks: ExpertBlocks, tiles: Tiles) -> torch.Tensor:
    """Kernel 1 of grouped_experts alone: h ``[num_blocks * block_m, I]`` in x's dtype, row r
    silu(gate) * up of the token of its pair through the block's expert (rows of no pair unwritten).
    The shapes as grouped_experts checks them."""
    _check_gate_up(x, gate_up, blocks, tiles)
    return _gate_up(x, gate_up, blocks, tiles)


def _gate_up(x: torch.Tensor, gate_up: torch.Tensor, blocks: ExpertBlocks, tiles: Tiles) -> torch.Tensor:
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    h = x.new_empty(blocks.row_pair.numel(), inter)
    if blocks.num_pairs:
        _gate_up_kernel[(blocks.num_blocks, triton.cdiv(inter, tiles.n1))](
            x, gate_up, h, blocks.row_pair, blocks.block_expert, blocks.num_pairs, num_experts, hidden, inter,
            x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
            TOP_K=blocks.top_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.n1, BLOCK_K=tiles.k1,
            PRECISION=dot_precision(x.dtype), num_warps=tiles.warps1, num_stages=tiles.stages1)
    return h


def _check_gate_up(x: torch.Tensor, gate_up: torch.Tensor, blocks: ExpertBlocks, tiles: Tiles) -> None:
    """Kernel 1's inputs: x ``[T, D]`` and gate_up ``[E, 2I, D]`` of one dtype, unit stride in D,
    blocks of T * k pairs laid out for E experts in blocks of tiles.block_m rows. ValueError else."""
    shape_ok = x.dim() == 2 and gate_up.dim() == 3 and x.shape[1] == gate_up.shape[2] and gate_up.shape[1] % 2 == 0
    if (not shape_ok or gate_up.dtype != x.dtype or x.stride(-1) != 1 or gate_up.stride(-1) != 1
            or blocks.num_experts != gate_up.shape[0] or blocks.num_pairs != x.shape[0] * blocks.top_k
            or blocks.block_m != tiles.block_m):
        raise ValueError(f"grouped experts: x {tuple(x.shape)} {x.dtype}, gate_up {tuple(gate_up.shape)} "
                         f"{gate_up.dtype}, {blocks.num_pairs} pairs of {blocks.top_k} laid out for "
                         f"{blocks.num_experts} experts in blocks of {blocks.block_m} rows, tiles of {tiles.block_m}: "
                         "expected x [T, D] and gate_up [E, 2I, D] of one dtype, unit stride in D, T * k pairs "
                         "laid out for E experts in the tiles' blocks")


TAIL_BLOCK_N = 8  # D columns a decode_tail program writes (896 programs a token at D = 7168: a sweep's best)


def decode_tail(h: torch.Tensor, down: torch.Tensor, blocks: ExpertBlocks, weights: torch.Tensor,
                shared_partials: torch.Tensor, shared_down: torch.Tensor) -> torch.Tensor:
    """A few tokens' MoE output after kernel 1, in one kernel: each token's k pairs' down products,
    each scaled by its routing weight and summed in order in fp32, rounded to h's dtype, plus the
    shared expert's down projection of silu(gate) * up from the gate/up partial sums (each summed in
    order and rounded to h's dtype), rounded again: as triton_combine(grouped_experts(...), the shared
    down GEMV of ops.silu_mul of the summed partials) computes them (each down product reduced in
    another order: the same to fp32 rounding). It replaces those three launches; the combine ran a
    program a token.

    h ``[rows, I]`` (grouped_gate_up's, 16-bit), down ``[E, D, I]``, blocks the pairs' layout (pair
    p's row blocks.pair_row[p], its block's expert), weights ``[T, k]`` fp32, shared_partials
    ``[S, T, 2I_s]`` fp32 (unit stride in 2I_s), shared_down ``[D, I_s]`` -> ``[T, D]`` in h's
    dtype. E.g. the rank slice at one token: h ``[128, 256]``, down ``[64, 7168, 256]``, partials
    ``[14, 1, 512]``, shared_down ``[7168, 256]``: 896 programs of 8 columns."""
    experts, hidden, inter = down.shape
    splits, tokens, shared_two = shared_partials.shape
    if (weights.shape != (tokens, blocks.top_k) or blocks.num_pairs != weights.numel()
            or blocks.num_experts != experts or h.shape != (blocks.row_pair.numel(), inter) or shared_two % 2
            or tuple(shared_down.shape) != (hidden, shared_two // 2)
            or shared_partials.dtype != torch.float32 or weights.dtype != torch.float32
            or h.dtype not in (torch.bfloat16, torch.float16) or down.dtype != h.dtype
            or shared_down.dtype != h.dtype or shared_partials.stride(2) != 1 or h.stride(1) != 1
            or down.stride(2) != 1 or shared_down.stride(1) != 1 or not weights.is_contiguous()):
        raise ValueError(f"decode_tail: h {tuple(h.shape)} {h.dtype}, down {tuple(down.shape)} {down.dtype}, "
                         f"{blocks.num_pairs} pairs of {blocks.top_k} in {blocks.row_pair.numel()} rows for "
                         f"{blocks.num_experts} experts, weights {tuple(weights.shape)} {weights.dtype}, "
                         f"partials {tuple(shared_partials.shape)} {shared_partials.dtype}, shared down "
                         f"{tuple(shared_down.shape)} {shared_down.dtype}: expected 16-bit h [rows, I] (the "
                         "layout's rows), down [E, D, I] (the layout's E), fp32 weights [T, k] and partials "
                         "[S, T, 2I_s], shared down [D, I_s], unit stride in the last dims")
    out = torch.empty(tokens, hidden, dtype=h.dtype, device=h.device)
    if tokens:
        _decode_tail_kernel[(tokens, triton.cdiv(hidden, TAIL_BLOCK_N))](
            h, down, blocks.pair_row, blocks.block_expert, weights, shared_partials, shared_down, out,
            hidden, inter, shared_two // 2, h.stride(0), down.stride(0), down.stride(1), shared_partials.stride(0),
            shared_partials.stride(1), shared_down.stride(0), TOP_K=blocks.top_k, BLOCK_M=blocks.block_m,
            SPLITS=splits, BLOCK_N=TAIL_BLOCK_N, BLOCK_I=min(256, pow2(inter)),
            BLOCK_S=min(256, pow2(shared_two // 2)), num_warps=4)
    return out


@_jit
def _decode_tail_kernel(h_ptr, down_ptr, pair_row_ptr, expert_ptr, weight_ptr, part_ptr, sdown_ptr, out_ptr,
                        D, I, I_S, stride_h, stride_de, stride_dn, stride_part, stride_part_t, stride_sdown,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_I: tl.constexpr, BLOCK_S: tl.constexpr):
    """out[t, n tile] = (sum_j weight_tj * (h_tj @ down_e(tj)[n tile]^T)).to(dtype) + shared[t, n
    tile], token t = program_id(0); the products as fp32 sums of elementwise products over K tiles
    of BLOCK_I (BLOCK_S: the shared expert's). The tokens of a column tile run next to each other,
    so the rows of an expert several tokens chose (and the shared down's) are read once into L2."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = n < D
    dtype = out_ptr.dtype.element_ty
    parts = part_ptr + t * stride_part_t
    shared = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I_S, BLOCK_S):
        rk = k0 + tl.arange(0, BLOCK_S)
        k_in = rk < I_S
        w = tl.load(sdown_ptr + n[:, None] * stride_sdown + rk[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
        gate = summed(parts + rk, stride_part, k_in, SPLITS).to(dtype).to(tl.float32)
        up = summed(parts + I_S + rk, stride_part, k_in, SPLITS).to(dtype).to(tl.float32)
        shared += tl.sum(w.to(tl.float32) * silu_times(gate, up, dtype).to(tl.float32)[None, :], axis=1)
    routed = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pair_row_ptr + t * TOP_K + j)
        rows = down_ptr + tl.load(expert_ptr + row // BLOCK_M).to(tl.int64) * stride_de + n[:, None] * stride_dn
        h_row = h_ptr + row * stride_h
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_I):
            rk = k0 + tl.arange(0, BLOCK_I)
            k_in = rk < I
            w = tl.load(rows + rk[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * tl.load(h_row + rk, mask=k_in, other=0.0).to(tl.float32)[None, :], axis=1)
        routed += acc * tl.load(weight_ptr + t * TOP_K + j)
    out = routed.to(dtype).to(tl.float32) + shared.to(dtype).to(tl.float32)
    tl.store(out_ptr + t * D + n, out.to(dtype), mask=n_in)


@_jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, row_pair_ptr, block_expert_ptr, P, E, D, I,
                    stride_x, stride_we, stride_wn, stride_h,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """h[rows of block b, n tile] = silu(x_tok @ gate_e^T) * (x_tok @ up_e^T), fp32 accumulators."""
    b, n_tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + b)
    if expert >= E:  # a block past those in use: no pairs, and no expert's weights to read
        return
    rows = (b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # h's offsets pass 2^31 in a long prefill
    pair = tl.load(row_pair_ptr + rows)
    real = pair < P
    token = tl.where(real, pair // TOP_K, 0)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_in = offs_n < I
    x_rows = x_ptr + token[:, None] * stride_x + offs_k[None, :]  # [M, K]
    gate = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [K, N]
    up = gate + I * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_in = offs_k < D - k0
        a = tl.load(x_rows + k0, mask=real[:, None] & k_in[None, :], other=0.0)
        w_mask = k_in[:, None] & n_in[None, :]
        acc_gate = tl.dot(a, tl.load(gate + k0, mask=w_mask, other=0.0), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, tl.load(up + k0, mask=w_mask, other=0.0), acc_up, input_precision=PRECISION)
    out = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(h_ptr + rows[:, None] * stride_h + offs_n[None, :], out.to(h_ptr.dtype.element_ty),
             mask=real[:, None] & n_in[None, :])


@_jit
def _down_kernel(h_ptr, w_ptr, out_ptr, weight_ptr, row_pair_ptr, block_expert_ptr, P, E, D, I,
                 stride_h, stride_we, stride_wn, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """out[pair of each row of block b, n tile] = weight_pair * (h_row @ down_e^T), in fp32."""
    b, n_tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + b)
    if expert >= E:
        return
    rows = (b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # h's offsets pass 2^31 in a long prefill
    pair = tl.load(row_pair_ptr + rows)
    real = pair < P
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_in = offs_n < D
    h_rows = h_ptr + rows[:, None] * stride_h + offs_k[None, :]  # [M, K]
    w = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_in = offs_k < I - k0
        a = tl.load(h_rows + k0, mask=real[:, None] & k_in[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w + k0, mask=k_in[:, None] & n_in[None, :], other=0.0), acc, input_precision=PRECISION)
    acc = acc * tl.load(weight_ptr + pair, mask=real, other=0.0)[:, None]
    tl.store(out_ptr + pair[:, None] * stride_out + offs_n[None, :], acc, mask=real[:, None] & n_in[None, :])


# ---------------------------------------------------------------------------- combine
def triton_combine(per_pair: torch.Tensor, shared: torch.Tensor, then: Optional[AddNorm] = None):
    """Each token's routed output plus the shared expert's, by one kernel (any device Triton runs
    on, its interpreter included).

    per_pair ``[T, k, D]`` fp32 (grouped_experts' output viewed per token), shared ``[T, D]`` in the
    model's dtype, both of unit stride in D -> ``[T, D]`` in shared's dtype: the k rows summed in
    order in fp32 (the same bits for the same inputs), rounded to the dtype, then plus shared and
    rounded again, as torch's ``routed.to(dtype) + shared``. Given ``then`` (its residual and
    weight of unit stride and shared's dtype, or None residual), ``then(out)`` in the same launch,
    a program a token with rms_norm's tile and warps: the bits of ops.rms_norm's kernel on out.
    """
    tokens, top_k, hidden = per_pair.shape
    if (per_pair.dtype != torch.float32 or tuple(shared.shape) != (tokens, hidden) or per_pair.stride(2) != 1
            or shared.stride(1) != 1):
        raise ValueError(f"per_pair {tuple(per_pair.shape)} {per_pair.dtype}, shared {tuple(shared.shape)}: "
                         "expected fp32 [T, k, D] and [T, D], unit stride in D")
    residual = None if then is None else then.residual
    if then is not None and not then.kernel_takes(shared):
        raise ValueError(f"combine's norm: weight {tuple(then.weight.shape)} {then.weight.dtype}, residual "
                         f"{None if residual is None else (tuple(residual.shape), residual.dtype)}: "
                         f"expected [{hidden}] and [{tokens}, {hidden}] of unit stride, {shared.dtype}")
    out = torch.empty(tokens, hidden, dtype=shared.dtype, device=shared.device)  # then: h (the sum) or out
    normed = out if then is None else torch.empty_like(out)
    if tokens:
        launch = {"BLOCK": min(1024, pow2(hidden))} if then is None else row_launch(hidden)
        _combine_kernel[(tokens, triton.cdiv(hidden, launch["BLOCK"]))](
            per_pair, shared, out, residual if residual is not None else out, then.weight if then else out, normed,
            0.0 if then is None else then.eps, hidden, per_pair.stride(0), per_pair.stride(1), shared.stride(0),
            0 if residual is None else residual.stride(0), TOP_K=top_k, NORM=then is not None,
            HAS_RESIDUAL=residual is not None, **launch)
    return out if then is None else (normed, out)


@_jit
def _combine_kernel(pair_ptr, shared_ptr, out_ptr, res_ptr, w_ptr, normed_ptr, eps, D, stride_token,
                    stride_choice, stride_shared, stride_res, TOP_K: tl.constexpr, NORM: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """NORM: one program a token (BLOCK >= D); then h = out + residual (rounded) at out_ptr and
    normed = rms_norm(h) * weight, as ops' rms_norm kernel computes them."""
    t, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    if NORM:
        w = norm_weight(w_ptr + cols, mask)
    routed = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        routed += tl.load(pair_ptr + t * stride_token + j * stride_choice + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    shared = tl.load(shared_ptr + t * stride_shared + cols, mask=mask, other=0.0).to(tl.float32)
    out = (routed.to(dtype).to(tl.float32) + shared).to(dtype)
    if NORM:
        add_and_norm(out, res_ptr + t * stride_res + cols, out_ptr + t * D + cols, normed_ptr + t * D + cols, w, mask,
                     D, eps, HAS_RESIDUAL, True)
    else:
        tl.store(out_ptr + t * D + cols, out, mask=mask)
