"""DeepSeek-V3 at real size on one GPU: one TP8 rank's slice, target-only and spec steps against their floors.

    python -m benchmarks.scale                          # both variants, both backends, batch 1-64
    python -m benchmarks.scale --variants moe --backends triton_mla --batches 1,8 --append
    python -m benchmarks.scale --merge dense.csv moe.csv --csv benchmarks/results/scale.csv   # no GPU: CSVs + PNG
    python -m benchmarks.scale --smoke --csv /tmp/scale_smoke.csv   # tiny dims on the CPU, eager, no timing claims

The model is the slice of DeepSeek-V3 one of eight tensor-parallel ranks holds (16 of 128 heads, 1/8
of every MLP and expert, 1/8 of the vocabulary), built on the GPU with random bf16 weights (no
checkpoint): ``dense`` has 61 dense layers, ``moe`` DeepSeek's 3 dense layers then 58 MoE layers of 64
routed experts (8 a token, grouped routing) and a shared expert (rank_slice_config). The draft is
the MTP layer of the same dims (MoE in ``moe``), its head the target's. Random weights accept
nothing worth measuring, so each step's time is measured and speedups are projected for L tokens a
step (L x target_us / spec_us, L = 2.5, 3.0, 3.5).

Per variant, backend and batch (prompts of --context tokens): the device time of a graphed
target-only decode step (GreedyDecoder, cuda_graph) and of a graphed spec step (EagleWorker,
capture_graphs) for each tree (--topks: topk 1 is a chain of --num-steps; topk > 1 verifies
--num-draft-tokens). A step is timed by CUDA events around its launch with the stream held busy
by a spin kernel until the step is queued (StepClock): device time, not the host's launch. Median
of --iters steps after --warmup.

The floor of a step is the bytes it must read over the device's read bandwidth (read_bandwidth:
the fastest of a large sum, a GEMV and a copy). Bytes (target_pass_bytes, mtp_pass_bytes):
attention and dense-MLP weights, in each MoE layer the router, the shared experts and the routed
experts the pass's tokens chose (distinct ids, recorded by RouterTap in one eager pass of the same
shape), the embedding rows, the final norm and LM head, and the KV: (N + the pass's tokens) rows of
576 a request a layer, N the requests' mean KV length while timed. A spec step reads the target's
verify pass and num_steps passes of the MTP layer (num_steps - 1 draft steps and draft-extend),
each with the (shared) head.

Also: kernels a layer launches (LayerKernels: torch.profiler over one eager call of the first
dense and the first MoE decoder layer at the decode shape, in a child process on a 4-layer copy of
the variant), the model's, KV pools' and graphs' memory. Prints a table, writes the CSV (--csv,
rewritten after every row; --append merges into an existing one) and a PNG (--png). Results and
their dates: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from attn.base import KV_DIM
from specdec.baseline import GreedyDecoder
from specdec.config import ConfigError, SpecConfig
from specdec.models import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM
from specdec.worker import EagleWorker

VARIANTS = ("dense", "moe")
PAGE_SIZE = 64
PROJECTED_L = (2.5, 3.0, 3.5)  # tokens a spec step emits, for the projected speedups
INIT_STD = 0.02
MIB = 2**20

# DeepSeek-V3's own rope scaling (its config.json), so the rotary work is the real model's.
V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
           "mscale": 1.0, "mscale_all_dim": 1.0}
# One TP8 rank of DeepSeek-V3: 128 / 8 heads, 18432 / 8 and 2048 / 8 intermediate, 129280 / 8 vocabulary.
RANK_SLICE = dict(vocab_size=16160, hidden_size=7168, intermediate_size=2304, num_attention_heads=16, q_lora_rank=1536,
                  kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                  max_position_embeddings=163840, rope_scaling=V3_YARN)
RANK_SLICE_MOE = dict(n_routed_experts=64, moe_intermediate_size=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                      n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=3)
# --smoke: the same structure at CPU size (latent 512 and rope 64 are fixed by the cache).
SMOKE = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_attention_heads=4, q_lora_rank=128,
             kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=4096,
             rope_scaling=V3_YARN)
SMOKE_MOE = dict(n_routed_experts=8, moe_intermediate_size=64, num_experts_per_tok=2, n_group=4, topk_group=2,
                 n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1)

DEFAULTS = dict(backends="triton_mla,flashinfer_mla", batches="1,8,32,64", layers=61, context=1024, iters=20, warmup=3,
                csv="benchmarks/results/scale.csv")
SMOKE_DEFAULTS = dict(backends="torch_ref,triton_mla", batches="1,2", layers=4, context=24, iters=2, warmup=1,
                      csv="benchmarks/results/scale_smoke.csv")


# ----------------------------------------------------------------------------------------- the models
def rank_slice_config(variant: str, layers: int = 61, smoke: bool = False) -> DeepseekV3Config:
    """The ``dense`` or ``moe`` rank slice (RANK_SLICE, RANK_SLICE_MOE) with ``layers`` decoder
    layers; ``smoke``: the same structure at CPU size (SMOKE, SMOKE_MOE)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    dims, moe = (SMOKE, SMOKE_MOE) if smoke else (RANK_SLICE, RANK_SLICE_MOE)
    routing = dict(moe, first_k_dense_replace=min(moe["first_k_dense_replace"], layers)) if variant == "moe" \
        else dict(n_routed_experts=0)
    return DeepseekV3Config(num_hidden_layers=layers, **dims, **routing)


@torch.no_grad()
def init_random_(params: Sequence[nn.Parameter], std: float = INIT_STD) -> None:
    """In place, on the parameters' own device: matrices (and stacked experts) normal(0, std),
    vectors (the RMS norms' weights) ones. Routers get normal weights too: with unit-RMS inputs their
    logits spread over about +-std * sqrt(hidden), so tokens choose varied experts."""
    for p in params:
        if p.dim() >= 2:
            p.normal_(0.0, std)
        else:
            p.fill_(1.0)


