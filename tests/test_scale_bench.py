"""benchmarks/scale.py on the CPU: the floor's byte accounting against hand arithmetic and the built
models' own parameters, the taps, and a --smoke run's CSV (every path but the CUDA timing)."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import rank_slice, scale, scale_report
from benchmarks.rank_slice import (
    Pass, floor_us, mtp_pass_bytes, mtp_params, rank_slice_config, step_floor_bytes, target_params, target_pass_bytes,
)
from benchmarks.scale_probes import RouterTap, StepClock, count_trace_events, expert_ids
from benchmarks.scale_report import COLUMNS

REPO = Path(__file__).resolve().parent.parent
D, V = 7168, 16160  # the rank slice's hidden size and vocabulary
ATTENTION = D * 1536 + 1536 + 1536 * 16 * (128 + 64) + D * (512 + 64) + 512 + 512 * 16 * (128 + 128) + 16 * 128 * D
DENSE_LAYER = ATTENTION + 2 * D + 3 * D * 2304
EXPERT = 3 * D * 256
MOE_LAYER = ATTENTION + 2 * D + 64 * D + EXPERT + 64 * EXPERT  # router, shared expert, 64 routed
MTP_OWN = 3 * D + 2 * D * D  # enorm, hnorm, shared_head.norm, eh_proj


def test_the_rank_slice_holds_deepseek_v3s_parameters_over_eight():
    dense, moe = rank_slice_config("dense"), rank_slice_config("moe")
    assert target_params(dense) == 61 * DENSE_LAYER + 2 * V * D + D
    assert target_params(moe) == 3 * DENSE_LAYER + 58 * MOE_LAYER + 2 * V * D + D
    assert 46e9 < 2 * target_params(moe) < 47.5e9  # the brief's "about 46 GB"
    assert mtp_params(dense) == MTP_OWN + DENSE_LAYER
    assert mtp_params(moe) == MTP_OWN + MOE_LAYER  # the MTP layer is layer 61: MoE


def test_a_decode_pass_reads_its_weights_chosen_experts_and_kv():
    moe = rank_slice_config("moe")
    chosen = [8] * 58
    kv_rows = 4 * 1025  # 4 requests at N = 1024, each reading its prefix and its new row
    want = 2 * (4 * D + 3 * DENSE_LAYER + 58 * (MOE_LAYER - 56 * EXPERT) + D + V * D)
    want += 58 * 4 * 64 + kv_rows * 576 * 2 * 61  # the routers' fp32 bias; 576-wide bf16 KV rows in 61 layers
    assert target_pass_bytes(moe, 4, chosen, kv_rows) == want
    with pytest.raises(ValueError):
        target_pass_bytes(moe, 4, chosen[:-1], kv_rows)
    # The MTP pass: its own weights with 5 experts, the shared head, 2 embedding rows, one KV layer.
    want = 2 * (2 * D + MTP_OWN + MOE_LAYER - 59 * EXPERT + V * D) + 4 * 64 + 2050 * 576 * 2
    assert mtp_pass_bytes(moe, 2, 5, 2050) == want


def test_a_steps_floor_sums_its_passes_at_the_batchs_kv_length():
    moe = rank_slice_config("moe")
    passes = [Pass("target", 32, [20] * 58), Pass("mtp", 8, [12]), Pass("mtp", 8, [11]), Pass("mtp", 16, [14])]
    got = step_floor_bytes(moe, passes, batch=8, kv_len=1030.5)  # 8244 prefix rows, and each pass's own
    want = target_pass_bytes(moe, 32, [20] * 58, 8244 + 32) + mtp_pass_bytes(moe, 8, 12, 8244 + 8)
    want += mtp_pass_bytes(moe, 8, 11, 8244 + 8) + mtp_pass_bytes(moe, 16, 14, 8244 + 16)
    assert got == want
    assert floor_us(4.2e9, 4.2e12) == pytest.approx(1000.0)
    with pytest.raises(ValueError):
        step_floor_bytes(moe, [Pass("draft", 8)], 1, 10)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_the_floor_counts_what_the_built_smoke_model_holds(variant):
    """Independent of the config arithmetic: the built model's parameters, less the embedding rows
    a pass does not read and the experts it did not choose."""
    cfg = rank_slice_config(variant, layers=4, smoke=True)
    target, draft = rank_slice.build_models(cfg, torch.float32, "cpu")
    assert rank_slice.check_param_counts(target, draft) is None
    all_bytes = sum(p.numel() * 4 for p in target.parameters())
    d, e = cfg.hidden_size, 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    moe_layers = [i for i in range(4) if cfg.is_moe_layer(i)]
    chosen = [2, 3, 4][:len(moe_layers)]
    bias = 4 * cfg.n_routed_experts if cfg.has_moe else 0
    skipped = sum((cfg.n_routed_experts - c) * e for c in chosen)
    want = all_bytes - (cfg.vocab_size - 3) * d * 4 - skipped + len(moe_layers) * bias + 100 * 576 * 4 * 4
    assert target_pass_bytes(cfg, 3, chosen, 100, weight_bytes=4, kv_bytes=4) == want
    own = sum(p.numel() * 4 for p in rank_slice.own_parameters(draft, target))
    mtp_moe = cfg.is_moe_layer(4)
    unchosen = (cfg.n_routed_experts - 1) * e if mtp_moe else 0
    want = own - unchosen + (bias if mtp_moe else 0) + (cfg.vocab_size + 3) * d * 4 + 50 * 576 * 4
    assert mtp_pass_bytes(cfg, 3, 1 if mtp_moe else None, 50, weight_bytes=4, kv_bytes=4) == want


class _Gate(nn.Module):
    def forward(self, x):
        ids = (x[:, :2].abs() * 7).long() % 8
        return torch.ones(ids.shape), ids


class _Block(nn.Module):
    def __init__(self, as_module: bool):
        super().__init__()
        self.gate, self.as_module = _Gate(), as_module

    def forward(self, x):
        self.gate(x) if self.as_module else self.gate.forward(x)  # the latter: a fused path, no hooks
        return x


def test_the_router_tap_counts_distinct_experts_called_or_fused():
    x = torch.tensor([[0.1, 0.2], [0.1, 0.3], [0.5, 0.2]])  # ids [0 1], [0 2], [3 1]: 4 distinct
    y = x[:1]
    for as_module in (True, False):
        block = _Block(as_module)
        with RouterTap([block]) as tap:
            block(x)
            block(y)
        assert tap.distinct() == [[4, 2]]
        block(x)  # off: not recorded
        assert len(tap.calls[0]) == 2
    assert expert_ids((torch.ones(2), torch.tensor([3, 1]))).tolist() == [3, 1]
    assert expert_ids(torch.tensor([[1, 2]])).tolist() == [[1, 2]]
    assert expert_ids((torch.ones(2), torch.tensor([True]))) is None


def test_trace_counts_and_the_cpu_clock():
    events = [{"cat": "kernel"}, {"cat": "Kernel"}, {"cat": "cuda_runtime"}, {"cat": "cpu_op"}, {}]
    assert count_trace_events(events, "kernel") == 2
    calls = []
    times = StepClock(cuda=False).times_us(lambda: calls.append("launch") or len(calls), calls.append, 3, 2)
    assert len(times) == 3 and calls == ["launch", 1, "launch", 3, "launch", 5, "launch", 7, "launch", 9]


def test_csv_rows_merge_by_configuration(tmp_path):
    path = tmp_path / "scale.csv"
    rows = [dict(variant="moe", backend="b", batch=1, topk=1, target_us=1.5), dict(variant="moe", backend="b", batch=8,
                                                                                topk=1, target_us=2.0)]
    scale_report.write_csv(rows, path)
    args = scale.parse_args(["--smoke", "--csv", str(path), "--append"])
    run = scale.Run(args)
    assert [(r["batch"], r["target_us"], r["spec_us"]) for r in run.rows] == [(1, 1.5, ""), (8, 2.0, "")]
    run.emit(dict(rows[0], target_us=3.0, spec_us=6.0, target_floor_frac=0.5, spec_floor_frac=0.25,
                  kernels_per_layer=7, spec_over_target=2.0, num_draft_tokens=4, target_floor_us=1, spec_floor_us=1,
                  **{f"speedup_L{L}": 1.0 for L in scale.PROJECTED_L}, verify_experts=math.nan))
    merged = scale_report.read_csv(path)
    assert [(r["batch"], r["target_us"]) for r in merged] == [(8, 2.0), (1, 3.0)]
    assert merged[0]["spec_us"] == ""  # a column the old row lacks
    other = tmp_path / "other.csv"
    scale_report.write_csv([dict(rows[1], target_us=5.0)], other)
    out = tmp_path / "merged.csv"
    assert scale.main(["--merge", str(path), str(other), "--csv", str(out), "--png", str(tmp_path / "m.png")]) == 0
    assert [(r["batch"], r["target_us"]) for r in scale_report.read_csv(out)] == [(1, 3.0), (8, 5.0)]


def test_smoke_run_writes_every_configuration(tmp_path):
    """The CPU smoke run: both variants, two batches, a chain and a tree, eager steps; the
    CSV's arithmetic and the floors of the dense rows recomputed here."""
    path = tmp_path / "scale.csv"
    assert scale.main(["--smoke", "--csv", str(path), "--png", str(tmp_path / "scale.png")]) == 0
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:len(COLUMNS)] == COLUMNS
    assert sorted((r["variant"], int(r["batch"]), int(r["topk"])) for r in rows) == sorted(
        (v, b, k) for v in ("dense", "moe") for b in (1, 2) for k in (1, 4))
    for r in rows:
        num = {k: float(v) for k, v in r.items() if k not in ("variant", "backend", "timing", "experts_measured")}
        assert r["experts_measured"] == "True" and r["timing"] == "cpu_eager_smoke"
        assert num["spec_over_target"] == pytest.approx(num["spec_us"] / num["target_us"])
        for L in scale.PROJECTED_L:
            assert num[f"speedup_L{L}"] == pytest.approx(L * num["target_us"] / num["spec_us"])
        for kind in ("target", "spec"):
            assert num[f"{kind}_floor_frac"] == pytest.approx(num[f"{kind}_floor_us"] / num[f"{kind}_us"])
            assert num[f"{kind}_floor_us"] == pytest.approx(num[f"{kind}_floor_gb"] / num["bandwidth_gbs"] * 1e6)
        b, ndt, steps = int(num["batch"]), int(num["num_draft_tokens"]), int(num["num_steps"])
        assert (num["verify_tokens"], num["draft_passes"]) == (b * ndt, steps)
        assert num["kernels_per_layer"] > 0 and num["kernels_dense"] > 0
        cfg = rank_slice_config(r["variant"], layers=4, smoke=True)
        if r["variant"] == "moe":
            assert num["kernels_per_layer"] == num["kernels_moe"]
            assert 1 <= num["verify_experts"] <= cfg.n_routed_experts
            continue
        # dense: every weight read, vocab - T embedding rows not; fp32 weights and KV
        weights = target_params(cfg) * 4
        kv_rows = round(b * num["target_kv_len"]) + b
        want = weights - (cfg.vocab_size - b) * cfg.hidden_size * 4 + kv_rows * 576 * 4 * 4
        assert num["target_floor_gb"] * 1e9 == pytest.approx(want)
        n = round(b * num["spec_kv_len"])
        verify = weights - (cfg.vocab_size - b * ndt) * cfg.hidden_size * 4 + (n + b * ndt) * 576 * 4 * 4
        drafts = steps * (mtp_params(cfg) + cfg.vocab_size * cfg.hidden_size) * 4
        drafts += num["draft_tokens"] * cfg.hidden_size * 4 + (steps * n + num["draft_tokens"]) * 576 * 4
        assert num["spec_floor_gb"] * 1e9 == pytest.approx(verify + drafts)
    assert (tmp_path / "scale.png").exists() or not _has_matplotlib()


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_a_ranks_config_holds_its_share():
    cfg = rank_slice_config("moe")
    half = rank_slice.rank_config(cfg, 2)
    assert (half.num_attention_heads, half.intermediate_size, half.moe_intermediate_size, half.vocab_size) == \
        (8, 1152, 128, 8080)
    assert (half.q_lora_rank, half.kv_lora_rank, half.n_routed_experts) == (1536, 512, 64)  # whole on every rank
    assert target_params(cfg) / 2 < target_params(half) < target_params(cfg)
    assert rank_slice.rank_config(cfg, 1) is cfg


