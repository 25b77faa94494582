"""Paged MLA attention kernel benchmark: our Triton kernel vs FlashInfer FA3 and FlashMLA on one GPU.

    python -m benchmarks.mla_kernels [--out benchmarks/mla_kernels.png] [--quick] [--kv-dtype fp8]
                                     [--table-tokens 131072 [--kv-bound]] [--heads 4 --q-lens 1 4 16]
    python -m benchmarks.mla_kernels --sparse [--quick] [--kv-dtype fp8]   # DeepSeek-V3.2: benchmarks/mla_sparse.py

Every call is timed inside a CUDA graph (captured once, replayed many times, timed with CUDA events, a
replay queued ahead of the start event so the host's launch is not timed); the three kernels' samples
alternate (FlashMLA's columns are empty, with a printed reason, where flash_mla is missing), and the KV cache rotates between copies, ROTATE_BYTES a graph, so small cases do not run
from L2. Roofline = max(KV bytes / measured copy bandwidth, FLOPs / PEAK_FLOPS), with KV bytes =
tokens * 576 * 2 (--kv-dtype fp8: * 1) and FLOPs = tokens * heads * q_len * 1088 * 2. Columns beyond
the shape and plan: err / fa3_err / flashmla_err, each kernel's largest error on the first request's output against
an fp32 attention, relative to the largest output value (FlashMLA's fp8 decode takes fp8 queries, so
its error there holds their rounding); fa3_diff, the largest difference between ours and FA3's whole
outputs, on that scale; check (output_check, check_bound); targets, the
issue's targets that apply to the row and whether it meets them (targets), counted after the table;
sm_mhz and watts, the median SM clock and board power while our kernel's graph replays
(sustained_clock). Our kernels are programmatic dependent launches (SM90+): each is set up while the
kernel before it in the graph (its own previous call) drains, as it would be in an engine's step.

--table-tokens sizes the block tables for a longer context than the requests' (mla_paged_attention
plans a launch for the table's width unless given a max_kv_len); --kv-bound then plans each shape for
the bound the graph runner's kv-bound graphs would replay for it. --heads and --q-lens replace the
table's head counts (16, 128) and query lengths (1, 4), e.g. a tensor-parallel shard's heads. Prints
the table and writes it as CSV next to the PNG. benchmarks/mla_tuning.py retunes the kernels and
their planner on the same cases; results and their dates: docs/benchmarks.md.
"""
import argparse
import csv
import importlib
import itertools
import math
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

from attn.kernels.triton_mla.kernel import _launch, kv_plan_bounds, mla_paged_attention, plan_for, plan_min_chunk
from attn.kernels.triton_mla.plan import KernelConfig, TileShape, tile_shape

PEAK_FLOPS = 790e12  # bf16 dense, measured on H100/H200 here
PAGE_SIZE = 64
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
ROTATE_BYTES = 256 << 20  # rotate KV copies until this many bytes are touched per graph
MAX_ROTATIONS = 512  # (fp8 1 x 1k: 455 copies of 0.56 MiB)
SM_SCALE = 192 ** -0.5
TABLE_HEADS = (16, 128)  # the table's head counts and query lengths (--heads, --q-lens)
TABLE_Q_LENS = (1, 4)
ROOFLINE_TARGET_TOKENS = 128 * 1024  # batch x seq_len below which the table's rows are latency-bound (mla_tuning)


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written: the
    fastest of 20 copies, the ceiling the roofline needs (a median can read low on a drifting board,
    which would flatter every fraction of the roofline)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * num_bytes / min(times)