def build_models(cfg: DeepseekV3Config, dtype: torch.dtype, device: str) -> tuple[DeepseekV3ForCausalLM, DeepseekMTP]:
    """The target and its MTP draft (embedding and head shared with the target), random weights
    initialised where they live (init_random_), in eval mode."""
    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(cfg, dtype=dtype, device=device).eval()
    init_random_(list(target.parameters()))
    draft = DeepseekMTP(cfg, target=target, dtype=dtype, device=device).eval()
    init_random_(own_parameters(draft, target))
    return target, draft


def own_parameters(draft: nn.Module, target: nn.Module) -> list[nn.Parameter]:
    """The draft's parameters that are not the target's (an MTP head shares embedding and head)."""
    shared = {id(p) for p in target.parameters()}
    return [p for p in draft.parameters() if id(p) not in shared]


def param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def moe_blocks(target: DeepseekV3ForCausalLM, draft: DeepseekMTP) -> tuple[list[nn.Module], list[nn.Module]]:
    """The MoE blocks (``layer.mlp``) of the target's MoE layers, in layer order, and the draft's
    (its layer is layer num_hidden_layers of the config)."""
    cfg = target.config
    layers = target.model.layers
    targets = [layers[i].mlp for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    drafts = [draft.layer.mlp] if cfg.is_moe_layer(cfg.num_hidden_layers) else []
    return targets, drafts


# ------------------------------------------------------------------------------- the floor's bytes
# Parameter counts from the config alone, so the floor does not depend on how the model packs
# its weights; check_param_counts holds them to the built model.
def attention_params(cfg: DeepseekV3Config) -> int:
    """One MLA layer: query (low-rank with its norm, or plain), kv_a with its latent norm, kv_b, o_proj."""
    h, d = cfg.num_attention_heads, cfg.hidden_size
    if cfg.q_lora_rank is None:
        q = d * h * cfg.qk_head_dim
    else:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    return q + kv + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d


def expert_params(cfg: DeepseekV3Config) -> int:
    """One routed expert: gate, up and down, moe_intermediate_size wide."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def layer_params(cfg: DeepseekV3Config, layer_idx: int, routed_experts: Optional[int] = None) -> int:
    """Decoder layer ``layer_idx``'s parameters: attention, its two norms, the MLP; of a MoE layer
    the router, the shared experts and ``routed_experts`` routed experts (None: all of them)."""
    d = cfg.hidden_size
    n = attention_params(cfg) + 2 * d
    if not cfg.is_moe_layer(layer_idx):
        return n + 3 * d * cfg.intermediate_size
    routed = cfg.n_routed_experts if routed_experts is None else routed_experts
    shared = 3 * d * cfg.moe_intermediate_size * cfg.n_shared_experts
    return n + cfg.n_routed_experts * d + shared + routed * expert_params(cfg)


def target_params(cfg: DeepseekV3Config) -> int:
    """The whole target: embedding, layers, final norm, LM head (once if tied)."""
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (cfg.vocab_size * cfg.hidden_size + sum(layer_params(cfg, i) for i in range(cfg.num_hidden_layers))
            + cfg.hidden_size + head)


def mtp_params(cfg: DeepseekV3Config) -> int:
    """The MTP layer's own parameters (its embedding and head are the target's): enorm, hnorm,
    eh_proj, its decoder layer, shared_head.norm."""
    d = cfg.hidden_size
    return 3 * d + 2 * d * d + layer_params(cfg, cfg.num_hidden_layers)


def check_param_counts(target: nn.Module, draft: nn.Module) -> Optional[str]:
    """None where the built models hold the parameters the floor counts, else what differs."""
    cfg = target.config
    got = (sum(p.numel() for p in target.parameters()), sum(p.numel() for p in own_parameters(draft, target)))
    want = (target_params(cfg), mtp_params(cfg))
    if got == want:
        return None
    return f"the models hold {got} (target, MTP) parameters, the floor's accounting {want}"


def router_bias_bytes(cfg: DeepseekV3Config) -> int:
    """e_score_correction_bias: a buffer, fp32, read by each MoE layer's router."""
    return 4 * cfg.n_routed_experts if cfg.has_moe else 0


def _moe_layer_ids(cfg: DeepseekV3Config) -> list[int]:
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


def target_pass_bytes(cfg: DeepseekV3Config, tokens: int, experts: Sequence[int], kv_rows: int,
                      weight_bytes: int = 2, kv_bytes: int = 2) -> int:
    """Bytes one target forward over ``tokens`` tokens must read: every weight but the routed
    experts, the ``experts[m]`` distinct experts its tokens chose in MoE layer m (in layer order),
    the embedding rows, and ``kv_rows`` KV rows (summed over requests) in every layer.

    E.g. dense, 1 token at N = 1023: all weights but vocab - 1 embedding rows, and 1024 KV rows
    of 576 a layer."""
    moe = _moe_layer_ids(cfg)
    if len(experts) != len(moe):
        raise ValueError(f"experts holds {len(experts)} counts; the config has {len(moe)} MoE layers")
    chosen = dict(zip(moe, experts))
    layers = sum(layer_params(cfg, i, chosen.get(i)) for i in range(cfg.num_hidden_layers))
    head = cfg.vocab_size * cfg.hidden_size
    weights = (tokens * cfg.hidden_size + layers + cfg.hidden_size + head) * weight_bytes
    return weights + len(moe) * router_bias_bytes(cfg) + kv_rows * KV_DIM * kv_bytes * cfg.num_hidden_layers


def mtp_pass_bytes(cfg: DeepseekV3Config, tokens: int, experts: Optional[int], kv_rows: int,
                   weight_bytes: int = 2, kv_bytes: int = 2) -> int:
    """Bytes one MTP-layer forward over ``tokens`` tokens and its logits must read: its own
    weights (``experts`` distinct routed experts when its layer is MoE), the embedding rows, the
    shared LM head, and ``kv_rows`` rows of its one KV layer."""
    moe = cfg.is_moe_layer(cfg.num_hidden_layers)
    if moe and experts is None:
        raise ValueError("the MTP layer is MoE: give the distinct experts its tokens chose")
    d = cfg.hidden_size
    own = 3 * d + 2 * d * d + layer_params(cfg, cfg.num_hidden_layers, experts if moe else None)
    weights = (tokens * d + own + cfg.vocab_size * d) * weight_bytes
    return weights + (router_bias_bytes(cfg) if moe else 0) + kv_rows * KV_DIM * kv_bytes


