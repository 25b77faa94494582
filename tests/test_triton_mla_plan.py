"""CPU tests of the Triton MLA kernels' launch planning (attn/kernels/triton_mla/plan.py): tile shapes,
split counts, 16-bit partials, L2 discards and the kv bounds plans change at. The kernels that run
these plans are tested in tests/test_triton_mla_kernel.py."""

import pytest

from attn.kernels.triton_mla.plan import (MAX_SPLITS, PLAN_BOUND_MIN_KV, LaunchPlan, TileShape, discard_line_values,
                                  launch_config, min_split_len, narrow_partials, narrow_plan_limit, num_row_blocks,
                                  plan_bounds, plan_launch, select_config, tile_shape, used_splits)

D, DV = 576, 512


def test_tile_shape_fills_m_with_heads_then_tokens():
    assert tile_shape(16, 1).rows == 16
    assert (tile_shape(16, 4).block_h, tile_shape(16, 4).block_q) == (16, 4)
    assert (tile_shape(128, 4).block_h, tile_shape(128, 4).block_q) == (64, 1)
    assert tile_shape(8, 1).rows == 16  # at least one tensor-core M tile
    assert num_row_blocks(128, 4) == 8
    assert num_row_blocks(16, 300) == 75
    assert all(tile_shape(h, q).rows <= 64 for h in (1, 8, 16, 20, 64, 128) for q in (1, 3, 8, 200))


def test_min_split_len_keeps_partials_no_larger_than_their_kv():
    assert min_split_len(tile_shape(16, 1), narrow=False) == 32
    assert min_split_len(tile_shape(16, 2), narrow=False) == 64
    assert min_split_len(tile_shape(128, 4), narrow=False) == 128
    assert min_split_len(tile_shape(128, 4), narrow=True) == 64  # 16-bit partials: half the bytes
    for heads, q_len in ((16, 1), (16, 4), (128, 1), (8, 3)):
        tile = tile_shape(heads, q_len)
        for narrow, partial_bytes in ((False, 4), (True, 2)):
            assert min_split_len(tile, narrow) % select_config(tile).block_n == 0
            assert tile.rows * DV * partial_bytes <= min_split_len(tile, narrow) * D * 2


def splits(*sizes) -> int:
    return plan_launch(*sizes).num_splits


def test_plan_launch_splits():
    # Batch 1 decode, 16 heads: two programs per SM, up to MAX_SPLITS.
    assert splits(1, 16, 1, 16384, 132) == MAX_SPLITS
    # Short sequences are never split below min_split_len.
    assert splits(1, 16, 1, 1024, 132) == 1024 // 32
    assert splits(1, 16, 1, 100, 132) == 4
    assert splits(1, 16, 1, 0, 132) == 1
    # 64-row tiles fill the shared memory: one program per SM.
    assert splits(1, 128, 1, 16384, 132) == 64  # 66 fill a wave, but 16k fills only 64 of their chunks
    assert splits(8, 128, 4, 16384, 132) == 2  # 128 programs fill one wave; 3 would run 192 in two
    # Enough programs already: no split.
    assert splits(128, 128, 4, 16384, 132) == 1
    assert splits(264, 16, 1, 16384, 132) == 1
    assert splits(64, 16, 1, 16384, 132) == 4  # 256 programs: one wave (5 would run 320 in two)


