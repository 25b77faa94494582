"""benchmarks/mla_tuning.py's host-side logic (the module needs Triton to import)."""

import pytest

pytest.importorskip("triton")

from attn.kernels.triton_mla.plan import launch_config, plan_launch  # noqa: E402
from benchmarks.mla_tuning import PLAN_SEARCH_SHAPES, alternative_launches  # noqa: E402


@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize("num_sms", [132, 78])
def test_plan_search_spans_the_planned_launches(num_sms: int, wgmma: bool):
    """--plan-search's alternatives hold plan_launch's own tile, kernel and split count on every
    shape it searches (an H100's SM count and a smaller GPU's), so that they span the planner's
    choices: a planned launch slower than the fastest alternative is a better launch the planner
    missed."""
    for batch, seq_len, q_len, heads in PLAN_SEARCH_SHAPES:
        plan = plan_launch(batch, heads, q_len, seq_len, num_sms, wide_tiles=wgmma)
        launches = alternative_launches(heads, seq_len, wgmma, plan.num_splits)
        assert (plan.tile, launch_config(plan, wgmma), plan.num_splits) in launches, (batch, seq_len, q_len, heads)
        assert all(seq_len // splits >= config.block_n and tile.rows in (16, 32, 64)
                   for tile, config, splits in launches)
