"""moe_kernels.tiles_for's rule and benchmarks/moe_tiles.py's sweep (CPU: no kernel runs)."""

import subprocess
import sys

import torch

from benchmarks import moe_tiles
from specdec.models.moe_kernels import max_blocks, tiles_for


def test_tiles_follow_rows_per_expert():
    bf16 = torch.bfloat16
    assert tiles_for(8, 256, 7168, 2048, bf16).block_m == 16  # batch 1: a block per chosen expert
    assert tiles_for(2048, 64, 7168, 256, bf16).block_m == 32
    assert tiles_for(65536, 256, 7168, 2048, bf16).block_m == 64
    assert tiles_for(8, 256, 7168, 2048, torch.float32).k1 == tiles_for(8, 256, 7168, 2048, bf16).k1 // 2
    small = tiles_for(4, 8, 64, 32, bf16)  # clamped to the shape
    assert (small.n1, small.k1, small.n2, small.k2) == (16, 64, 64, 32)


def test_decode_tiles_fill_one_wave_or_widen():
    """The rank slice's MoE (E 256, D 7168, I 256, k 8): one token's 8 blocks of 16-wide tiles fill
    128 of 132 SMs, so they stream long K steps; 4 tokens' up to 32 blocks take 32-wide tiles."""
    bf16 = torch.bfloat16
    one, four = tiles_for(8, 256, 7168, 256, bf16), tiles_for(32, 256, 7168, 256, bf16)
    assert (one.n1, one.k1, one.warps1, one.stages1) == (16, 512, 2, 4)
    assert max_blocks(8, 256, 16) * 256 // one.n1 == 128
    assert (four.n1, four.k1, four.warps1, four.stages1) == (32, 128, 4, 4)
    assert (one.n2, one.k2, one.warps2, one.stages2) == (four.n2, four.k2, four.warps2, four.stages2) == (64, 128, 4, 2)
    assert tiles_for(8, 256, 7168, 256, bf16, sms=64).n1 == 32  # 128 programs are two waves of 64 SMs
    assert tiles_for(8, 256, 7168, 2048, bf16).stages2 == 4  # 16 K steps of down: a pipeline


def test_the_sweep_holds_todays_tiles_within_shared_memory():
    """Every token count's tiles are among the sweep's configurations (its report compares them),
    and every configuration's pipelined tiles fit the SMEM bound the sweep states."""
    cfgs = moe_tiles.configs()
    assert len(cfgs) == len(set(cfgs))
    for tokens in (1, 2, 4, 32, 128):
        t = tiles_for(tokens * moe_tiles.K, moe_tiles.E, moe_tiles.D, moe_tiles.I, torch.bfloat16)
        assert ("gu", t.n1, t.k1, t.warps1, t.stages1) in cfgs and ("dn", t.n2, t.k2, t.warps2, t.stages2) in cfgs
    for kind, n, k, _, stages in cfgs:
        weight_rows = 2 * n if kind == "gu" else n
        assert (weight_rows * k + 16 * k) * 2 * stages <= moe_tiles.SMEM


def test_the_sweep_without_cuda_says_so():
    if torch.cuda.is_available():
        return
    run = subprocess.run([sys.executable, "-m", "benchmarks.moe_tiles"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "needs a CUDA device" in run.stderr, run.stderr
