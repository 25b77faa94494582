"""benchmarks/step_profile.py on the CPU: a step's summary from its kernels, the flags, the report's
files, and a clear refusal without a GPU (its profiles need one)."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks import step_profile


def test_step_summary_counts_spans_and_gaps():
    got = step_profile.step_summary([("b", 10.5, 12.0), ("a", 0.0, 10.0), ("a", 12.1, 20.0)])
    assert got["kernels"] == 3 and got["span_us"] == 20.0
    assert got["busy_us"] == pytest.approx(19.4) and got["gap_us"] == pytest.approx(0.3)
    assert list(got["names"]) == ["a", "b"]  # the most time first
    assert got["names"]["a"] == (2, pytest.approx(17.9)) and got["names"]["b"] == (1, pytest.approx(1.5))
    assert step_profile.step_summary([])["kernels"] == 0


def test_last_replay_takes_the_final_share_of_the_spans():
    spans = [("k", float(i), i + 0.5) for i in range(9)]  # 3 replays of 3 kernels
    assert step_profile.last_replay(spans, 3) == spans[6:]
    assert step_profile.last_replay(spans[:2], 3) == []  # fewer spans than replays: none to trust


def test_flags_are_checked():
    assert step_profile.parse_args(["--model", "dense", "--layers", "4"]).layers == 4
    for bad in (["--model", "large"], ["--batch", "0"]):
        with pytest.raises(SystemExit):
            step_profile.parse_args(bad)


def test_report_writes_each_kinds_kernels(tmp_path, capsys):
    kernels = [("gemv", 0.0, 10.0), ("norm", 10.4, 12.0)]
    results = {kind: step_profile.step_summary(kernels) for kind in ("target", "spec")}
    step_profile.report(results, tmp_path / "profile.png", "test")
    with open(tmp_path / "profile.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["kind"], r["kernel"], r["count"]) for r in rows] == [
        ("target", "gemv", "1"), ("target", "norm", "1"), ("spec", "gemv", "1"), ("spec", "norm", "1")]
    assert "median gap 0.40 us" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu(capsys):
    assert step_profile.main([]) == 1
    assert "needs a GPU" in capsys.readouterr().out