def _smoke(tmp_path, name: str, tp: int) -> tuple[subprocess.CompletedProcess, list[dict]]:
    path = tmp_path / f"{name}.csv"
    args = ["-m", "benchmarks.scale", "--smoke", "--variants", "moe", "--backends", "torch_ref", "--batches", "2",
            "--topks", "1", "--iters", "1", "--warmup", "0", "--csv", str(path), "--tp", str(tp)]
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(tp)] if tp > 1 else []
    run = subprocess.run([sys.executable, *launcher, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    return run, (scale_report.read_csv(path) if path.exists() else [])


def test_tensor_parallel_smoke_under_torchrun(tmp_path):
    """--tp 2 on two gloo ranks: rank 0 alone prints and writes; each rank's shard holds what its
    floor counts (no WARNING); its floor is below one process's and above half of it (the KV, the
    latent projections, norms and routers are whole on every rank); its collectives are counted and timed."""
    one, one_rows = _smoke(tmp_path, "tp1", 1)
    two, two_rows = _smoke(tmp_path, "tp2", 2)
    assert one.returncode == 0 and two.returncode == 0, two.stdout + two.stderr
    assert two.stdout.count("tensor parallel over 2 ranks") == 1 and "WARNING" not in two.stdout, two.stdout
    (r1,), (r2,) = one_rows, two_rows
    assert (r1["tp"], r2["tp"]) == (1, 2)
    for kind in ("target", "spec"):
        assert r1[f"{kind}_floor_gb"] / 2 < r2[f"{kind}_floor_gb"] < r1[f"{kind}_floor_gb"]
        assert r1[f"{kind}_comm_us"] == 0 and r2[f"{kind}_comm_us"] > 0
        assert r1[f"{kind}_collectives"] == 0 and r2[f"{kind}_collectives"] > 0
    assert r2["spec_collectives"] > r2["target_collectives"]  # verify plus the draft's passes


def test_tp_outside_torchrun_is_a_usage_error():
    run = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--smoke", "--tp", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "WORLD_SIZE"})
    assert run.returncode == 2 and "--tp 2: tensor parallelism over 2 ranks runs under torchrun --nproc-per-node 2" in run.stderr, run.stderr
