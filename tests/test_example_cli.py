"""examples/eagle_deepseek.py refuses bad flags as argparse errors: exit 2, a message naming the
flag the user typed (not the SpecConfig field behind it), no traceback, no warning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CASES = [
    (["--temperature", "-1"], "--temperature"),  # SamplingParams' refusal, before the model loads
    (["--topk", "0"], "--topk"),  # SpecConfig's, before the model loads
    (["--backend", "trtllm_mla"], "--backend"),  # the worker's device refusal names attention_backend
    (["--backend", "flashinfer_mla", "--topk", "2", "--num-draft-tokens", "4"], "--backend"),  # no tree masks
    (["--checkpoint", "/nonexistent/checkpoint"], "--checkpoint"),
    (["--batch-size", "1000000"], "--batch-size"),  # its KV caches would need terabytes
]


@pytest.mark.parametrize("flags, flag", CASES, ids=[" ".join(flags) for flags, _ in CASES])
def test_bad_flag_is_a_usage_error_naming_it(flags: list[str], flag: str) -> None:
    run = subprocess.run([sys.executable, "examples/eagle_deepseek.py", "--device", "cpu", *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("eagle_deepseek.py: error: ") and flag in error, run.stderr
    assert "Traceback" not in run.stderr
    # A page size the user never set draws no warning (the Blackwell backends take 32 or 64, not 16).
    assert "Warning" not in run.stderr and "page_size" not in run.stderr, run.stderr
