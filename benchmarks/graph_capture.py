"""What the spec step's CUDA graphs cost at start-up: graphs, capture seconds and memory per
context length, with the kv-bound graphs (GraphRunner's default) and without (GPU). alloc_MiB:
what capturing adds to torch.cuda.memory_allocated, the graphs' own tensors and cuBLAS's
workspace (32 MiB on SM90); reserved: to memory_reserved once
the cache is emptied (the segments the graphs' pool holds, and that workspace).

    python -m benchmarks.graph_capture [--contexts 4096,32768] [--backend triton_mla]
                                       [--out benchmarks/results/graph_capture.png]

The bench model of benchmarks/spec_step.py, num_steps 3, batch buckets up to 64. Each
configuration runs in a process of its own, after a warm-up process of the same configuration
(Triton's compiles of new plans land in its disk cache there): in one process, the blocks of a
freed graph pool would serve the next runner's capture and hide its memory. Prints a table,
writes CSV and a PNG; results and their dates: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MAX_BATCH_SIZE = 64


def capture(backend: str, context: int, kv_bounds: bool) -> dict:
    """Build a worker and capture its GraphRunner in this process: one table row."""
    import gc

    import torch

    from benchmarks.spec_step import bench_model
    from specdec.config import SpecConfig
    from specdec.draft import StandaloneDraft
    from specdec.worker import EagleWorker

    target = bench_model()
    cfg = SpecConfig(num_steps=3, attention_backend=backend, draft_mode="standalone", kv_dtype="bf16", page_size=64,
                     max_batch_size=MAX_BATCH_SIZE, max_context_len=context)
    worker = EagleWorker(target, StandaloneDraft(target), cfg)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before, before_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    with torch.inference_mode():
        runner = worker.capture_graphs(progress=False, kv_bounds=kv_bounds)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()  # what stays reserved: the graphs' pool segments and cuBLAS's workspace
    bounds = {bs: b[:-1] for bs, b in runner.kv_bounds.items() if len(b) > 1}
    return {"backend": backend, "context": context, "kv_bounds": kv_bounds,
            "graphs": len(runner.captured), "capture_s": round(runner.capture_seconds, 2),
            "alloc_MiB": round((torch.cuda.memory_allocated() - before) / 2**20),
            "reserved_MiB": round((torch.cuda.memory_reserved() - before_reserved) / 2**20),
            "bounds": " ".join(f"{bs}:{'/'.join(map(str, b))}" for bs, b in bounds.items()) or "-"}


def _in_child(backend: str, context: int, kv_bounds: bool) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.graph_capture", "--child", backend, str(context), str(int(kv_bounds))]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout  # stderr passes through
    return json.loads(out.splitlines()[-1])


def _report(rows: list[dict], out: str) -> None:
    from benchmarks.spec_step import write_table

    write_table(rows, out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    contexts = sorted({r["context"] for r in rows})
    for offset, kv_bounds in ((-0.2, False), (0.2, True)):
        rs = {r["context"]: r for r in rows if r["kv_bounds"] == kv_bounds}
        for ax, key in zip(axes, ("graphs", "capture_s", "alloc_MiB")):
            ax.bar([i + offset for i in range(len(contexts))], [rs[c][key] for c in contexts], width=0.4,
                   label="kv-bound graphs" if kv_bounds else "longest context only")
    for ax, title in zip(axes, ("graphs", "capture (s)", "allocated by capture (MiB)")):
        ax.set_xticks(range(len(contexts)), [f"{c // 1024}k" for c in contexts])
        ax.set_xlabel("max_context_len")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--backend", default="triton_mla")
    ap.add_argument("--out", default="benchmarks/results/graph_capture.png")
    ap.add_argument("--child", nargs=3, metavar=("BACKEND", "CONTEXT", "KV_BOUNDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    if args.child:
        backend, context, kv_bounds = args.child
        print(json.dumps(capture(backend, int(context), kv_bounds == "1")))
        return
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for kv_bounds in (False, True):
            _in_child(args.backend, context, kv_bounds)  # warm-up
            rows.append(_in_child(args.backend, context, kv_bounds))
            print(rows[-1], flush=True)
    _report(rows, args.out)


if __name__ == "__main__":
    main()
