"""Where a graphed step's device time goes, kernel by kernel (GPU): target-only decoding and the
spec step, on the example's model or the rank slice's, under torch.profiler over replays.

    python -m benchmarks.step_profile [--model example|dense|moe] [--layers 8] [--batch 1]
                                      [--backend triton_mla] [--out benchmarks/results/step_profile.png]

Per step kind: its kernels a step, the span from the first kernel's start to the last one's end,
the busy time (the kernels' own) and the median gap between kernels; then each kernel name's
count and time a step. ``dense`` / ``moe``: the rank slice of benchmarks/scale.py with random
weights and a 1k context; ``example``: examples/tiny_model, a 100-token prompt. Prints the tables,
writes the kernels as CSV and the top of each step kind as a PNG.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

from benchmarks.spec_step import write_table

KINDS = ("target", "spec")
TOP = 12  # kernel names a step kind's plot shows


def step_summary(spans: Sequence[tuple[str, float, float]]) -> dict:
    """One step's kernels (name, start, end in us) -> its kernel count, span, busy time, median
    gap and per-name (count, us). E.g. [("a", 0, 10), ("b", 10.5, 12), ("a", 12.1, 20)] -> 3
    kernels, span 20, busy 19.4, median gap 0.3, a: 2 kernels 17.9 us, b: 1 kernel 1.5 us."""
    ordered = sorted(spans, key=lambda s: s[1])
    per_name: dict[str, list[float]] = defaultdict(list)
    for name, start, end in ordered:
        per_name[name].append(end - start)
    gaps = [b[1] - a[2] for a, b in zip(ordered, ordered[1:])]
    return {"kernels": len(ordered), "span_us": ordered[-1][2] - ordered[0][1] if ordered else 0.0,
            "busy_us": sum(end - start for _, start, end in ordered),
            "gap_us": statistics.median(gaps) if gaps else 0.0,
            "names": {n: (len(d), sum(d)) for n, d in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))}}


def last_replay(spans: Sequence[tuple], reps: int) -> list[tuple]:
    """The last of ``reps`` replays' kernels: the final share of ``spans`` (sorted, every replay's
    kernels alike); [] when there are fewer spans than replays (the profiler dropped some)."""
    per = len(spans) // reps
    return list(spans[len(spans) - per:]) if per else []


def kernel_spans(step: Callable[[], object], reps: int = 3) -> list[tuple[str, float, float]]:
    """The last of ``reps`` calls' kernels (name, start, end in us) under torch.profiler, after
    three unprofiled calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
            torch.cuda.synchronize()
    return last_replay(sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                               if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda s: s[1]), reps)


def build(args: argparse.Namespace):
    """(target, draft, prompts) for the chosen model, on the GPU."""
    import torch

    if args.model == "example":
        from specdec.models import load_deepseek, load_mtp

        path = str(Path(__file__).resolve().parents[1] / "examples" / "tiny_model")
        target = load_deepseek(path, torch.bfloat16, torch.device("cuda"))
        draft = load_mtp(path, torch.bfloat16, torch.device("cuda"), target=target)
        context = 100
    else:
        from benchmarks.rank_slice import build_models, rank_slice_config

        target, draft = build_models(rank_slice_config(args.model, args.layers), torch.bfloat16, "cuda")
        context = 1024
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.config.vocab_size, (context,), generator=gen).tolist()
               for _ in range(args.batch)]
    return target, draft, prompts


def measure(args: argparse.Namespace) -> dict[str, dict]:
    import torch

    from specdec.baseline import GreedyDecoder
    from specdec.config import SpecConfig
    from specdec.worker import EagleWorker

    target, draft, prompts = build(args)
    out = {}
    with torch.inference_mode():
        decoder = GreedyDecoder(target, prompts, 64, backend=args.backend, page_size=64, cuda_graph=True)
        decoder.step()
        decoder.step()  # captures the step
        out["target"] = step_summary(kernel_spans(decoder.step))
        del decoder
        cfg = SpecConfig(num_steps=3, topk=1, attention_backend=args.backend, kv_dtype="bf16", page_size=64,
                         max_batch_size=args.batch, max_context_len=2048, cuda_graph_batch_sizes=[args.batch])
        worker = EagleWorker(target, draft, cfg)
        worker.add_requests(prompts, max_new_tokens=200)
        worker.step()
        worker.capture_graphs([args.batch], progress=False)
        out["spec"] = step_summary(kernel_spans(lambda: worker.finish_step(worker.launch_step())))
    return out


def report(results: dict[str, dict], out: Path, title: str) -> None:
    """Print each step kind's summary, then its kernels as a table and CSV (spec_step.write_table);
    the top of each as a PNG."""
    rows = []
    for kind, r in results.items():
        print(f"{kind}: {r['kernels']} kernels a step, span {r['span_us']:.0f} us, busy {r['busy_us']:.0f} us, "
              f"median gap {r['gap_us']:.2f} us")
        rows += [{"kind": kind, "kernel": name, "count": count, "us": round(us, 2)}
                 for name, (count, us) in r["names"].items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_table(rows, str(out))  # the kernels, as a table and CSV
    print(f"wrote {out.with_suffix('.csv')}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no PNG")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5), squeeze=False)
    for ax, (kind, r) in zip(axes[0], results.items()):
        top = list(r["names"].items())[:TOP]
        ax.barh([n[:40] for n, _ in top][::-1], [us for _, (_, us) in top][::-1])
        ax.set_title(f"{kind}: {r['kernels']} kernels, {r['busy_us']:.0f} of {r['span_us']:.0f} us busy")
        ax.set_xlabel("us a step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.png')}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("example", "dense", "moe"), default="example")
    ap.add_argument("--layers", type=int, default=8, help="the rank slice's decoder layers (default 8)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--backend", default="triton_mla")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/step_profile.png"))
    args = ap.parse_args(argv)
    if args.layers < 1 or args.batch < 1:
        ap.error("--layers and --batch must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.step_profile profiles graphed CUDA steps: it needs a GPU (none here)")
        return 1
    title = f"{args.model} model, batch {args.batch}, {args.backend}, graphed"
    report(measure(args), args.out, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