def test_used_splits_counts_the_chunks_a_sequence_fills():
    """The kernel's chunks are whole kv tiles of at least the shortest chunk: a split count whose
    last chunks would be empty for the longest sequence is cut to the filled ones."""
    assert used_splits(16384, 66, 64, 64) == 64  # chunks of 256 rows (249 rounded up to 4 tiles)
    assert used_splits(16384, 64, 64, 64) == 64
    assert used_splits(1000, 8, 64, 256) == 4  # the shortest chunk (256 rows) binds
    assert used_splits(0, 8, 64, 64) == 1 and used_splits(100, 1, 32, 32) == 1
    for kv_len, num_splits, block_n, min_chunk in ((4097, 33, 64, 64), (1024, 7, 32, 32), (777, 128, 16, 64)):
        used = used_splits(kv_len, num_splits, block_n, min_chunk)
        chunk = max(-(-kv_len // (num_splits * block_n)) * block_n, min_chunk)  # whole tiles, rounded up
        assert used <= num_splits and (used - 1) * chunk < kv_len <= used * chunk  # every used chunk holds rows


def test_plan_launch_halves_the_tile_of_latency_bound_launches():
    def tile(*sizes) -> tuple[int, int]:
        plan = plan_launch(*sizes)
        assert plan.config == select_config(plan.tile) and plan.tile.rows >= 16
        return plan.tile.block_h, plan.tile.block_q

    # 1 x 1k x 128 heads: 2 head blocks x at most 16 splits = 32 programs, under a quarter of 132;
    # at 32 rows 4 x 16 = 64, still under a quarter of 264 two-a-SM slots: halved again.
    assert tile(1, 128, 1, 1024, 132) == (16, 1)
    assert splits(1, 128, 1, 1024, 132) == 1024 // min_split_len(tile_shape(16, 1), narrow=True)
    assert tile(1, 16, 4, 1024, 132) == (16, 1)  # query tokens are halved first: 16x4 -> 16x2 -> 16x1
    assert tile(2, 16, 2, 4096, 132) == (16, 2)  # 2 requests x 64 splits: a quarter of 264 slots
    # Enough programs at the default tile: kept.
    assert tile(1, 128, 1, 16384, 132) == (64, 1)
    assert tile(1, 128, 1, 4096, 132) == (64, 1)  # 2 row blocks x 64 splits of 64 rows: a whole wave
    assert tile(8, 128, 1, 4096, 132) == (64, 1)
    assert tile(8, 16, 4, 4096, 132) == (16, 4)
    assert tile(1, 16, 1, 64, 132) == (16, 1)  # never below 16 rows


def test_plan_launch_widens_narrow_tiles_for_the_wgmma_kernel_unless_latency_bound():
    def tile(*sizes, wide_tiles=True) -> tuple[int, int]:
        plan = plan_launch(*sizes, wide_tiles=wide_tiles)
        assert plan.config == select_config(plan.tile)
        return plan.tile.block_h, plan.tile.block_q

    assert tile(8, 16, 1, 16384, 132) == (16, 4)  # 16 heads x q_len 1: three query slots masked
    assert splits(8, 16, 1, 16384, 132) != plan_launch(8, 16, 1, 16384, 132, wide_tiles=True).num_splits
    assert tile(128, 16, 1, 1024, 132) == (16, 4)
    assert tile(1, 16, 1, 16384, 132) == (16, 4)  # 128 splits of 128 rows: enough programs
    assert tile(32, 16, 2, 4096, 132) == (16, 4)
    assert tile(8, 32, 1, 4096, 132) == (32, 2)
    assert tile(8, 16, 1, 4096, 132) == (16, 4)  # the narrow tile's 33 splits: 128-row chunks
    # Latency-bound (under a quarter wave even at 64 rows): the narrow tile, as without wgmma.
    assert tile(1, 16, 1, 1024, 132) == (16, 1)
    assert tile(1, 16, 1, 4096, 132) == (16, 1)
    assert tile(1, 16, 2, 1024, 132) == tile(1, 16, 2, 1024, 132, wide_tiles=False)
    # The narrow tile's whole wave cuts the kv into chunks shorter than two 64-row tiles: narrow.
    assert tile(8, 16, 1, 1024, 132) == (16, 1)  # 32 splits of 32 rows
    assert tile(4, 16, 2, 4096, 132) == (16, 2)  # 64 splits of 64 rows
    # Without the wgmma kernel, or with 64-row tiles of several row blocks a request: unchanged.
    assert tile(8, 16, 1, 16384, 132, wide_tiles=False) == (16, 1)
    for sizes in ((8, 128, 1, 4096, 132), (1, 128, 1, 1024, 132), (8, 128, 4, 4096, 132)):
        assert plan_launch(*sizes, wide_tiles=True) == plan_launch(*sizes)


def test_split_partials_are_16bit_except_on_widened_wgmma_tiles():
    """16-bit partials on the Triton tiles and on wgmma tiles of only queries; fp32 where a wgmma tile
    is widened with rows of no query (its 16-bit store would go through shared memory for them)."""
    wgmma = launch_config(LaunchPlan(TileShape(64, 1), select_config(TileShape(64, 1)), 2), True)
    assert narrow_partials(wgmma, 128, 1) and narrow_partials(wgmma, 16, 4) and narrow_partials(wgmma, 32, 2)
    assert not narrow_partials(wgmma, 16, 1) and not narrow_partials(wgmma, 16, 2)
    assert narrow_partials(select_config(TileShape(16, 1)), 16, 1)


def test_plan_launch_fills_a_whole_wave_with_16bit_partials_split_down_to_one_kv_tile():
    """Split launches of 64-row tiles of only queries write 16-bit partials: whole waves, even where
    the chunks are short, and chunks as short as one 64-row kv tile (half those of fp32 partials)."""
    for batch, heads, q_len, seq_len, expected in (
            (8, 16, 4, 4096, 16), (32, 16, 4, 1024, 4), (1, 16, 4, 16384, 128), (8, 128, 1, 1024, 8),
            (1, 128, 1, 16384, 64), (8, 128, 1, 4096, 8), (32, 128, 1, 1024, 2)):
        assert plan_launch(batch, heads, q_len, seq_len, 132, wide_tiles=True).num_splits == expected
    # 1 x 1k x 128 heads x q_len 4: 8 row blocks x 16 chunks of 64 rows (fp32 partials stopped at 8 of 128).
    assert plan_launch(1, 128, 4, 1024, 132, wide_tiles=True).num_splits == 16
    # A widened tile (16 heads x q_len 1, 48 rows of no query) keeps fp32 partials and 128-row chunks.
    plan = plan_launch(8, 16, 1, 4096, 132, wide_tiles=True)
    assert plan.tile == TileShape(16, 4) and plan.num_splits == 16 and min_split_len(plan.tile, narrow=False) == 128


def test_plan_launch_discards_the_partials_of_split_launches_of_32k_tokens():
    """Split launches of >= DISCARD_MIN_TOKENS (batch x max_kv_len) have the reduce drop their partials
    from L2; shorter ones (where the discards cost more than the write-back) and one-split ones not."""
    assert plan_launch(8, 16, 4, 4096, 132, wide_tiles=True).discard_partials  # 32k tokens, 16 splits
    assert plan_launch(32, 128, 1, 1024, 132, wide_tiles=True).discard_partials  # 2 splits
    assert not plan_launch(8, 16, 4, 2048, 132, wide_tiles=True).discard_partials  # 16k tokens
    assert not plan_launch(1, 128, 4, 16384, 132, wide_tiles=True).discard_partials
    one_split = plan_launch(128, 16, 4, 1024, 132, wide_tiles=True)
    assert one_split.num_splits == 1 and not one_split.discard_partials


def test_narrow_plan_limit_is_where_plans_turn_to_64_row_tiles():
    """The longest multiple of 64 whose plan has a narrow tile, where the longest context's has the
    64-row tile; none below PLAN_BOUND_MIN_KV, without the wgmma kernel or with a narrow plan at
    the longest context."""
    for sizes, expected in (((1, 16, 1, 131072), 12288), ((1, 16, 4, 4096), 2048), ((2, 16, 4, 4096), 1024),
                            ((1, 128, 1, 131072), 1024)):
        limit = narrow_plan_limit(*sizes, 132, wide_tiles=True)
        assert limit == expected and limit >= PLAN_BOUND_MIN_KV
        assert plan_launch(*sizes[:3], limit, 132, wide_tiles=True).tile.rows < 64
        assert plan_launch(*sizes[:3], limit + 64, 132, wide_tiles=True).tile.rows == 64
    for sizes, wide_tiles in (((4, 16, 4, 4096), True), ((8, 128, 1, 131072), True), ((1, 16, 1, 4096), True),
                              ((1, 16, 1, 131072), False)):
        assert narrow_plan_limit(*sizes, 132, wide_tiles) == 0


def test_plan_bounds_are_where_shorter_contexts_plan_another_tile_or_half_the_splits():
    def plan(sizes, kv_len, wide_tiles=True):
        launch = plan_launch(*sizes[:3], kv_len, 132, wide_tiles)
        return launch.tile, launch.num_splits

    # 1 x 16 heads, tables of 128k rows: 16x1 tiles of 32 and 64 splits, then 128 up to the narrow
    # limit, then 16x4 (wgmma) tiles of 128.
    assert plan_bounds(1, 16, 1, 131072, 132, wide_tiles=True) == (1024, 2048, 12288)
    for sizes, wide_tiles in (((1, 16, 1, 131072), True), ((1, 16, 4, 131072), True), ((1, 128, 1, 131072), True),
                              ((8, 16, 1, 131072), True), ((4, 16, 1, 131072), True), ((1, 16, 1, 131072), False)):
        bounds = plan_bounds(*sizes, 132, wide_tiles)
        assert bounds and list(bounds) == sorted(bounds) and bounds[0] >= PLAN_BOUND_MIN_KV
        for shorter, longer in zip(bounds, (*bounds[1:], sizes[3])):
            (tile, splits), (longer_tile, longer_splits) = plan(sizes, shorter, wide_tiles), plan(sizes, longer, wide_tiles)
            assert tile != longer_tile or 2 * splits <= longer_splits
    # Plans that change little (8 x 16 heads: 32 splits at 2k, 33 at 3k) or not at all: no bound.
    assert plan_bounds(8, 16, 1, 131072, 132, wide_tiles=True) == (narrow_plan_limit(8, 16, 1, 131072, 132, True),)
    assert plan_bounds(8, 128, 4, 131072, 132, wide_tiles=True) == () == plan_bounds(1, 16, 1, 1024, 132, True)


@pytest.mark.parametrize("function", [plan_launch, plan_bounds, narrow_plan_limit])
@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(num_heads=-1), dict(max_q_len=1.5), dict(max_kv_len=-1),
                                 dict(max_kv_len=2048.0), dict(batch_size=True),
                                 dict(num_sms=0)])
