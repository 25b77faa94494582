"""benchmarks/mla_kernels.py's verdicts against the issue's targets (host-side, on the CPU)."""

import math

from benchmarks.mla_kernels import output_check, targets


def verdict(fa3: float, flashmla: float) -> str:
    return targets(dict(speedup_vs_fa3=fa3, speedup_vs_flashmla=flashmla))


def test_the_issue_targets_apply_where_the_issue_says():
    # at least each rival's speed, on every row where it ran
    assert verdict(1.0, 1.0) == "fa3:yes flashmla:yes"
    assert verdict(2.5, 0.99) == "fa3:yes flashmla:no"
    assert verdict(0.97, 1.3) == "fa3:no flashmla:yes"
    assert verdict(math.nan, 1.1) == "flashmla:yes"  # no FA3 on the row: no target against it
    assert verdict(math.nan, math.nan) == "-"


def test_the_output_check_catches_a_nan_in_any_request():
    nan = math.nan
    assert output_check(0.003, 0.003, 0.01, True) == "ok"
    assert output_check(0.003, 0.003, nan, True) == "BAD"  # a NaN past the first request is caught too
    assert output_check(0.003, 0.003, 0.02, True) == "BAD"  # twice 2**-7 is 0.0156
    assert output_check(nan, 0.003, 0.01, True) == "BAD"
    assert output_check(0.003, nan, nan, False) == "ok"  # no FA3: the first request's error alone
    assert output_check(0.01, 0.006, 0.01, True) == "ok"  # FA3's own error widens the bound, to 2**-6 at most
