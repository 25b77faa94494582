"""examples/eagle_deepseek.py refuses bad flags as argparse errors: exit 2, a message naming the
flag the user typed (not the SpecConfig field behind it), no traceback, no warning."""

from __future__ import annotations

import os
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


def test_tensor_parallel_example_under_torchrun() -> None:
    """--tp 2 on two gloo ranks: lossless, and only rank 0 prints."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "examples/eagle_deepseek.py", "--tp", "2", "--device", "cpu", "--batch-size", "2",
                          "--max-new-tokens", "12", "--repeats", "1", "--prompt-len", "40"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("tensor parallel over 2 ranks") == 1, run.stdout
    assert "lossless (spec == target-only greedy): 2/2 requests identical" in run.stdout


def test_example_runs_a_v32_checkpoint_losslessly(tmp_path) -> None:
    """--checkpoint of a tiny DeepSeek-V3.2 directory as transformers saves it (plus its MTP layer
    in the release's layout): the V3.2 target and its sparse MTP draft load, and spec decoding on
    torch_ref equals target-only greedy decoding; the prompts (40 bytes) run past index_topk."""
    from test_models import TINY
    from test_models_v32 import V32, save_v32_checkpoint

    save_v32_checkpoint(tmp_path, {**TINY, **V32, "vocab_size": 256, "index_topk": 16})
    run = subprocess.run([sys.executable, "examples/eagle_deepseek.py", "--checkpoint", str(tmp_path), "--device",
                          "cpu", "--batch-size", "2", "--max-new-tokens", "12", "--repeats", "1", "--prompt-len", "40",
                          "--topk", "2", "--num-draft-tokens", "5"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"model: {tmp_path}" in run.stdout
    assert "lossless (spec == target-only greedy): 2/2 requests identical" in run.stdout, run.stdout


def test_tp_outside_torchrun_is_a_usage_error() -> None:
    run = subprocess.run([sys.executable, "examples/eagle_deepseek.py", "--device", "cpu", "--tp", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "WORLD_SIZE"})
    assert run.returncode == 2 and "--tp 2: tensor parallelism over 2 ranks runs under torchrun --nproc-per-node 2" in run.stderr, run.stderr
