"""benchmarks/mla_kernels.py's verdicts against the issue's targets (host-side, on the CPU)."""

import math

from benchmarks.mla_kernels import output_check, targets


def verdict(fa3_frac: float, q_len: int, speedup: float, frac_roofline: float, tokens: int, memory_bound: bool) -> str:
    row = dict(fa3_frac=fa3_frac, q_len=q_len, speedup_vs_fa3=speedup, frac_roofline=frac_roofline)
    return targets(row, tokens, memory_bound)


def test_the_issue_targets_apply_where_the_issue_says():
    # 2x where FA3 is below 0.4 of the roofline, at q_len 1 and 4 only (q_len 16 rows get 0.9x)
    assert verdict(0.399, 1, 2.0, 0.5, 1024, True) == "2x:yes"
    assert verdict(0.399, 4, 1.99, 0.5, 1024, True) == "2x:no"
    assert verdict(0.399, 16, 1.0, 0.5, 1024, True) == "0.9x:yes"
    assert verdict(0.4, 1, 0.9, 0.5, 1024, True) == "0.9x:yes"  # 0.4 itself is not below it
    assert verdict(0.9, 1, 0.89, 0.5, 1024, True) == "0.9x:no"
    # 0.8 of the roofline from 128k tokens (8 x 16k counts), memory-bound rows only
    assert verdict(0.9, 1, 1.0, 0.8, 8 * 16384, True) == "0.9x:yes 0.8roof:yes"
    assert verdict(0.9, 1, 1.0, 0.79, 128 * 1024 - 1, True) == "0.9x:yes"
    assert verdict(0.9, 1, 1.0, 0.5, 1 << 20, False) == "0.9x:yes"
    # no FA3: no ratio target
    assert verdict(math.nan, 1, math.nan, 0.9, 1 << 20, True) == "0.8roof:yes"


def test_the_output_check_catches_a_nan_in_any_request():
    nan = math.nan
    assert output_check(0.003, 0.003, 0.01, True) == "ok"
    assert output_check(0.003, 0.003, nan, True) == "BAD"  # a NaN past the first request is caught too
    assert output_check(0.003, 0.003, 0.02, True) == "BAD"  # twice 2**-7 is 0.0156
    assert output_check(nan, 0.003, 0.01, True) == "BAD"
    assert output_check(0.003, nan, nan, False) == "ok"  # no FA3: the first request's error alone
    assert output_check(0.01, 0.006, 0.01, True) == "ok"  # FA3's own error widens the bound, to 2**-6 at most
