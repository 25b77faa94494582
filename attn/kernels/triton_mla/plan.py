"""Launch planning of the Triton MLA kernels (attn/kernels/triton_mla/kernel.py): the tile, kernel config
and split-KV count of a launch from static sizes only (batch, heads, max_q_len, the longest
possible sequence, SM count), so a plan never reads a GPU value and a launch can be captured in a
CUDA graph. Host-side logic: it imports without Triton and is tested on the CPU.
"""

import dataclasses
import math
from dataclasses import dataclass

from attn.kernels.triton_mla import wgmma as wgmma_tile
from attn.values import is_int

MAX_ROWS = 64  # (query tokens x heads) per program: one wgmma-sized M tile
MAX_SPLITS = 128  # bounds the workspace and the reduce
DISCARD_MIN_TOKENS = 32 * 1024  # batch x max_kv_len from which split partials are discarded from L2
# plan_bounds' shortest bound (each bound costs a CUDA graph of the step per batch size)
PLAN_BOUND_MIN_KV = 1024


@dataclass(frozen=True)
class TileShape:
    """Rows of one program: ``block_q`` query tokens x ``block_h`` heads of one request."""

    block_h: int
    block_q: int

    @property
    def rows(self) -> int:
        return self.block_h * self.block_q


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the attention kernel for one tile shape."""

    block_n: int  # kv rows per iteration
    num_warps: int
    num_stages: int
    v_split: int = 1  # programs sharing one tile's 512 output dims (each computes all of QK^T)
    wgmma: bool = False  # 64-row tiles: the Gluon kernel of attn/kernels/triton_mla/wgmma.py (SM90)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tile_shape(num_heads: int, max_q_len: int) -> TileShape:
    """Heads first (they share every query position), then query tokens, up to MAX_ROWS rows.

    At least 16 rows, the smallest M of a tensor-core product; surplus rows are masked.
    """
    block_h = min(next_pow2(num_heads), MAX_ROWS)
    block_q = min(next_pow2(max_q_len), MAX_ROWS // block_h)
    block_q = max(block_q, 16 // block_h)
    return TileShape(block_h=block_h, block_q=block_q)


def num_row_blocks(num_heads: int, max_q_len: int, tile: TileShape | None = None) -> int:
    """Programs per request and split: head blocks x query-token blocks (of the default tile)."""
    tile = tile or tile_shape(num_heads, max_q_len)
    return math.ceil(num_heads / tile.block_h) * math.ceil(max_q_len / tile.block_q)


def queries_fill_tiles(num_heads: int, max_q_len: int) -> bool:
    """Whether a request's 64-row tiles hold only query rows (heads x q_len >= 64), not a narrower
    tile widened with masked rows."""
    return num_heads * max_q_len >= MAX_ROWS


def min_split_len(tile: TileShape, narrow: bool) -> int:
    """Shortest kv chunk worth a split: its partial output (rows x 512 values: 1 KB a row when
    ``narrow``, 16-bit, else 2 KB) stays at or below the chunk's own kv bytes (1152 a row). A
    multiple of the tile's BLOCK_N."""
    return max(select_config(tile).block_n, tile.rows * (1 if narrow else 2))


@dataclass(frozen=True)
class LaunchPlan:
    """Tile, launch parameters and split-KV count of one attention launch.

    discard_partials: the reduce drops the partials from L2 once read (discard.global.L2, where its
    programs read whole 128-byte lines: discard_line_values), so that L2 never writes the dead
    lines back to HBM, where they take the bandwidth of the kv streams that follow. Split launches
    of at least DISCARD_MIN_TOKENS only: in shorter ones the discards cost more than the write-back.
    """

    tile: TileShape
    config: KernelConfig
    num_splits: int
    discard_partials: bool = False