def test_planning_rejects_bad_sizes(function, bad):
    """Each function refuses a bad size with a ValueError naming itself, the argument as the caller
    passed it and its value (not a length derived from it, nor an AttributeError for a float)."""
    sizes = dict(batch_size=1, num_heads=16, max_q_len=1, max_kv_len=1024, num_sms=132, wide_tiles=True) | bad
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=f"{function.__name__}: {name} must be .*got {value!r}"):
        function(**sizes)


def test_discards_only_whole_lines_no_other_program_reads():
    """The reduce discards the partials it has read only where each program's row slices are whole
    128-byte lines: 16-bit partials over <= 64 splits (>= 64-value slices) or fp32 ones, in a
    128-byte aligned buffer whose strides keep every row on line boundaries."""
    contiguous = (4 * 16 * 512, 16 * 512, 512)  # [T, H, 16 splits, 512]
    assert discard_line_values(2, 256, 1 << 20, contiguous) == 64
    assert discard_line_values(4, 32, 1 << 20, contiguous) == 32
    assert discard_line_values(2, 32, 1 << 20, contiguous) == 0  # 128 splits: two programs a line
    assert discard_line_values(2, 256, (1 << 20) + 64, contiguous) == 0  # a view off line boundaries
    assert discard_line_values(2, 256, 1 << 20, (4 * 16 * 520, 16 * 520, 520)) == 0  # rows of 520
