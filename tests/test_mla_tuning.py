"""benchmarks/mla_tuning.py's host-side logic (the module needs Triton to import)."""

import itertools

import pytest

pytest.importorskip("triton")

from attn.triton_mla_plan import launch_config, plan_launch  # noqa: E402
from benchmarks.mla_kernels import TABLE_HEADS, TABLE_Q_LENS  # noqa: E402
from benchmarks.mla_tuning import alternative_launches  # noqa: E402

LATENCY_BOUND = [shape for shape in itertools.product([1, 8, 32], [1024, 4096, 16384], TABLE_Q_LENS, TABLE_HEADS)
                 if shape[0] * shape[1] < 128 * 1024]


@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize("num_sms", [132, 78])
def test_plan_search_spans_the_planned_launches(num_sms: int, wgmma: bool):
    """--plan-search's alternatives hold plan_launch's own tile, kernel and split count on every
    shape it searches (an H100's SM count and a smaller GPU's), so that they span the planner's
    choices: a planned launch slower than the fastest alternative is a better launch the planner
    missed."""
    for batch, seq_len, q_len, heads in LATENCY_BOUND:
        plan = plan_launch(batch, heads, q_len, seq_len, num_sms, wide_tiles=wgmma)
        launches = alternative_launches(heads, seq_len, wgmma, plan.num_splits)
        assert (plan.tile, launch_config(plan, wgmma), plan.num_splits) in launches, (batch, seq_len, q_len, heads)
        assert all(seq_len // splits >= config.block_n and tile.rows in (16, 32, 64)
                   for tile, config, splits in launches)
