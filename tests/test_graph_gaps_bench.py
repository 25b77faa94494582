"""benchmarks/graph_gaps.py on the CPU: a failed variant's report, the flags, the report's files, and
a clear refusal without a GPU (its measurements need one)."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks import graph_gaps


def test_a_failed_variant_reports_its_error_and_yields_no_rows(capsys):
    """A child without a GPU fails (here: no CUDA); its error is printed, not swallowed."""
    if torch.cuda.is_available():
        pytest.skip("the child would succeed on a GPU")
    assert graph_gaps._in_child("plain", 1, 1) == []
    assert "plain failed" in capsys.readouterr().out


def test_flags_are_checked():
    assert graph_gaps.parse_args(["--variants", "plain,free"]).variants == ["plain", "free"]
    with pytest.raises(SystemExit):
        graph_gaps.parse_args(["--variants", "plain,nope"])
    with pytest.raises(SystemExit):
        graph_gaps.parse_args(["--graphs", "0"])


def test_report_writes_the_rows(tmp_path, capsys):
    rows = [{"variant": "plain", "graph": i, "alive": i + 1, "gap_us": 0.4 * (i > 2), "first_gap_us": 0.0,
             "replay_us": 575.0} for i in range(5)]
    graph_gaps.report(rows, tmp_path / "gaps.png")
    with open(tmp_path / "gaps.csv") as f:
        got = list(csv.DictReader(f))
    assert [float(r["gap_us"]) for r in got] == [0.0, 0.0, 0.0, 0.4, 0.4]
    assert "replay_us" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu(capsys):
    assert graph_gaps.main(["--graphs", "1"]) == 1
    assert "needs a GPU" in capsys.readouterr().out
