"""DeepSeek-V3 at real size on one GPU: one TP8 rank's slice, target-only and spec steps against their floors.

    python -m benchmarks.scale                          # both variants, both backends, batch 1-64
    python -m benchmarks.scale --variants moe --backends triton_mla --batches 1,8 --append
    python -m benchmarks.scale --merge dense.csv moe.csv --csv benchmarks/results/scale.csv   # no GPU: CSVs + PNG
    python -m benchmarks.scale --smoke --csv /tmp/scale_smoke.csv   # tiny dims on the CPU, eager, no timing claims
    torchrun --nproc-per-node 2 -m benchmarks.scale --tp 2 --csv benchmarks/results/scale_tp2.csv   # 2 GPUs (NCCL)

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

--tp N (under torchrun --nproc-per-node N; NCCL on GPUs, gloo with --smoke): the same slice
sharded over N ranks (heads, MLP and expert intermediates, vocabulary: rank_config), one worker a
rank in lockstep; each rank's floor counts the bytes it holds, and ``target_comm_us`` /
``spec_comm_us`` the step's collectives (CollectiveTap over its eager step, ``*_collectives``
calls; each kind timed alone, collectives_us). Rank 0 prints and writes; kernel counts are left empty (a rank's layer
adds its two all-reduces to the tp 1 count).

Also: kernels a layer launches (LayerKernels: torch.profiler over one eager call of the first
dense and the first MoE decoder layer at the decode shape, in a child process on a 4-layer copy of
the variant), the model's, KV pools' and graphs' memory. Prints a table, writes the CSV (--csv,
rewritten after every row; --append merges into an existing one) and a PNG (--png). Results and
their dates: docs/benchmarks.md. Its parts: rank_slice.py (the model, the floor's bytes),
scale_probes.py (the taps, kernel counts, the clock, the bandwidth), scale_report.py (CSV, table, PNG).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from benchmarks.rank_slice import (
    VARIANTS, Pass, build_models, check_param_counts, floor_us, moe_blocks, moe_layer_ids, own_parameters, param_bytes,
    rank_config, rank_slice_config, step_floor_bytes,
)
from benchmarks.scale_probes import (
    CollectiveTap, LayerKernels, PassTap, RouterTap, StepClock, collectives_us, read_bandwidth, tapped_passes,
)
from benchmarks.scale_report import plot_or_say_why, read_csv, row_key, table_line, write_csv
from specdec.baseline import GreedyDecoder
from specdec.config import ConfigError, SpecConfig
from specdec.models import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM
from specdec.parallel import Parallel, launch_problem, start_ranks
from specdec.worker import EagleWorker

PAGE_SIZE = 64
PROJECTED_L = (2.5, 3.0, 3.5)  # tokens a spec step emits, for the projected speedups
MIB = 2**20

DEFAULTS = dict(backends="triton_mla,flashinfer_mla", batches="1,8,32,64", layers=61, context=1024, iters=20, warmup=3,
                csv="benchmarks/results/scale.csv")
SMOKE_DEFAULTS = dict(backends="torch_ref,triton_mla", batches="1,2", layers=4, context=24, iters=2, warmup=1,
                      csv="benchmarks/results/scale_smoke.csv")



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
    def parallel(self) -> Parallel:
        """This rank's place in the group the target was built for."""
        return self.target.parallel

    @property
    def rank_cfg(self) -> DeepseekV3Config:
        """What this rank holds, for its floor (rank_config)."""
        return rank_config(self.cfg, self.parallel.size)

    @property
    def device(self) -> str:
        return str(next(self.target.parameters()).device)

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
    with RouterTap(blocks) as routers, PassTap(s.target) as passes, CollectiveTap() as comm:
        decoder.run.decode(decoder.token, decoder.seq_lens)  # writes the KV the next step would rewrite
    tapped, measured = tapped_passes("target", passes, routers, s.cfg)
    floor = step_floor_bytes(s.rank_cfg, tapped, bs, kv_len, s.weight_bytes, decoder.run.pool.kv_buffers[0].element_size())
    out = {"target_us": statistics.median(times), "target_floor_us": floor_us(floor, s.bandwidth),
           "target_floor_gb": floor / 1e9, "target_kv_len": kv_len, "target_experts": _mean_experts(tapped),
           "experts_measured": measured, "target_comm_us": collectives_us(s.parallel, comm.calls, s.device),
           "target_collectives": len(comm.calls),
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
            PassTap(s.target) as t_passes, PassTap(s.draft) as d_passes, CollectiveTap() as comm:
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
    floor = step_floor_bytes(s.rank_cfg, verify + drafts, len(prompts), kv_len, s.weight_bytes, kv_bytes)
    out = {"spec_us": statistics.median(times), "spec_floor_us": floor_us(floor, s.bandwidth),
           "spec_floor_gb": floor / 1e9, "verify_tokens": sum(p.tokens for p in verify),
           "draft_passes": len(drafts), "draft_tokens": sum(p.tokens for p in drafts),
           "verify_experts": _mean_experts(verify), "draft_experts": _mean_experts(drafts),
           "experts_measured": measured and d_measured, "spec_kv_len": kv_len,
           "spec_comm_us": collectives_us(s.parallel, comm.calls, s.device),
           "spec_collectives": len(comm.calls),
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
        "variant": s.variant, "backend": backend, "tp": s.parallel.size, "batch": batch, "topk": topk, "num_steps": cfg.num_steps,
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
        "target_comm_us": target["target_comm_us"], "spec_comm_us": spec["spec_comm_us"],
        "target_collectives": target["target_collectives"], "spec_collectives": spec["spec_collectives"],
        "bandwidth_gbs": s.bandwidth / 1e9, "model_gb": model_gb,
        "target_kv_gb": target["target_kv_gb"], "spec_kv_gb": spec["spec_kv_gb"],
        "captured_steps": spec["captured_steps"],
        "graph_mib": spec["graph_mib"], "graph_reserved_mib": spec["graph_reserved_mib"],
        "target_graph_mib": target["target_graph_mib"],
        "timing": "cuda_graphs" if s.cuda else "cpu_eager_smoke",
    }


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
    ap.add_argument("--no-token-table", action="store_true",
                    help="the MTP layer reads all of eh_proj (no per-token table of its embedding half)")
    ap.add_argument("--smoke", action="store_true", help="tiny dims on the CPU: every path but the CUDA timing")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor-parallel ranks, under torchrun --nproc-per-node N (NCCL; gloo with --smoke)")
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
    problem = launch_problem(args.tp, torch.device("cpu" if args.smoke else "cuda"))
    if problem:
        ap.error(f"--tp {args.tp}: {problem}")
    return args


def start_rank(args: argparse.Namespace) -> tuple[Parallel, str]:
    """This process's rank and device (specdec.parallel.start_ranks: --smoke on the CPU over gloo);
    ranks past 0 print nothing."""
    parallel, device = start_ranks(args.tp, torch.device("cpu" if args.smoke else "cuda"))
    if parallel.rank:
        sys.stdout = open(os.devnull, "w")
    return parallel, str(device)


def backend_refusal(backend: str, device: str) -> Optional[str]:
    """Why ``backend`` cannot run here (the registry's device check), or None."""
    try:
        SpecConfig(attention_backend=backend, page_size=PAGE_SIZE).cache_dtype(torch.bfloat16, torch.device(device))
    except ConfigError as err:
        return str(err)
    return None


class Run:
    """The rows so far (--csv rewritten after each), and the configurations that failed."""

    def __init__(self, args: argparse.Namespace, writes: bool = True) -> None:
        self.args, self.writes = args, writes
        self.rows = read_csv(args.csv) if args.append and args.csv.exists() else []
        self.failures = 0

    def emit(self, row: dict) -> None:
        self.rows[:] = [r for r in self.rows if row_key(r) != row_key(row)] + [row]
        if self.writes:
            write_csv(self.rows, self.args.csv)
        print(table_line(row), flush=True)

    def failed(self, what: str) -> None:
        self.failures += 1
        print(f"# {what} failed:\n{traceback.format_exc()}", flush=True)
        _free()


def run_variant(run: Run, variant: str, clock: StepClock, bandwidth: float, device: str, parallel: Parallel) -> None:
    """Every backend, batch and tree of one variant, on one model (this rank's shard)."""
    args = run.args
    kernels = kernel_counts(args, variant) if parallel.size == 1 else {}  # first: the child has the device to itself
    cfg = rank_slice_config(variant, args.layers, smoke=args.smoke)
    t0 = time.perf_counter()
    target, draft = build_models(cfg, torch.float32 if args.smoke else torch.bfloat16, device, parallel)
    mismatch = check_param_counts(target, draft, parallel.size)
    if mismatch:
        print(f"# WARNING: {mismatch}: the floors count the config's parameters")
    own = own_parameters(draft, target)
    model_gb = (param_bytes(target.parameters()) + param_bytes(own)) / 1e9
    if parallel.size == 1 and not args.no_token_table:
        print(f"# the MTP layer's per-token table: {draft.cache_token_projection() / 1e9:.2f} GB "
              "(eh_proj's embedding half; a draft pass reads the other half)", flush=True)
    print(f"# {variant}: {cfg.num_hidden_layers} layers ({len(moe_layer_ids(cfg))} MoE), built in "
          f"{time.perf_counter() - t0:.1f} s; parameters {param_bytes(target.parameters()) / 1e9:.2f} GB target + "
          f"{param_bytes(own) / 1e9:.2f} GB MTP layer", flush=True)
    s = Setup(variant, target, draft, device.startswith("cuda"), clock, bandwidth, args.iters, args.warmup,
              args.num_steps, args.num_draft_tokens)
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
            run.rows[:] = [r for r in run.rows if row_key(r) != row_key(row)] + [row]
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
    parallel, device = start_rank(args)
    cuda = device != "cpu"
    run = Run(args, writes=parallel.rank == 0)
    name = torch.cuda.get_device_name() if cuda else "CPU (smoke: eager, times are not measurements)"
    if parallel.size > 1:
        name += f", tensor parallel over {parallel.size} ranks"
    bw = read_bandwidth(device, (2 << 30) if cuda else (32 << 20), 20 if cuda else 3)
    print(f"device: {name}; read bandwidth {bw['floor'] / 1e9:.0f} GB/s (the fastest of "
          + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in bw.items() if k != "floor") + " GB/s)", flush=True)
    _free()
    clock = StepClock(cuda)
    print(table_line(None))
    for variant in args.variants:
        try:
            run_variant(run, variant, clock, bw["floor"], device, parallel)
        except Exception:
            run.failed(variant)
        _free()
    if clock.short_pads:
        print(f"# WARNING: {clock.short_pads} timed steps launched for longer than the spin before them: "
              "their times include idle device time (the spin doubled after each)")
    if run.rows and run.writes:
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