def capture(calls: list) -> torch.cuda.CUDAGraph:
    """`calls` (closures) run once on a side stream, then captured back to back in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _replays_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Microseconds of ``replays`` back-to-back replays; one more is queued before the start event,
    so that the GPU is busy when it records and the host's first launch is not timed."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def graph_times_us(*call_lists: list, min_calls: int = 200, samples: int = 5) -> list[float]:
    """Median microseconds per call of each list of ``calls`` (closures), each list captured back to
    back in one graph. The graphs' samples alternate (A B A B ...), so clock and heat drift reach
    each alike."""
    graphs = [capture(calls) for calls in call_lists]
    replays = [max(3, math.ceil(min_calls / len(calls))) for calls in call_lists]
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(samples):
        for graph, count, calls, taken in zip(graphs, replays, call_lists, times):
            taken.append(_replays_us(graph, count) / (count * len(calls)))
    del graphs
    return [statistics.median(taken) for taken in times]


def graph_time_us(calls: list, min_calls: int = 200) -> float:
    """Median microseconds per call of ``calls`` captured back to back in one graph."""
    return graph_times_us(calls, min_calls=min_calls)[0]


def sustained_clock(calls: list, seconds: float = 0.5) -> tuple[float, float]:
    """Median SM clock (MHz) and instantaneous board power (W) that nvidia-smi reads while the
    graph of `calls` replays back to back for `seconds`; NaN where nvidia-smi is missing or reads
    nothing (its plain power.draw averages over a second, longer than the load).

    Under load a board at its power cap lowers the SM clock, which the roofline's fixed PEAK_FLOPS
    does not see: the columns say how far below its own peak a row ran."""
    nan = (float("nan"), float("nan"))
    if shutil.which("nvidia-smi") is None:
        return nan
    graph = capture(calls)
    smi = subprocess.Popen(
        ["nvidia-smi", "-i", f"GPU-{torch.cuda.get_device_properties().uuid}",
         "--query-gpu=clocks.sm,power.draw.instant", "--format=csv,noheader,nounits", "-lms", "25"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()  # a short queue: the load ends when the sampling does
    smi.terminate()
    lines = smi.communicate()[0].splitlines()
    del graph
    # The first readings may predate the load; a field nvidia-smi cannot read ("[N/A]") is NaN.
    samples = [[float(v) if re.fullmatch(r"[\d.]+", v) else float("nan") for v in line.split(", ")]
               for line in lines[2:] if line.count(",") == 1]
    if not samples:
        return nan
    return tuple(statistics.median(column) for column in zip(*samples))


class Case:
    """Inputs of one shape: uniform requests, page size 64, shuffled pages, rotated KV copies in
    kv_dtype (bf16, or fp8 e4m3 with a unit scale). ``table_tokens``: block tables (and caches)
    that wide, as an engine's that span its longest context (default: the requests' length)."""

    def __init__(self, batch: int, seq_len: int, q_len: int, heads: int, kv_dtype: torch.dtype = torch.bfloat16,
                 table_tokens: int | None = None):
        self.batch, self.seq_len, self.q_len, self.heads = batch, seq_len, q_len, heads
        pages_per_req = math.ceil(seq_len / PAGE_SIZE)
        num_pages = batch * pages_per_req
        self.kv_row_bytes = 576 * kv_dtype.itemsize
        copy_bytes = num_pages * PAGE_SIZE * self.kv_row_bytes
        self.rotations = max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / copy_bytes)))
        table_pages = max(pages_per_req, math.ceil((table_tokens or 0) / PAGE_SIZE))
        # Rotation r's cache: its own num_pages pages, then (as far as the table's width needs, for
        # the plan bounds sequences by the cache too) the next rotations' and unfilled pages, which
        # it never reads.
        cache_pages = max(num_pages, table_pages)
        pool = torch.empty((self.rotations - 1) * num_pages + cache_pages, PAGE_SIZE, 576, device="cuda",
                           dtype=kv_dtype)
        pool[:self.rotations * num_pages] = torch.randn(self.rotations * num_pages, PAGE_SIZE, 576, device="cuda")
        page = PAGE_SIZE * 576
        self.kv_pool = pool.as_strided((self.rotations, cache_pages, PAGE_SIZE, 576), (num_pages * page, page, 576, 1))
        self.pages = torch.randperm(num_pages, device="cuda").to(torch.int32).view(batch, pages_per_req)
        self.block_tables = torch.nn.functional.pad(self.pages, (0, table_pages - pages_per_req))
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
        self.cu_seqlens_q = (torch.arange(batch + 1, device="cuda") * q_len).to(torch.int32)
        self.kv_indptr = (torch.arange(batch + 1, device="cuda") * pages_per_req).to(torch.int32)
        self.q = torch.randn(batch * q_len, heads, 576, device="cuda").to(torch.bfloat16)
        self.out = torch.empty(batch * q_len, heads, 512, device="cuda", dtype=torch.bfloat16)
        self.max_kv_len: int | None = None  # the launches' plan bound (mla_paged_attention); None: the tables'

    def bound_by_plans(self) -> None:
        """Plan for the smallest kv_plan_bounds bound that holds seq_len, as the graph runner's
        kv-bound graphs do (none: the tables' width)."""
        bounds = kv_plan_bounds(self.q, self.kv_pool[0], self.block_tables.shape[1], self.batch, self.q_len)
        self.max_kv_len = next((bound for bound in bounds if bound >= self.seq_len), None)

    def reference(self, rotation: int) -> torch.Tensor:
        """The first request's output over rotation ``rotation``'s cache in fp32 (causal within its
        q_len queries): ``[q_len, heads, 512]``."""
        kv = self.kv_pool[rotation][self.pages[0].long()].reshape(-1, 576)[:self.seq_len].float()
        scores = torch.einsum("qhd,kd->qhk", self.q[:self.q_len].float(), kv) * SM_SCALE
        position = self.seq_len - self.q_len + torch.arange(self.q_len, device="cuda")
        visible = torch.arange(self.seq_len, device="cuda")[None, :] <= position[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        return torch.einsum("qhk,kd->qhd", scores.softmax(-1), kv[:, :512])

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.seq_len * self.kv_row_bytes

    @property
    def flops(self) -> int:
        return self.batch * self.seq_len * self.heads * self.q_len * 1088 * 2

    def roofline_s(self, bandwidth: float) -> tuple[float, float]:
        """(KV bytes / copy bandwidth, FLOPs / PEAK_FLOPS) in seconds: the roofline is the larger."""
        return self.kv_bytes / bandwidth, self.flops / PEAK_FLOPS

    def plan(self):
        """(LaunchPlan, KernelConfig) mla_paged_attention launches this case with."""
        return plan_for(self.q, self.kv_pool[0], self.block_tables, self.q_len, self.max_kv_len)

    def plan_fields(self) -> dict:
        """The shape and what mla_paged_attention plans for it: the first columns of a table row."""
        plan, config = self.plan()
        return dict(batch=self.batch, seq_len=self.seq_len, q_len=self.q_len, heads=self.heads,
                    tile=f"{plan.tile.block_h}x{plan.tile.block_q}", splits=plan.num_splits,
                    kernel="wgmma" if config.wgmma else "triton")

    def triton_call(self, rotation: int):
        return lambda: mla_paged_attention(
            self.q, self.kv_pool[rotation], self.block_tables, self.seq_lens, self.cu_seqlens_q, self.q_len,
            SM_SCALE, out=self.out, max_kv_len=self.max_kv_len)

    def attention_call(self, rotation: int):
        """The attention kernel of triton_call alone, without the reduce of its split partials."""
        plan, config = self.plan()
        return lambda: _launch(
            self.q, self.kv_pool[rotation], self.block_tables, self.seq_lens, self.cu_seqlens_q, self.q_len,
            SM_SCALE, None, self.out, 1.0, plan.num_splits, plan.tile, config,
            plan_min_chunk(plan, config, self.heads, self.q_len), reduce=False)

    def launch_call(self, rotation: int, num_splits: int, config: KernelConfig, tile: TileShape | None = None):
        """Exactly num_splits chunks (min chunk = one tile) with the given launch config, on
        ``tile`` (default: tile_shape's)."""
        tile = tile or tile_shape(self.heads, self.q_len)
        return lambda: _launch(
            self.q, self.kv_pool[rotation], self.block_tables, self.seq_lens, self.cu_seqlens_q, self.q_len,
            SM_SCALE, None, self.out, 1.0, num_splits, tile, config, config.block_n)


def fa3_calls(case: Case):
    """FA3 run() closures over the rotated caches (planned once, outside any graph) and a function
    returning their output ``[T, H, 512]``."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    indptr, indices = case.kv_indptr.clone(), case.pages.flatten().clone()
    wrapper = BatchMLAPagedAttentionWrapper(
        workspace, use_cuda_graph=True, qo_indptr=case.cu_seqlens_q.clone(), kv_indptr=indptr,
        kv_indices=indices, kv_len_arr=case.seq_lens.clone(), backend="fa3")
    wrapper.plan(
        metadata=MLAPlanMetadata.csr(case.cu_seqlens_q, case.kv_indptr, case.pages.flatten(), case.seq_lens),
        num_heads=case.heads, head_dim_ckv=512, head_dim_kpe=64, page_size=PAGE_SIZE, causal=case.q_len > 1,
        sm_scale=SM_SCALE, q_data_type=torch.bfloat16, kv_data_type=case.kv_pool.dtype)
    out = torch.empty_like(case.out)
    # An fp8 cache takes its per-tensor scales at run(); ours are 1.
    scales = dict(ckv_scale=1.0, kpe_scale=1.0) if case.kv_pool.dtype == torch.float8_e4m3fn else {}
    calls = [lambda r=r: wrapper.run(query=case.q, kv_cache=case.kv_pool[r], out=out, **scales)
             for r in range(case.rotations)]
    calls[0]()
    return calls, lambda: out


def flashmla_calls(case: Case):
    """FlashMLA's dense decode (``flash_mla_with_kvcache``, legacy SM90 kernels; bf16, or its dense
    fp8 kernel with fp8 queries and unit descales) over the same caches and block tables, causal for
    q_len > 1, its split schedule made once outside any graph (as the flashmla backend makes it once
    a pass); and a function returning the output ``[T, H, 512]``."""
    from attn.backends.flashmla import load_flash_mla

    flash_mla = load_flash_mla()
    fp8 = case.kv_pool.dtype == torch.float8_e4m3fn
    schedule, _ = flash_mla.get_mla_metadata()
    schedule.tile_scheduler_metadata, schedule.num_splits = flash_mla.get_mla_decoding_metadata(
        case.seq_lens, case.q_len * case.heads, 1, case.heads, is_fp8_kvcache=fp8, use_legacy=True)
    q = case.q.view(case.batch, case.q_len, case.heads, 576)
    descales = {}
    if fp8:
        q = q.to(torch.float8_e4m3fn)
        one = torch.ones(1, dtype=torch.float32, device="cuda")
        descales = dict(descale_q=one, descale_k=one)
    out = []

    def call(rotation: int) -> None:
        result, _ = flash_mla.flash_mla_with_kvcache(
            q, case.kv_pool[rotation].unsqueeze(2), case.block_tables, case.seq_lens, 512, schedule,
            softmax_scale=SM_SCALE, causal=case.q_len > 1, is_fp8_kvcache=fp8, use_legacy=True, **descales)
        out[:] = [result]

    calls = [lambda r=r: call(r) for r in range(case.rotations)]
    calls[0]()
    return calls, lambda: out[0].view(case.batch * case.q_len, case.heads, 512)


RIVALS = {"fa3": fa3_calls, "flashmla": flashmla_calls}  # name -> closures and output of each rival kernel
NAN = float("nan")


def bench_case(case: Case, bandwidth: float, rivals: list[str]) -> dict:
    """One row: our kernel and each rival of ``rivals`` (RIVALS' names) timed alternately; a rival
    that fails is left out of the row with its reason printed (its columns NaN)."""
    ours_calls = [case.triton_call(r) for r in range(case.rotations)]
    built = {}
    for name in rivals:
        try:
            built[name] = RIVALS[name](case)
        except Exception as error:  # keep the other numbers; say why this one has none
            print(f"{name} failed: {type(error).__name__}: {error}")
    ours_us, *rival_us = graph_times_us(ours_calls, *(calls for calls, _ in built.values()))
    # Every graph ends with the last rotation: check the outputs their replays left.
    last = case.reference(case.rotations - 1)
    scale = last.abs().max().item()

    def relative_error(out: torch.Tensor) -> float:
        return (out[:case.q_len].float() - last).abs().max().item() / scale

    err = relative_error(case.out)
    memory_s, compute_s = case.roofline_s(bandwidth)
    memory_bound = memory_s >= compute_s
    roof_us = max(memory_s, compute_s) * 1e6
    row = dict(case.plan_fields(), triton_us=ours_us, gb_s=case.kv_bytes / ours_us / 1e3, roofline_us=roof_us,
               frac_roofline=roof_us / ours_us, bound="memory" if memory_bound else "compute",
               sm_mhz=NAN, watts=NAN, err=err, fa3_diff=NAN)
    for name in RIVALS:
        row.update({f"{name}_us": NAN, f"{name}_frac": NAN, f"speedup_vs_{name}": NAN, f"{name}_err": NAN})
    for (name, (_, output)), us in zip(built.items(), rival_us):
        row.update({f"{name}_us": us, f"{name}_frac": roof_us / us, f"speedup_vs_{name}": us / ours_us,
                    f"{name}_err": relative_error(output())})
    if "fa3" in built:
        row["fa3_diff"] = (case.out.float() - built["fa3"][1]().float()).abs().max().item() / scale
    row["check"] = output_check(err, row["fa3_err"], row["fa3_diff"], "fa3" in built)
    row["targets"] = targets(row)
    # Last: its half second at full load must not heat the board for any timing.
    row["sm_mhz"], row["watts"] = sustained_clock(ours_calls)
    return row


def check_bound(fa3_err: float) -> float:
    """The largest relative error ``check`` takes as rounding: 2**-7 (bf16 output, P and 16-bit
    partials each round at 2**-9), or twice FA3's own error on the row where that is more, up to
    2**-6 (a FA3 as far off does not excuse ours)."""
    return 2**-7 if math.isnan(fa3_err) else max(2**-7, min(2 * fa3_err, 2**-6))


def output_check(err: float, fa3_err: float, fa3_diff: float, with_fa3: bool) -> str:
    """"ok" where our first request's error is within check_bound and, where FA3 ran, the two whole
    outputs differ by at most twice that (both within it of the truth); a NaN anywhere is "BAD"."""
    bound = check_bound(fa3_err)
    return "ok" if err <= bound and (not with_fa3 or fa3_diff <= 2 * bound) else "BAD"


def targets(row: dict) -> str:
    """The issue's targets that apply to a row, each ``name:yes`` or ``name:no``: at least the speed
    of FA3 (``fa3``) and of FlashMLA (``flashmla``), each where it ran."""
    met = [(name, row[f"speedup_vs_{name}"] >= 1.0) for name in RIVALS if not math.isnan(row[f"speedup_vs_{name}"])]
    return " ".join(f"{name}:{'yes' if ok else 'no'}" for name, ok in met) or "-"


COLUMNS = [("batch", "{:>5}"), ("seq_len", "{:>7}"), ("q_len", "{:>5}"), ("heads", "{:>5}"), ("tile", "{:>5}"),
           ("splits", "{:>6}"), ("kernel", "{:>6}"),
           ("triton_us", "{:>9.1f}"), ("gb_s", "{:>7.0f}"), ("roofline_us", "{:>11.1f}"),
           ("frac_roofline", "{:>13.2f}"), ("bound", "{:>7}"), ("sm_mhz", "{:>6.0f}"), ("watts", "{:>5.0f}"),
           ("fa3_us", "{:>8.1f}"), ("fa3_frac", "{:>8.3f}"), ("speedup_vs_fa3", "{:>14.2f}"),
           ("flashmla_us", "{:>11.1f}"), ("flashmla_frac", "{:>13.3f}"), ("speedup_vs_flashmla", "{:>19.2f}"),
           ("err", "{:>7.4f}"), ("fa3_err", "{:>7.4f}"), ("flashmla_err", "{:>12.4f}"), ("fa3_diff", "{:>8.4f}"),
           ("check", "{:>5}"), ("targets", "{:<22}")]



def print_row(row: dict | None, columns: list = COLUMNS) -> None:
    """One table row of ``columns`` (name, format) from ``row``; None: the header."""
    if row is None:
        print(" ".join(f"{name:>{len(fmt.format(0))}}" for name, fmt in columns))
        return
    print(" ".join(fmt.format(row[name]) for name, fmt in columns), flush=True)


def plot(rows: list[dict], path: Path, kv_dtype: str, device_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"b{r['batch']} s{r['seq_len'] // 1024}k q{r['q_len']} h{r['heads']}" for r in rows]
    x = range(len(rows))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(12, len(rows) * 0.35), 9), sharex=True)
    kernels = [("frac_roofline", "ours (Triton / Gluon wgmma)"), ("fa3_frac", "FlashInfer FA3"),
               ("flashmla_frac", "FlashMLA")]
    for k, (column, label) in enumerate(kernels):
        top.bar([i + (k - 1) * 0.27 for i in x], [r[column] for r in rows], width=0.27, label=label)
    top.set_ylabel("fraction of roofline")
    top.legend()
    for k, (name, label) in enumerate([("fa3", "vs FA3"), ("flashmla", "vs FlashMLA")]):
        bottom.bar([i + (k - 0.5) * 0.4 for i in x], [r[f"speedup_vs_{name}"] for r in rows], width=0.4, label=label)
    bottom.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    bottom.set_ylabel("speedup (their us / ours)")
    bottom.legend()
    bottom.set_xticks(list(x))
    bottom.set_xticklabels(labels, rotation=90, fontsize=7)
    fig.suptitle(f"Paged MLA attention, page {PAGE_SIZE}, {kv_dtype} cache, CUDA graphs "
                 f"({device_name})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        help="PNG path (default benchmarks/mla_kernels[_fp8][_table<N>[_bounded]].png)")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bf16",
                        help="cache dtype of the table (fp8: e4m3; KV bytes in the roofline are 1 a value)")
    parser.add_argument("--table-tokens", type=int,
                        help="block tables this many tokens wide, as an engine's under CUDA graphs (default: "
                             "each shape's seq_len); our kernel plans for the width, FA3 for the lengths")
    parser.add_argument("--kv-bound", action="store_true",
                        help="plan each shape for the smallest kv_plan_bounds bound that holds its seq_len")
    parser.add_argument("--heads", type=int, nargs="+", default=list(TABLE_HEADS), help="head counts of the table")
    parser.add_argument("--q-lens", type=int, nargs="+", default=list(TABLE_Q_LENS),
                        help="query tokens a request, of the table")
    parser.add_argument("--sparse", action="store_true",
                        help="the sparse (DeepSeek-V3.2) table instead: benchmarks/mla_sparse.py")
    args = parser.parse_args()
    if args.sparse:
        if not torch.cuda.is_available():
            parser.error("this benchmark needs a CUDA GPU")
        from benchmarks import mla_sparse

        mla_sparse.main(args.quick, args.kv_dtype, args.out or Path("benchmarks/mla_sparse.png"))
        return
    if min(args.heads + args.q_lens) < 1:
        parser.error("--heads and --q-lens take positive counts")
    if args.quick and (args.heads != list(TABLE_HEADS) or args.q_lens != list(TABLE_Q_LENS)):
        parser.error("--quick times its own few shapes; --heads and --q-lens shape the full table")
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    suffix = ("_fp8" if args.kv_dtype == "fp8" else "") + (f"_table{args.table_tokens}" if args.table_tokens else "")
    suffix += "_bounded" if args.kv_bound else ""
    suffix += "" if args.heads == list(TABLE_HEADS) else "_heads" + "-".join(map(str, args.heads))
    suffix += "" if args.q_lens == list(TABLE_Q_LENS) else "_q" + "-".join(map(str, args.q_lens))
    args.out = args.out or Path(f"benchmarks/mla_kernels{suffix}.png")

    bandwidth = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    if args.table_tokens:
        print(f"block tables {args.table_tokens} tokens wide")
    if args.kv_bound:
        print("each shape planned for the smallest kv_plan_bounds bound that holds its seq_len")
    rivals = []
    for name, probe in (("fa3", "flashinfer.mla"), ("flashmla", "attn.backends.flashmla")):
        try:
            module = importlib.import_module(probe)
            if name == "flashmla":
                module.load_flash_mla()
            rivals.append(name)
        except ImportError as error:
            print(f"note: {name} not importable ({error}); its columns are empty")

    if args.quick:
        shapes = [(1, 1024, 1, 16), (1, 16384, 1, 16), (128, 16384, 1, 16), (32, 4096, 4, 128)]
    else:
        shapes = list(itertools.product([1, 8, 32, 128], [1024, 4096, 16384], args.q_lens, args.heads))
    rows = []
    print()
    print_row(None)
    for shape in shapes:
        case = Case(*shape, kv_dtype=KV_DTYPES[args.kv_dtype], table_tokens=args.table_tokens)
        if args.kv_bound:
            case.bound_by_plans()
        rows.append(bench_case(case, bandwidth, rivals))
        for name in [name for name in rivals if math.isnan(rows[-1][f"{name}_us"])]:  # e.g. a dtype it does not take
            rivals.remove(name)
            print(f"note: {name} failed (above); its columns stay empty for the remaining shapes")
        print_row(rows[-1])
        del case
        torch.cuda.empty_cache()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[name for name, _ in COLUMNS])
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out, args.kv_dtype, torch.cuda.get_device_name())
    print()
    for name in sorted({t.split(":")[0] for row in rows for t in row["targets"].split() if ":" in t}):
        met = [t.endswith(":yes") for row in rows for t in row["targets"].split() if t.startswith(f"{name}:")]
        print(f"target {name}: met on {sum(met)} of {len(met)} rows")
    bad = sum(row["check"] != "ok" for row in rows)
    print(f"outputs: {len(rows) - bad} of {len(rows)} rows within check's bound of the fp32 reference")
    print(f"wrote {args.out} and {args.out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
