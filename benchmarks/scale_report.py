"""benchmarks/scale.py's output: its CSV (rewritten after every row, merged by configuration), the
printed table and the PNG."""

from __future__ import annotations

import csv
import math
import traceback
from pathlib import Path
from typing import Optional


COLUMNS = ["variant", "backend", "batch", "topk", "target_us", "spec_us", "target_floor_frac", "spec_floor_frac",
           "kernels_per_layer", "spec_over_target"]
# (column, width, format) of the printed table
TABLE = [("variant", 7, "{}"), ("backend", 14, "{}"), ("tp", 2, "{}"), ("batch", 5, "{}"), ("topk", 4, "{}"), ("ndt", 3, "{}"),
         ("target_us", 9, "{:.0f}"), ("t_floor", 7, "{:.0f}"), ("t_frac", 6, "{:.2f}"), ("spec_us", 9, "{:.0f}"),
         ("s_floor", 7, "{:.0f}"), ("s_frac", 6, "{:.2f}"), ("spec/tgt", 8, "{:.2f}"), ("L2.5", 5, "{:.2f}"),
         ("L3.0", 5, "{:.2f}"), ("L3.5", 5, "{:.2f}"), ("kern/layer", 10, "{:.0f}"), ("experts v/d", 11, "{}"),
         ("comm t/s us", 11, "{}")]


def table_line(row: Optional[dict]) -> str:
    """The printed table's header (None) or one row."""
    if row is None:
        return " ".join(f"{name:>{width}}" for name, width, _ in TABLE)
    values = [row["variant"], row["backend"], row.get("tp", 1), row["batch"], row["topk"], row["num_draft_tokens"], row["target_us"],
              row["target_floor_us"], row["target_floor_frac"], row["spec_us"], row["spec_floor_us"],
              row["spec_floor_frac"], row["spec_over_target"], row["speedup_L2.5"], row["speedup_L3.0"],
              row["speedup_L3.5"], row["kernels_per_layer"], _experts_text(row), _comm_text(row)]
    return " ".join(f"{fmt.format(v):>{width}}" for (_, width, fmt), v in zip(TABLE, values))


def _experts_text(row: dict) -> str:
    """Mean distinct experts a MoE layer, verify / draft ("-": a dense model)."""
    verify, draft = (row.get(k) for k in ("verify_experts", "draft_experts"))
    number = [isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) for v in (verify, draft)]
    if not number[0]:
        return "-"
    return f"{verify:.1f}/{draft:.1f}" if number[1] else f"{verify:.1f}/-"


def _comm_text(row: dict) -> str:
    """The target and spec step's tensor-parallel collectives, us ("-": one rank)."""
    target, spec = (row.get(k) for k in ("target_comm_us", "spec_comm_us"))
    if int(row.get("tp", 1)) == 1 or not isinstance(target, (int, float)):
        return "-"
    return f"{target:.0f}/{spec:.0f}"


# ---------------------------------------------------------------------------------------- output
def row_key(row: dict) -> tuple:
    """A row's configuration: variant, backend, tensor-parallel ranks (1 in rows from before --tp), batch, topk."""
    return tuple(str(row.get(k, 1)) for k in ("variant", "backend", "tp", "batch", "topk"))


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
