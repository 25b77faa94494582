"""Launch gaps inside replayed CUDA graphs: the time from one kernel's end to the next one's start,
as a process captures more graphs (GPU). docs/benchmarks.md ("Launch gaps in CUDA graphs") has
what it showed on an H200: a process's first graphs replay with ~0 us between kernels, and from
about the fourth on every graph, the first included, with ~0.4 us; a spec step runs in that state.

    python -m benchmarks.graph_gaps [--graphs 8] [--layers 20] [--variants plain,keep,pool,event,write,free,small]
                                    [--out benchmarks/results/graph_gaps.png]

Each graph replays ``layers`` GEMV + RMS-norm pairs of the rank slice's hidden size (7168). The
variants test what could switch the state, each in a process of its own: ``plain`` (torch's
defaults), ``keep`` (keep_graph=True, instantiated on first replay), ``pool`` (every capture in
one memory pool, as GraphRunner's), ``event`` (mid-graph, a copy to pinned memory and an external
event record: the step's host copy before), ``write`` (the same with a kernel writing the pinned
memory: HostCopy's now), ``free`` (each graph freed before the next is captured; the others keep
every graph), ``small`` (three one-kernel graphs captured first).
Rows: the newest graph's replay time (taken before any profiling of it), its median gap, and the
first graph's gap again. Prints a table, writes CSV and a PNG.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from benchmarks.spec_step import write_table
from benchmarks.step_profile import kernel_spans, step_summary

VARIANTS = ("plain", "keep", "pool", "event", "write", "free", "small")
HIDDEN = 7168
FIELDS = ("variant", "graph", "alive", "gap_us", "first_gap_us", "replay_us")


def _replay_us(replay, reps: int = 20) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def run_variant(variant: str, graphs: int, layers: int) -> list[dict]:
    """Capture ``graphs`` graphs of the chain one after another in this process, as ``variant``
    says; a row per capture."""
    import torch

    from specdec.models import gemv, ops
    from specdec.step_kernels import rows_to_host

    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN ** -0.5
    norm = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    event = torch.cuda.Event(external=True)
    pinned = torch.empty(1, 8, dtype=torch.long, pin_memory=True)
    report = torch.zeros(1, 8, dtype=torch.long, device="cuda")

    def chain() -> torch.Tensor:
        h = x
        for i in range(layers):
            h = ops.rms_norm(gemv.linear(h, w), norm, 1e-6)[0]
            if variant in ("event", "write") and i == layers // 2:
                if variant == "event":
                    pinned.copy_(report, non_blocking=True)
                else:
                    rows_to_host(report, pinned)
                event.record()
        return h

    chain()
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle() if variant == "pool" else None
    small = []
    for _ in range(3 if variant == "small" else 0):
        small.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(small[-1]):
            x.add_(0)
    alive, rows = [], []
    for i in range(graphs):
        if variant == "free" and alive:
            del graph
            alive.clear()
            torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=variant == "keep")
        with torch.cuda.graph(graph, pool=pool):
            chain()
        alive.append(graph)
        replay_us = _replay_us(graph.replay)
        gap = step_summary(kernel_spans(graph.replay))["gap_us"]
        first = step_summary(kernel_spans(alive[0].replay))["gap_us"] if alive[0] is not graph else gap
        rows.append({"variant": variant, "graph": i, "alive": len(alive), "gap_us": round(gap, 3),
                     "first_gap_us": round(first, 3), "replay_us": round(replay_us, 1)})
    return rows


CHILD_TIMEOUT_S = 300


def _in_child(variant: str, graphs: int, layers: int) -> list[dict]:
    """run_variant in a process of its own, from the repository root; [] with the child's error
    printed if it fails (the other variants still run)."""
    code = (f"import json; from benchmarks.graph_gaps import run_variant; "
            f"print(json.dumps(run_variant({variant!r}, {graphs}, {layers})))")
    root = Path(__file__).resolve().parents[1]
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"# {variant}: no result in {CHILD_TIMEOUT_S} s")
        return []
    if done.returncode != 0:
        print(f"# {variant} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        return []
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rows: list[dict], out: Path) -> None:
    """Print the table and write ``out`` with .csv (spec_step.write_table); the PNG where matplotlib
    is installed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_table(rows, str(out))
    print(f"wrote {out.with_suffix('.csv')}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        ax.plot([r["graph"] for r in mine], [r["gap_us"] for r in mine], marker="o", label=variant)
    ax.set_xlabel("graphs captured before it")
    ax.set_ylabel("median gap between kernels, us")
    ax.set_title("Launch gaps in replayed CUDA graphs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.png')}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=int, default=8, help="graphs each variant captures (default 8)")
    ap.add_argument("--layers", type=int, default=20, help="GEMV + norm pairs a graph replays (default 20)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/graph_gaps.png"))
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.graphs < 1 or args.layers < 1:
        ap.error("--graphs and --layers must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.graph_gaps measures CUDA graphs: it needs a GPU (none here)")
        return 1
    rows = [row for v in args.variants for row in _in_child(v, args.graphs, args.layers)]
    if not rows:
        return 1
    report(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