@dataclass
class Pass:
    """One forward of a step as the taps saw it: ``model`` "target" or "mtp", its tokens, and the
    distinct routed experts chosen in each of its MoE layers (layer order; empty if dense)."""

    model: str
    tokens: int
    experts: list[int] = field(default_factory=list)


def step_floor_bytes(cfg: DeepseekV3Config, passes: Sequence[Pass], batch: int, kv_len: float,
                     weight_bytes: int = 2, kv_bytes: int = 2) -> int:
    """Bytes a step of these passes must read, each request at KV length ``kv_len`` (N): a pass
    of T tokens reads batch * N + T KV rows a layer (the prefix and its own rows)."""
    total = 0
    for p in passes:
        rows = round(batch * kv_len) + p.tokens
        if p.model == "target":
            total += target_pass_bytes(cfg, p.tokens, p.experts, rows, weight_bytes, kv_bytes)
        elif p.model == "mtp":
            total += mtp_pass_bytes(cfg, p.tokens, p.experts[0] if p.experts else None, rows, weight_bytes, kv_bytes)
        else:
            raise ValueError(f"a pass's model is 'target' or 'mtp', got {p.model!r}")
    return total


def floor_us(num_bytes: float, bandwidth: float) -> float:
    """The time to read ``num_bytes`` at ``bandwidth`` bytes/s, in us."""
    return num_bytes / bandwidth * 1e6


# ----------------------------------------------------------------------------------------- the taps
def _first_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def expert_ids(gate_output) -> Optional[torch.Tensor]:
    """The expert ids in a router's output: the integer tensor of (weights, ids), or the output
    itself if it is one."""
    outs = gate_output if isinstance(gate_output, (tuple, list)) else (gate_output,)
    return next((t for t in outs if isinstance(t, torch.Tensor) and not t.is_floating_point()
                 and t.dtype != torch.bool), None)