def plan_launch(batch_size: int, num_heads: int, max_q_len: int, max_kv_len: int, num_sms: int,
                wide_tiles: bool = False) -> LaunchPlan:
    """Tile and split-KV count for a launch of ``batch_size`` requests, from static sizes only
    (CUDA-graph safe). max_kv_len: the longest sequence planned for (e.g. block-table width x page
    size); wide_tiles: 64-row tiles run on the Gluon wgmma kernel (launch_config).

    The tile is tile_shape's, widened to 64 rows where wide_tiles make that pay, then halved down
    to 16 rows while even its most splits would give less than a quarter wave of programs. Splits
    fill the SMs in whole waves, each chunk at least min_split_len, at most MAX_SPLITS, cut to the
    chunks max_kv_len fills (used_splits); the kernel cuts each request's own length into that many
    chunks, so short requests leave some empty. Measurements behind each rule: docs/kernels.md.
    """
    _check_sizes("plan_launch", batch_size, num_heads, max_q_len, max_kv_len, num_sms)

    def waves(tile: TileShape) -> tuple[KernelConfig, int, int, int, int]:
        """(config, slots, programs per split, shortest chunk, most splits) of a tile."""
        config = select_config(tile)
        per_split = batch_size * num_row_blocks(num_heads, max_q_len, tile) * config.v_split
        narrow = narrow_partials(launch_config(LaunchPlan(tile, config, 1), wide_tiles), num_heads, max_q_len)
        min_chunk = min_split_len(tile, narrow)
        cap = max(1, min(math.ceil(max_kv_len / min_chunk), MAX_SPLITS))
        return config, programs_per_sm(tile, config) * num_sms, per_split, min_chunk, cap

    tile = tile_shape(num_heads, max_q_len)
    config, slots, per_split, min_chunk, cap = waves(tile)
    # A wgmma tile a quarter full still streams kv faster than the narrow Triton tiles, but starts
    # slower (its query and two kv tiles before the first product): widen unless even the wide
    # tile's most splits give under a quarter wave, or the narrow tile's whole-wave chunks are
    # shorter than two of the wide tile's kv tiles.
    if wide_tiles and tile.rows < MAX_ROWS:
        narrow_chunk = chunk_len(max_kv_len, _whole_wave_splits(slots, per_split, cap), config.block_n, min_chunk)
        wide = TileShape(tile.block_h, MAX_ROWS // tile.block_h)
        wide_waves = waves(wide)
        wide_config, wide_slots, wide_per_split, _, wide_cap = wide_waves
        if 4 * wide_per_split * wide_cap >= wide_slots and narrow_chunk >= 2 * wide_config.block_n:
            tile, (config, slots, per_split, min_chunk, cap) = wide, wide_waves
    # Latency-bound (few requests, short contexts): twice the programs gain more than reading the
    # kv once more per extra row block costs.
    while tile.rows > 16 and 4 * per_split * cap < slots:
        tile = TileShape(tile.block_h, tile.block_q // 2) if tile.block_q > 1 else TileShape(tile.block_h // 2, 1)
        config, slots, per_split, min_chunk, cap = waves(tile)
    # Whole waves: a second, nearly empty wave costs almost as much as the first.
    num_splits = used_splits(max_kv_len, _whole_wave_splits(slots, per_split, cap), config.block_n, min_chunk)
    return LaunchPlan(tile, config, num_splits, num_splits > 1 and batch_size * max_kv_len >= DISCARD_MIN_TOKENS)


def _check_sizes(caller: str, batch_size: int, num_heads: int, max_q_len: int, max_kv_len: int, num_sms: int) -> None:
    """ValueError naming ``caller`` and the argument, for sizes that are not ints in range."""
    for name, value, least in (("batch_size", batch_size, 1), ("num_heads", num_heads, 1), ("max_q_len", max_q_len, 1),
                               ("max_kv_len", max_kv_len, 0), ("num_sms", num_sms, 1)):
        if not is_int(value) or value < least:
            kind = "positive" if least else "non-negative"
            raise ValueError(f"{caller}: {name} must be a {kind} int, got {value!r}")


def narrow_plan_limit(batch_size: int, num_heads: int, max_q_len: int, max_kv_len: int, num_sms: int,
                      wide_tiles: bool) -> int:
    """The longest kv length, a multiple of 64 and at least PLAN_BOUND_MIN_KV, whose plan runs a
    narrow Triton tile (a latency-bound launch) where ``max_kv_len``'s runs the wgmma kernel's
    64-row tile; 0 where there is none. Plans are narrow up to some length and 64-row from it on:
    found by bisection."""
    _check_sizes("narrow_plan_limit", batch_size, num_heads, max_q_len, max_kv_len, num_sms)

    def wide(tiles_of_64: int) -> bool:
        plan = plan_launch(batch_size, num_heads, max_q_len, tiles_of_64 * 64, num_sms, wide_tiles)
        return plan.tile.rows == MAX_ROWS

    narrow, wide_from = 0, max_kv_len // 64  # in 64-row units: wide(narrow) is false, wide(wide_from) true
    if not wide_tiles or wide_from == 0 or not wide(wide_from):
        return 0
    while wide_from - narrow > 1:
        mid = (narrow + wide_from) // 2
        narrow, wide_from = (narrow, mid) if wide(mid) else (mid, wide_from)
    return narrow * 64 if narrow * 64 >= PLAN_BOUND_MIN_KV else 0


def plan_bounds(batch_size: int, num_heads: int, max_q_len: int, max_kv_len: int, num_sms: int,
                wide_tiles: bool) -> tuple[int, ...]:
    """Kv lengths below ``max_kv_len`` (ascending, at least PLAN_BOUND_MIN_KV) up to which
    plan_launch plans another launch than for the next longer one, another tile or at most half its
    splits: of the narrow_plan_limit and the powers of two, those whose plan differs so from the
    next longer bound's.

    A request runs the plan of the bound it is planned for cut to its own length, so a plan for a
    much longer one leaves most of its splits empty, and pays for their programs and the reduce's
    reads of their partials (docs/kernels.md)."""
    _check_sizes("plan_bounds", batch_size, num_heads, max_q_len, max_kv_len, num_sms)

    def plan(kv_len: int) -> tuple:
        launch = plan_launch(batch_size, num_heads, max_q_len, kv_len, num_sms, wide_tiles)
        return launch.tile, launch.num_splits

    candidates = {narrow_plan_limit(batch_size, num_heads, max_q_len, max_kv_len, num_sms, wide_tiles)}
    candidates |= {1 << k for k in range(PLAN_BOUND_MIN_KV.bit_length() - 1, max_kv_len.bit_length())}
    bounds, (tile, splits) = [], plan(max_kv_len)
    for kv_len in sorted((c for c in candidates if PLAN_BOUND_MIN_KV <= c < max_kv_len), reverse=True):
        shorter_tile, shorter_splits = plan(kv_len)
        if shorter_tile != tile or 2 * shorter_splits <= splits:
            bounds.append(kv_len)
            tile, splits = shorter_tile, shorter_splits
    return tuple(reversed(bounds))


def chunk_len(kv_len: int, num_splits: int, block_n: int, min_chunk: int) -> int:
    """Rows of each split's chunk of a sequence of kv_len rows, as the kernel cuts it (chunk_bounds):
    a whole number of block_n tiles, at least min_chunk."""
    return max(math.ceil(math.ceil(kv_len / num_splits) / block_n) * block_n, min_chunk)


def used_splits(kv_len: int, num_splits: int, block_n: int, min_chunk: int) -> int:
    """How many of num_splits chunks (chunk_len) a sequence of kv_len rows fills: the last splits of
    a count that does not divide it evenly stay empty (1 x 16k x 128 heads: 66 splits of 256 rows
    fill 64), and their programs and the reduce's second pass over them are wasted."""
    return max(1, min(num_splits, math.ceil(kv_len / chunk_len(kv_len, num_splits, block_n, min_chunk))))


def _whole_wave_splits(slots: int, per_split: int, cap: int) -> int:
    """Splits (at most cap) whose programs, per_split each, fill ``slots`` in whole waves: a count
    that overflows the slots by a few would run a nearly empty second wave, so of floor and ceil
    of slots / per_split take the one with the least time per unit of work (waves / splits); ties
    go to fewer splits."""
    candidates = sorted({max(1, min(n, cap)) for n in (slots // per_split, math.ceil(slots / per_split))})
    return min(candidates, key=lambda n: (math.ceil(n * per_split / slots) / n, n))


def launch_config(plan: LaunchPlan, wgmma: bool) -> KernelConfig:
    """The plan's config, on the Gluon wgmma kernel where it serves the tile: 64 rows, and
    ``wgmma`` (wgmma_tile.supports: SM90, a cache in q's 16-bit dtype or fp8, pages of
    whole 64-row kv tiles)."""
    if wgmma and plan.tile.rows == wgmma_tile.BLOCK_M:
        return dataclasses.replace(plan.config, wgmma=True)
    return plan.config


def narrow_partials(config: KernelConfig, num_heads: int, max_q_len: int) -> bool:
    """Whether a split launch writes its partial outputs in the query's 16-bit dtype (else fp32).

    A partial is normalised over its own chunk, a convex combination of V rows, so rounding it
    costs about what rounding the output does, and it halves the bytes every program writes and
    the merge reads. Not on a widened wgmma tile (rows of no query): it writes few rows, and its
    16-bit store goes through shared memory for the whole tile, which cost more than it saved
    (docs/kernels.md).
    """
    return not config.wgmma or queries_fill_tiles(num_heads, max_q_len)


def programs_per_sm(tile: TileShape, config: KernelConfig) -> int:
    """Programs resident on one SM: two 16/32-row programs; 64-row programs hold the whole
    query tile ([64, 576] bf16) in shared memory, so two fit only with 16-row kv tiles."""
    return 2 if tile.rows <= 32 or config.block_n <= 16 else 1


def select_config(tile: TileShape) -> KernelConfig:
    """Hopper launch parameters (from benchmarks/mla_tuning.py --sweep on an H100).

    16 rows: mma.sync with 4 warps, 32-row kv tiles, double-buffered. 32 rows: 64-row kv tiles
    and 8 warps. 64 rows: wgmma; the [64, 512] fp32 accumulator needs 8 warps (128 registers a
    thread) and 64-row kv tiles use two ~72 KB shared-memory buffers.

    On SM90 a 64-row tile over a 16-bit or fp8 cache with 64-row-aligned pages runs the Gluon kernel
    instead (launch_config; attn/kernels/triton_mla/wgmma.py), with the same block_n and num_stages.

    v_split=2 (two programs per 64-row tile, each computing all of QK^T for 256 output dims)
    removes the spills but is slower at 128 heads than the duplicated-QK 8-warp tile: off.
    """
    if tile.rows <= 16:
        return KernelConfig(block_n=32, num_warps=4, num_stages=2)
    return KernelConfig(block_n=64, num_warps=8, num_stages=2)


def discard_line_values(part_bytes: int, block_d: int, data_ptr: int, strides: tuple[int, ...]) -> int:
    """Partial values a 128-byte line holds, where the reduce may discard the lines it has read (0
    where not): each program's row slices (``block_d`` values of partials [T, H, S, 512] at
    ``data_ptr`` with these element ``strides``) must be whole lines, which no other program reads.
    16-bit partials of more than 64 splits (32-value slices) are not."""
    line_values = 128 // part_bytes
    whole = block_d % line_values == 0 and data_ptr % 128 == 0
    return line_values if whole and all(stride % line_values == 0 for stride in strides) else 0