class RouterTap:
    """While on, records every call of the MoE ``blocks`` (``layer.mlp``): its input, and the expert
    ids its router (``block.gate``) returned. A block whose router the forward did not call as a
    module (a fused path) is routed again here from the recorded input. ``distinct()``: per
    block, the distinct experts of each call."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self.blocks = list(blocks)
        self.calls: list[list[dict]] = [[] for _ in self.blocks]
        self._handles = []

    def __enter__(self) -> "RouterTap":
        for calls, block in zip(self.calls, self.blocks):
            def record_input(module, args, kwargs, calls=calls):
                calls.append({"x": _first_tensor(args, kwargs), "ids": None})

            def record_ids(module, args, output, calls=calls):
                if calls:
                    calls[-1]["ids"] = expert_ids(output)

            self._handles.append(block.register_forward_pre_hook(record_input, with_kwargs=True))
            self._handles.append(block.gate.register_forward_hook(record_ids))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @torch.inference_mode()
    def distinct(self) -> list[list[int]]:
        counts = []
        for calls, block in zip(self.calls, self.blocks):
            per_call = []
            for call in calls:
                ids = call["ids"] if call["ids"] is not None else expert_ids(block.gate(call["x"]))
                if ids is None:
                    raise RuntimeError(f"{type(block.gate).__name__} returned no integer expert ids")
                per_call.append(int(torch.unique(ids).numel()))
            counts.append(per_call)
        return counts


class PassTap:
    """While on, records the tokens of every forward of ``model`` (its first tensor argument)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.tokens, self._handle = model, [], None

    def __enter__(self) -> "PassTap":
        def record(module, args, kwargs):
            ids = _first_tensor(args, kwargs)
            self.tokens.append(int(ids.shape[0]) if ids is not None else 0)

        self._handle = self.model.register_forward_pre_hook(record, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def tapped_passes(name: str, passes: PassTap, routers: RouterTap, cfg: DeepseekV3Config) -> tuple[list[Pass], bool]:
    """The Pass of every forward ``passes`` saw, with the experts ``routers`` saw (one call of each
    block a forward). Where the calls do not line up with the forwards (the blocks were not
    called as modules), every MoE layer counts min(experts, tokens * experts a token) instead,
    the most a pass can choose; the flag says whether the counts were measured."""
    distinct = routers.distinct()
    measured = all(len(calls) == len(passes.tokens) for calls in distinct)
    out = []
    for i, tokens in enumerate(passes.tokens):
        if measured:
            experts = [calls[i] for calls in distinct]
        else:
            experts = [min(cfg.n_routed_experts, tokens * cfg.num_experts_per_tok)] * len(routers.blocks)
        out.append(Pass(name, tokens, experts))
    return out, measured


class LayerKernels:
    """While on, counts what each of ``layers`` (name -> module) launches in its first call:
    torch.profiler around that call alone, the device synchronised before and after it. CUDA:
    device kernels; CPU (--smoke): torch ops, nested ones included (a stand-in, no claim)."""

    def __init__(self, layers: dict[str, nn.Module], cuda: bool) -> None:
        self.layers, self.cuda = layers, cuda
        self.counts: dict[str, int] = {}
        self._active: Optional[tuple[str, object]] = None
        self._handles = []

    def __enter__(self) -> "LayerKernels":
        for name, layer in self.layers.items():
            self._handles.append(layer.register_forward_pre_hook(lambda m, a, name=name: self._start(name)))
            self._handles.append(layer.register_forward_hook(lambda m, a, o, name=name: self._stop(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._active is not None:
            self._active[1].stop()
            self._active = None

    def _activities(self) -> list:
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]

    def _start(self, name: str) -> None:
        if name in self.counts or self._active is not None:
            return
        from torch.profiler import profile

        if self.cuda:
            torch.cuda.synchronize()
        prof = profile(activities=self._activities())
        prof.start()
        self._active = (name, prof)

    def _stop(self, name: str) -> None:
        if self._active is None or self._active[0] != name:
            return
        prof = self._active[1]
        if self.cuda:
            torch.cuda.synchronize()
        prof.stop()
        self._active = None
        self.counts[name] = count_trace_events(trace_events(prof), "kernel" if self.cuda else "cpu_op")


def trace_events(prof) -> list[dict]:
    """A profile's events, through its Chrome trace (a format stable across torch releases)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])


def count_trace_events(events: list[dict], category: str) -> int:
    """Events of ``category`` ("kernel": CUDA kernels; "cpu_op": torch ops)."""
    return sum(1 for e in events if str(e.get("cat", "")).lower() == category)


# ----------------------------------------------------------------------------------------- timing
class StepClock:
    """Times a step's device work. CUDA: events recorded just before and after the step is
    launched, the stream first held busy by a spin kernel (torch.cuda._sleep) that outlasts the
    host's launch, so the start event fires once the step is queued and the time is the device's
    (no launch latency, no host bookkeeping). Where a launch outlasted its spin (the spin is timed
    too) the time includes idle device time: counted in ``short_pads``, and the spin doubles. CPU
    (--smoke): the wall time of the call."""

    MIN_PAD_US = 1000.0
    MAX_PAD_US = 50_000.0

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.short_pads = 0
        self._cycles_per_us = self._calibrate() if cuda else 0.0

    @staticmethod
    def _calibrate() -> float:
        """The spin's cycles per us: the fastest of a few 2 ms spins after a 50 ms one (clocks up)."""
        if not hasattr(torch.cuda, "_sleep"):
            print("# torch.cuda._sleep is missing: steps are timed without a spin before them")
            return 0.0
        torch.cuda._sleep(100_000_000)
        rates = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(4_000_000)
            end.record()
            end.synchronize()
            rates.append(4_000_000 / (start.elapsed_time(end) * 1e3))
        return max(rates)

    def times_us(self, launch: Callable[[], object], finish: Optional[Callable[[object], object]],
                 iters: int, warmup: int) -> list[float]:
        """``iters`` times of ``launch()`` after ``warmup`` untimed ones, us; ``finish(result)``
        follows each, untimed (a worker's finish_step)."""
        times, host_us = [], []
        pad_us = self.MIN_PAD_US
        for i in range(warmup + iters):
            if i == warmup and host_us:  # three times the slowest warm-up launch
                pad_us = min(self.MAX_PAD_US, max(pad_us, 3 * max(host_us)))
            if not self.cuda:
                t0 = time.perf_counter()
                out = launch()
                times.append((time.perf_counter() - t0) * 1e6)
            else:
                spin, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                spin.record()
                if self._cycles_per_us:
                    torch.cuda._sleep(int(pad_us * self._cycles_per_us))
                start.record()
                t0 = time.perf_counter()
                out = launch()
                host_us.append((time.perf_counter() - t0) * 1e6)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
                if host_us[-1] > spin.elapsed_time(start) * 1e3:
                    self.short_pads += i >= warmup
                    pad_us = min(self.MAX_PAD_US, 2 * pad_us)
            if finish is not None:
                finish(out)
        return times[warmup:]


# ------------------------------------------------------------------------------------- bandwidth
def fastest_s(fn: Callable[[], object], cuda: bool, reps: int) -> float:
    """The fastest of ``reps`` calls of ``fn`` after one untimed, s (CUDA events, else wall)."""
    fn()
    best = math.inf
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(device: str, num_bytes: int, reps: int) -> dict[str, float]:
    """Read bandwidths in bytes/s: a bf16 tensor's sum, a GEMV over a bf16 matrix of that size (a
    decode GEMM's access pattern) and, on CUDA, the fastest copy (benchmarks.mla_kernels'
    copy_bandwidth, read + write). ``floor``: the fastest of them, the ceiling a floor assumes."""
    cuda, cols = device == "cuda", 1 << 14
    matrix = torch.ones(num_bytes // 2 // cols, cols, dtype=torch.bfloat16, device=device)
    vector = torch.ones(1, cols, dtype=torch.bfloat16, device=device)
    size = matrix.numel() * matrix.element_size()
    out = {"sum": size / fastest_s(lambda: matrix.sum(dtype=torch.float32), cuda, reps),
           "gemv": size / fastest_s(lambda: torch.nn.functional.linear(vector, matrix), cuda, reps)}
    matrix = vector = None  # freed before the copy takes its own 2 x num_bytes
    if cuda:
        try:
            from benchmarks.mla_kernels import copy_bandwidth

            out["copy"] = copy_bandwidth(num_bytes)
        except ImportError as err:
            print(f"# copy bandwidth skipped: {err}")
    out["floor"] = max(out.values())
    return out


# ----------------------------------------------------------------------------------- measurements
@dataclass
class Setup:
    """What every measurement of a variant shares."""

    variant: str
    target: DeepseekV3ForCausalLM
    draft: DeepseekMTP
    cuda: bool
    clock: StepClock
    bandwidth: float
    iters: int
    warmup: int
    num_steps: int
    num_draft_tokens: int

    @property
    def cfg(self) -> DeepseekV3Config:
        return self.target.config

    @property
    def weight_bytes(self) -> int:
        return next(self.target.parameters()).element_size()


def _memory() -> tuple[int, int]:
    if not torch.cuda.is_available():
        return 0, 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def pool_bytes(pool) -> int:
    """A KV pool's pages and req_to_token table."""
    return sum(t.numel() * t.element_size() for t in (*pool.kv_buffers, pool.req_to_token))


def profiled_layers(target: DeepseekV3ForCausalLM) -> dict[str, nn.Module]:
    """The first dense and the first MoE decoder layer (as the model has them)."""
    cfg, layers, out = target.config, target.model.layers, {}
    for i in range(cfg.num_hidden_layers):
        out.setdefault("moe" if cfg.is_moe_layer(i) else "dense", layers[i])
    return out


@torch.inference_mode()
def measure_target(s: Setup, backend: str, prompts: list[list[int]]) -> dict:
    """Target-only decoding: graphed step times; then one more eager forward at the decode shape,
    with the routers' experts recorded."""
    bs, steps = len(prompts), s.warmup + s.iters
    decoder = GreedyDecoder(s.target, prompts, steps + 4, backend=backend, page_size=PAGE_SIZE, cuda_graph=s.cuda)
    decoder.step()  # eager: lazy inits and compiles
    before = _memory()
    decoder.step()  # CUDA: captures the step and replays it
    after = _memory()
    n0 = len(prompts[0]) + len(decoder.tokens) - 1  # each request's KV length before the next step
    times = s.clock.times_us(decoder.step, None, s.iters, s.warmup)
    kv_len = n0 + s.warmup + (s.iters - 1) / 2  # the timed steps' mean N
    blocks, _ = moe_blocks(s.target, s.draft)
    with RouterTap(blocks) as routers, PassTap(s.target) as passes:
        decoder.run.decode(decoder.token, decoder.seq_lens)  # writes the KV the next step would rewrite
    tapped, measured = tapped_passes("target", passes, routers, s.cfg)
    floor = step_floor_bytes(s.cfg, tapped, bs, kv_len, s.weight_bytes, decoder.run.pool.kv_buffers[0].element_size())
    out = {"target_us": statistics.median(times), "target_floor_us": floor_us(floor, s.bandwidth),
           "target_floor_gb": floor / 1e9, "target_kv_len": kv_len, "target_experts": _mean_experts(tapped),
           "experts_measured": measured,
           "target_kv_gb": pool_bytes(decoder.run.pool) / 1e9,
           "target_graph_mib": (after[0] - before[0]) / MIB, "target_graph_reserved_mib": (after[1] - before[1]) / MIB}
    del decoder
    return out


@torch.inference_mode()
def layer_kernels(target: DeepseekV3ForCausalLM, backend: str, prompts: list[list[int]], cuda: bool) -> dict[str, int]:
    """What the first dense and the first MoE layer launch in an eager decode forward of these
    prompts (LayerKernels), after one eager step (compiles and lazy inits)."""
    decoder = GreedyDecoder(target, prompts, 3, backend=backend, page_size=PAGE_SIZE)
    decoder.step()
    with LayerKernels(profiled_layers(target), cuda) as kernels:
        decoder.run.decode(decoder.token, decoder.seq_lens)
    return kernels.counts


KERNEL_CHILD_LAYERS = 4  # enough for DeepSeek's three dense layers and one MoE layer


def kernels_child(args: argparse.Namespace, variant: str) -> None:
    """--kernels-child: layer_kernels for every backend and batch of ``args`` on the variant at
    KERNEL_CHILD_LAYERS layers; prints them as JSON ({"backend/batch": {"dense": n, "moe": m}})."""
    device = "cpu" if args.smoke else "cuda"
    cfg = rank_slice_config(variant, min(args.layers, KERNEL_CHILD_LAYERS), smoke=args.smoke)
    target, _ = build_models(cfg, torch.float32 if args.smoke else torch.bfloat16, device)
    out: dict[str, object] = {}
    for backend in args.backends:
        if backend_refusal(backend, device):
            continue
        for batch in args.batches:
            try:
                out[f"{backend}/{batch}"] = layer_kernels(target, backend, _prompts(cfg, batch, args.context),
                                                          device == "cuda")
            except ImportError:
                break
            except Exception as err:  # the parent reports it; the other shapes still count
                out[f"{backend}/{batch}"] = {"error": f"{type(err).__name__}: {err}"}
            _free()
    print(json.dumps(out))


def kernel_counts(args: argparse.Namespace, variant: str) -> dict[str, dict]:
    """kernels_child's counts, from a child process: the profiler's CUPTI session stays out of the
    process that captures and times graphs (CUPTI torn down and set up again under CUDA graphs
    has crashed; left set up it slows what follows). {} where the child failed (said why)."""
    cmd = [sys.executable, "-m", "benchmarks.scale", "--kernels-child", variant, "--backends", ",".join(args.backends),
           "--batches", ",".join(map(str, args.batches)), "--layers", str(args.layers), "--context", str(args.context)]
    cmd += ["--smoke"] if args.smoke else []
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        print(f"# {variant}: kernel counts timed out; kernels_per_layer left empty", flush=True)
        return {}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        print(f"# {variant}: kernel-count child exited {done.returncode} with no counts; kernels_per_layer left empty",
              flush=True)
        return {}
    if done.returncode:  # e.g. at exit, once its counts were out
        print(f"# {variant}: kernel-count child exited {done.returncode} after its counts", flush=True)
    counts = json.loads(lines[-1])
    for key, value in counts.items():
        if "error" in value:
            print(f"# {variant} {key}: kernel count failed ({value['error']})", flush=True)
    return counts


def _prompts(cfg: DeepseekV3Config, batch: int, context: int) -> list[list[int]]:
    return torch.randint(0, cfg.vocab_size, (batch, context), generator=torch.Generator().manual_seed(batch)).tolist()


def _mean_experts(passes: Sequence[Pass]) -> float:
    counts = [e for p in passes for e in p.experts]
    return float(statistics.mean(counts)) if counts else math.nan


def spec_config(s: Setup, backend: str, batch: int, prompt_len: int, topk: int) -> tuple[SpecConfig, int]:
    """The worker's config for ``batch`` prompts of ``prompt_len`` tokens, and max_new_tokens:
    room for every step to emit num_steps + 1 tokens, so no request finishes while timed."""
    ndt = None if topk == 1 else s.num_draft_tokens
    steps = 1 + s.warmup + s.iters + 2
    new_tokens = (s.num_steps + 1) * steps + 1
    base = SpecConfig(num_steps=s.num_steps, topk=topk, num_draft_tokens=ndt, attention_backend=backend,
                      kv_dtype="bf16" if s.cuda else "auto", page_size=PAGE_SIZE, max_batch_size=1,
                      max_context_len=math.lcm(128, PAGE_SIZE) << 10)  # for the tree's headroom first
    block = math.lcm(128, base.page_size)
    context = block * -(-(prompt_len + new_tokens + base.spec_headroom) // block)
    cfg = SpecConfig(num_steps=s.num_steps, topk=topk, num_draft_tokens=ndt, attention_backend=backend,
                     kv_dtype=base.kv_dtype, page_size=PAGE_SIZE, max_batch_size=batch, max_context_len=context,
                     cuda_graph_batch_sizes=[batch] if s.cuda else [])
    return cfg, new_tokens


@torch.inference_mode()
def measure_spec(s: Setup, cfg: SpecConfig, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """The spec step: one eager step with the passes and routers recorded, then (CUDA) the
    graphs' capture and the graphed steps' times."""
    worker = EagleWorker(s.target, s.draft, cfg)
    worker.add_requests(prompts, max_new_tokens=max_new_tokens)
    target_blocks, draft_blocks = moe_blocks(s.target, s.draft)
    with RouterTap(target_blocks) as t_routers, RouterTap(draft_blocks) as d_routers, \
            PassTap(s.target) as t_passes, PassTap(s.draft) as d_passes:
        worker.step()
    verify, measured = tapped_passes("target", t_passes, t_routers, s.cfg)
    drafts, d_measured = tapped_passes("mtp", d_passes, d_routers, s.cfg)
    if len(verify) != 1 or len(drafts) != cfg.num_steps:
        print(f"# WARNING: the eager step ran {len(verify)} target and {len(drafts)} draft forwards (expected 1 and "
              f"num_steps = {cfg.num_steps}); the floor counts those seen")
    before = _memory()
    runner = worker.capture_graphs([len(prompts)], progress=False) if s.cuda else None
    after = _memory()
    n_before = statistics.mean(r.seq_len for r in worker.requests)
    times = s.clock.times_us(worker.launch_step, worker.finish_step, s.iters, s.warmup)
    if len(worker.requests) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(worker.requests)} requests finished while timed: raise max_new_tokens")
    kv_len = (n_before + statistics.mean(r.seq_len for r in worker.requests)) / 2
    kv_bytes = worker.target_pool.kv_buffers[0].element_size()
    floor = step_floor_bytes(s.cfg, verify + drafts, len(prompts), kv_len, s.weight_bytes, kv_bytes)
    out = {"spec_us": statistics.median(times), "spec_floor_us": floor_us(floor, s.bandwidth),
           "spec_floor_gb": floor / 1e9, "verify_tokens": sum(p.tokens for p in verify),
           "draft_passes": len(drafts), "draft_tokens": sum(p.tokens for p in drafts),
           "verify_experts": _mean_experts(verify), "draft_experts": _mean_experts(drafts),
           "experts_measured": measured and d_measured, "spec_kv_len": kv_len,
           "spec_kv_gb": (pool_bytes(worker.target_pool) + pool_bytes(worker.draft_pool)) / 1e9,
           "captured_steps": len(runner.captured) if runner is not None else 0,
           "graph_mib": (after[0] - before[0]) / MIB, "graph_reserved_mib": (after[1] - before[1]) / MIB}
    del worker, runner
    return out


def combine(s: Setup, backend: str, batch: int, topk: int, cfg: SpecConfig, target: dict, spec: dict,
            kernels: dict, model_gb: float) -> dict:
    """One CSV row (COLUMNS first, then the detail columns); kernels: layer_kernels' counts."""
    dense, moe = kernels.get("dense", math.nan), kernels.get("moe", math.nan)
    return {
        "variant": s.variant, "backend": backend, "batch": batch, "topk": topk, "num_steps": cfg.num_steps,
        "num_draft_tokens": cfg.num_draft_tokens,
        "target_us": target["target_us"], "spec_us": spec["spec_us"],
        "target_floor_frac": target["target_floor_us"] / target["target_us"],
        "spec_floor_frac": spec["spec_floor_us"] / spec["spec_us"],
        "kernels_per_layer": moe if s.cfg.has_moe else dense,
        "spec_over_target": spec["spec_us"] / target["target_us"],
        **{f"speedup_L{L}": L * target["target_us"] / spec["spec_us"] for L in PROJECTED_L},
        "target_floor_us": target["target_floor_us"], "spec_floor_us": spec["spec_floor_us"],
        "target_floor_gb": target["target_floor_gb"], "spec_floor_gb": spec["spec_floor_gb"],
        "kernels_dense": dense, "kernels_moe": moe,
        "target_experts": target["target_experts"], "verify_experts": spec["verify_experts"],
        "draft_experts": spec["draft_experts"],
        "experts_measured": target["experts_measured"] and spec["experts_measured"],
        "verify_tokens": spec["verify_tokens"], "draft_passes": spec["draft_passes"],
        "draft_tokens": spec["draft_tokens"],
        "target_kv_len": target["target_kv_len"], "spec_kv_len": spec["spec_kv_len"],
        "bandwidth_gbs": s.bandwidth / 1e9, "model_gb": model_gb,
        "target_kv_gb": target["target_kv_gb"], "spec_kv_gb": spec["spec_kv_gb"],
        "captured_steps": spec["captured_steps"],
        "graph_mib": spec["graph_mib"], "graph_reserved_mib": spec["graph_reserved_mib"],
        "target_graph_mib": target["target_graph_mib"],
        "timing": "cuda_graphs" if s.cuda else "cpu_eager_smoke",
    }


COLUMNS = ["variant", "backend", "batch", "topk", "target_us", "spec_us", "target_floor_frac", "spec_floor_frac",
           "kernels_per_layer", "spec_over_target"]
# (column, width, format) of the printed table
TABLE = [("variant", 7, "{}"), ("backend", 14, "{}"), ("batch", 5, "{}"), ("topk", 4, "{}"), ("ndt", 3, "{}"),
         ("target_us", 9, "{:.0f}"), ("t_floor", 7, "{:.0f}"), ("t_frac", 6, "{:.2f}"), ("spec_us", 9, "{:.0f}"),
         ("s_floor", 7, "{:.0f}"), ("s_frac", 6, "{:.2f}"), ("spec/tgt", 8, "{:.2f}"), ("L2.5", 5, "{:.2f}"),
         ("L3.0", 5, "{:.2f}"), ("L3.5", 5, "{:.2f}"), ("kern/layer", 10, "{:.0f}"), ("experts v/d", 11, "{}")]


def table_line(row: Optional[dict]) -> str:
    """The printed table's header (None) or one row."""
    if row is None:
        return " ".join(f"{name:>{width}}" for name, width, _ in TABLE)
    values = [row["variant"], row["backend"], row["batch"], row["topk"], row["num_draft_tokens"], row["target_us"],
              row["target_floor_us"], row["target_floor_frac"], row["spec_us"], row["spec_floor_us"],
              row["spec_floor_frac"], row["spec_over_target"], row["speedup_L2.5"], row["speedup_L3.0"],
              row["speedup_L3.5"], row["kernels_per_layer"], _experts_text(row)]
    return " ".join(f"{fmt.format(v):>{width}}" for (_, width, fmt), v in zip(TABLE, values))


def _experts_text(row: dict) -> str:
    """Mean distinct experts a MoE layer, verify / draft ("-": a dense model)."""
    verify, draft = (row.get(k) for k in ("verify_experts", "draft_experts"))
    number = [isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) for v in (verify, draft)]
    if not number[0]:
        return "-"
    return f"{verify:.1f}/{draft:.1f}" if number[1] else f"{verify:.1f}/-"


# ---------------------------------------------------------------------------------------- output
def _key(row: dict) -> tuple:
    return tuple(str(row[k]) for k in ("variant", "backend", "batch", "topk"))


def _parse(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(value, value)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: _parse(v) for k, v in row.items()} for row in csv.DictReader(f)]


def write_csv(rows: list[dict], path: Path) -> None:
    """All rows, their columns in first-seen order (COLUMNS first)."""
    keys = list(dict.fromkeys(COLUMNS + [k for r in rows for k in r]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, keys, restval="")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)  # a run cut off mid-write leaves the last whole file


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Step times with their floors, fractions of the floor and projected speedup (L = 3.0,
    bars to 2.5 and 3.5) against batch size, one column per variant."""
    try:
        import matplotlib
    except ImportError as err:
        print(f"# no PNG: {err}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(3, len(variants), figsize=(6 * len(variants), 11), squeeze=False)
    for col, variant in enumerate(variants):
        time_ax, frac_ax, speed_ax = axes[:, col]
        vrows = [r for r in rows if r["variant"] == variant]
        for backend in dict.fromkeys(r["backend"] for r in vrows):
            brows = [r for r in vrows if r["backend"] == backend]
            first = {r["batch"]: r for r in reversed(brows)}  # target-only: one per batch
            bss = sorted(first)
            line, = time_ax.plot(bss, [first[b]["target_us"] / 1e3 for b in bss], "x--", label=f"{backend} target")
            time_ax.plot(bss, [first[b]["target_floor_us"] / 1e3 for b in bss], ":", color=line.get_color())
            frac_ax.plot(bss, [first[b]["target_floor_frac"] for b in bss], "x--", label=f"{backend} target")
            for topk in dict.fromkeys(r["topk"] for r in brows):
                rs = sorted((r for r in brows if r["topk"] == topk), key=lambda r: r["batch"])
                label = f"{backend} spec topk {topk}"
                b = [r["batch"] for r in rs]
                line, = time_ax.plot(b, [r["spec_us"] / 1e3 for r in rs], "o-", label=label)
                time_ax.plot(b, [r["spec_floor_us"] / 1e3 for r in rs], ":", color=line.get_color())
                frac_ax.plot(b, [r["spec_floor_frac"] for r in rs], "o-", label=label)
                mid = [r["speedup_L3.0"] for r in rs]
                err = [[m - r["speedup_L2.5"] for m, r in zip(mid, rs)],
                       [r["speedup_L3.5"] - m for m, r in zip(mid, rs)]]
                speed_ax.errorbar(b, mid, yerr=err, fmt="o-", capsize=3, label=label)
        speed_ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
        time_ax.set_yscale("log")
        for ax, name in ((time_ax, "step time (ms); dotted: floor"), (frac_ax, "fraction of floor"),
                         (speed_ax, "projected speedup, L = 3.0 (bars 2.5-3.5)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_title(f"{variant}: {name}", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot_or_say_why(rows: list[dict], path: Path, title: str) -> None:
    """plot, or the reason it failed (the CSV is out already)."""
    try:
        plot(rows, path, title)
    except Exception:
        print(f"# no PNG:\n{traceback.format_exc()}")


# ------------------------------------------------------------------------------------------ main
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="dense,moe", help="dense, moe or both")
    ap.add_argument("--backends", help=f"default {DEFAULTS['backends']} (--smoke: {SMOKE_DEFAULTS['backends']})")
    ap.add_argument("--batches", help=f"default {DEFAULTS['batches']}")
    ap.add_argument("--topks", default="1,4", help="trees: topk 1 is a chain of --num-steps, topk > 1 verifies "
                                                   "--num-draft-tokens")
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--num-draft-tokens", type=int, default=8, help="tree size for topk > 1")
    ap.add_argument("--layers", type=int, help=f"decoder layers (default {DEFAULTS['layers']})")
    ap.add_argument("--context", type=int, help=f"prompt tokens a request (default {DEFAULTS['context']})")
    ap.add_argument("--iters", type=int, help=f"timed steps (default {DEFAULTS['iters']}), median")
    ap.add_argument("--warmup", type=int, help=f"untimed steps first (default {DEFAULTS['warmup']})")
    ap.add_argument("--csv", type=Path, help=f"default {DEFAULTS['csv']} (--smoke: {SMOKE_DEFAULTS['csv']})")
    ap.add_argument("--png", type=Path, help="default: the CSV's path with .png")
    ap.add_argument("--append", action="store_true",
                    help="merge into an existing --csv (rows of the same variant, backend, batch and topk replaced)")
    ap.add_argument("--smoke", action="store_true", help="tiny dims on the CPU: every path but the CUDA timing")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="CSV",
                    help="no run: merge these CSVs (later rows replace earlier ones of the same configuration) "
                         "into --csv and plot them (no GPU needed)")
    ap.add_argument("--kernels-child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, value in (SMOKE_DEFAULTS if args.smoke else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, Path(value) if name == "csv" else value)
    args.png = args.png or args.csv.with_suffix(".png")
    args.variants = [v for v in args.variants.split(",") if v]
    args.backends = [b for b in args.backends.split(",") if b]
    args.batches, args.topks = _ints(args.batches), _ints(args.topks)
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants takes {VARIANTS}, got {bad}")
    if args.iters < 1 or args.warmup < 0 or args.layers < 1 or args.context < 1:
        ap.error("--iters, --layers and --context must be >= 1, --warmup >= 0")
    if not (args.smoke or args.merge) and not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU; --smoke runs its CPU smoke test")
    return args


def backend_refusal(backend: str, device: str) -> Optional[str]:
    """Why ``backend`` cannot run here (the registry's device check), or None."""
    try:
        SpecConfig(attention_backend=backend, page_size=PAGE_SIZE).cache_dtype(torch.bfloat16, torch.device(device))
    except ConfigError as err:
        return str(err)
    return None


class Run:
    """The rows so far (--csv rewritten after each), and the configurations that failed."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows = read_csv(args.csv) if args.append and args.csv.exists() else []
        self.failures = 0

    def emit(self, row: dict) -> None:
        self.rows[:] = [r for r in self.rows if _key(r) != _key(row)] + [row]
        write_csv(self.rows, self.args.csv)
        print(table_line(row), flush=True)

    def failed(self, what: str) -> None:
        self.failures += 1
        print(f"# {what} failed:\n{traceback.format_exc()}", flush=True)
        _free()


def run_variant(run: Run, variant: str, clock: StepClock, bandwidth: float, device: str) -> None:
    """Every backend, batch and tree of one variant, on one model."""
    args = run.args
    kernels = kernel_counts(args, variant)  # first: the child has the device to itself
    cfg = rank_slice_config(variant, args.layers, smoke=args.smoke)
    t0 = time.perf_counter()
    target, draft = build_models(cfg, torch.float32 if args.smoke else torch.bfloat16, device)
    mismatch = check_param_counts(target, draft)
    if mismatch:
        print(f"# WARNING: {mismatch}: the floors count the config's parameters")
    own = own_parameters(draft, target)
    model_gb = (param_bytes(target.parameters()) + param_bytes(own)) / 1e9
    print(f"# {variant}: {cfg.num_hidden_layers} layers ({len(_moe_layer_ids(cfg))} MoE), built in "
          f"{time.perf_counter() - t0:.1f} s; parameters {param_bytes(target.parameters()) / 1e9:.2f} GB target + "
          f"{param_bytes(own) / 1e9:.2f} GB MTP layer", flush=True)
    s = Setup(variant, target, draft, device == "cuda", clock, bandwidth, args.iters, args.warmup, args.num_steps,
              args.num_draft_tokens)
    for backend in args.backends:
        refusal = backend_refusal(backend, device)
        if refusal:
            print(f"# {variant} {backend}: skipped ({refusal})", flush=True)
            continue
        for batch in args.batches:
            try:
                run_batch(run, s, backend, batch, kernels.get(f"{backend}/{batch}", {}), model_gb)
            except ImportError as err:  # the backend's kernel library
                print(f"# {variant} {backend}: skipped ({type(err).__name__}: {err})", flush=True)
                break


def run_batch(run: Run, s: Setup, backend: str, batch: int, kernels: dict, model_gb: float) -> None:
    """Target-only decoding at ``batch``, then the spec step of each tree: a row each."""
    args, name = run.args, f"{s.variant} {backend} batch {batch}"
    prompts = _prompts(s.cfg, batch, args.context)
    try:
        target = measure_target(s, backend, prompts)
    except ImportError:
        raise
    except Exception:
        return run.failed(f"{name}: target-only")
    finally:
        _free()
    print(f"# {name}: target {target['target_us']:.0f} us (floor {target['target_floor_us']:.0f}), KV pool "
          f"{target['target_kv_gb']:.2f} GB, graph {target['target_graph_mib']:.0f} MiB; kernels a layer: dense "
          f"{kernels.get('dense', '-')}, MoE {kernels.get('moe', '-')}", flush=True)
    for topk in args.topks:
        try:
            cfg, new_tokens = spec_config(s, backend, batch, args.context, topk)
        except ConfigError as err:
            print(f"# {name} topk {topk}: skipped ({err})", flush=True)
            continue
        try:
            spec = measure_spec(s, cfg, prompts, new_tokens)
        except Exception:
            run.failed(f"{name} topk {topk}")
            continue
        finally:
            _free()
        print(f"# {name} topk {topk}: KV pools {spec['spec_kv_gb']:.2f} GB, {spec['captured_steps']} graphed steps "
              f"+{spec['graph_mib']:.0f} MiB allocated, +{spec['graph_reserved_mib']:.0f} MiB reserved", flush=True)
        run.emit(combine(s, backend, batch, topk, cfg, target, spec, kernels, model_gb))


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def merge(args: argparse.Namespace) -> int:
    """--merge: the CSVs' rows into --csv, and their plot."""
    run = Run(args)
    for path in args.merge:
        for row in read_csv(path):
            run.rows[:] = [r for r in run.rows if _key(r) != _key(row)] + [row]
    write_csv(run.rows, args.csv)
    print(f"wrote {args.csv}: {len(run.rows)} rows")
    plot_or_say_why(run.rows, args.png, "DeepSeek-V3 TP8 rank slice, " + " + ".join(p.name for p in args.merge))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.kernels_child:
        kernels_child(args, args.kernels_child)
        return 0
    if args.merge:
        return merge(args)
    device = "cpu" if args.smoke else "cuda"
    cuda = device == "cuda"
    run = Run(args)
    name = torch.cuda.get_device_name() if cuda else "CPU (smoke: eager, times are not measurements)"
    bw = read_bandwidth(device, (2 << 30) if cuda else (32 << 20), 20 if cuda else 3)
    print(f"device: {name}; read bandwidth {bw['floor'] / 1e9:.0f} GB/s (the fastest of "
          + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in bw.items() if k != "floor") + " GB/s)", flush=True)
    _free()
    clock = StepClock(cuda)
    print(table_line(None))
    for variant in args.variants:
        try:
            run_variant(run, variant, clock, bw["floor"], device)
        except Exception:
            run.failed(variant)
        _free()
    if clock.short_pads:
        print(f"# WARNING: {clock.short_pads} timed steps launched for longer than the spin before them: "
              "their times include idle device time (the spin doubled after each)")
    if run.rows:
        print()
        print(table_line(None))
        for row in run.rows:
            print(table_line(row))
        print(f"wrote {args.csv}")
        plot_or_say_why(run.rows, args.png, f"DeepSeek-V3 TP8 rank slice, {args.context}-token context, {name}")
    if run.failures:
        print(f"# {run.failures} configurations failed (above)")
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
