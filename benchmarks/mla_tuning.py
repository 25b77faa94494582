"""Tuning tools for the paged MLA kernels, on benchmarks/mla_kernels.py's cases and timing.

    python -m benchmarks.mla_tuning --sweep | --plan-search | --breakdown | --profile

--sweep times alternative launch configurations and split counts on a few shapes (for retuning
select_config/plan_launch). --plan-search times, on the latency-bound shapes of the table, the
planned launch against every tile and split count (alternative_launches), to tell whether a missed
target is the planner's. --breakdown prints where the small launches' time goes: the attention
kernel alone against attention plus reduce, next to the time of an empty launch. --profile runs a
few shapes eagerly, to run under ncu.
"""

import argparse
import itertools

import torch
import triton
import triton.language as tl

from attn.kernels.triton_mla import wgmma as wgmma_tile
from attn.kernels.triton_mla.plan import MAX_ROWS, KernelConfig, LaunchPlan, TileShape, launch_config, next_pow2, select_config
from benchmarks.mla_kernels import (COLUMNS, ROOFLINE_TARGET_TOKENS, TABLE_HEADS, TABLE_Q_LENS, Case, copy_bandwidth,
                                    graph_time_us, graph_times_us, print_row)

_BREAKDOWN_GRID = 128  # programs of the empty launch that --breakdown times as the floor
# The shape and plan columns of the table, then the times of --breakdown.
_BREAKDOWN_COLUMNS = COLUMNS[:7] + [("full_us", "{:>8.2f}"), ("attention_us", "{:>12.2f}"), ("reduce_us", "{:>9.2f}")]


SWEEP = [  # (batch, seq_len, q_len, heads), split counts, KernelConfig fields
    ((1, 1024, 1, 16), [16, 32], [(32, 4, 2), (32, 8, 2)]),
    ((1, 16384, 1, 16), [64, 128], [(32, 4, 2), (64, 8, 2)]),
    ((8, 4096, 1, 16), [16, 32], [(32, 4, 2), (64, 4, 2)]),
    ((128, 4096, 1, 16), [1, 2], [(32, 4, 2), (64, 4, 2)]),
    ((8, 4096, 2, 16), [8, 16], [(32, 8, 2), (64, 8, 2)]),
    ((1, 16384, 1, 128), [32, 64, 128], [(64, 8, 2), (64, 8, 2, 1, True)]),
    ((32, 4096, 4, 16), [2, 4], [(64, 8, 2), (64, 8, 2, 1, True)]),
]


def sweep(bandwidth: float) -> None:
    """Time split counts x launch configs (Triton and, on 64-row tiles, wgmma kernels) on a few
    shapes (for retuning)."""
    print("\nsweep: shape, num_splits, config -> us (fraction of roofline)")
    for shape, splits_options, configs in SWEEP:
        case = Case(*shape)
        roof_us = max(case.roofline_s(bandwidth)) * 1e6
        for num_splits, fields in itertools.product(splits_options, configs):
            config = KernelConfig(*fields)
            try:
                us = graph_time_us([case.launch_call(r, num_splits, config) for r in range(case.rotations)])
                result = f"{us:8.1f} us ({roof_us / us:.2f})"
            except Exception as error:  # an oversized config fails to compile: report and go on
                result = f"failed: {type(error).__name__}: {str(error)[:80]}"
            kind = "wgmma" if config.wgmma else "triton"
            print(f"{shape} splits={num_splits:<3} {kind} n{config.block_n} w{config.num_warps} s{config.num_stages}: "
                  f"{result}", flush=True)
        del case
        torch.cuda.empty_cache()


PLAN_SEARCH_SPLITS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# The latency-bound shapes of the table (below ROOFLINE_TARGET_TOKENS, where FA3 sits below 0.4 of
# the roofline): (batch, seq_len, q_len, heads).
PLAN_SEARCH_SHAPES = [shape for shape in itertools.product([1, 8, 32], [1024, 4096, 16384], TABLE_Q_LENS, TABLE_HEADS)
                      if shape[0] * shape[1] < ROOFLINE_TARGET_TOKENS]


def alternative_launches(heads: int, seq_len: int, wgmma: bool,
                         planned_splits: int) -> list[tuple[TileShape, KernelConfig, int]]:
    """The launches --plan-search times against plan_launch's: every tile of 16, 32 and 64 rows
    (heads first, as tile_shape fills them: a 64-row tile on the wgmma kernel where it serves, as
    launch_config puts it) x every split count of PLAN_SEARCH_SPLITS and the planned one (whole
    waves of another SM count than 132 are not powers of two) whose chunks hold at least one kv
    tile of ``seq_len``."""
    launches = []
    for rows in (16, 32, MAX_ROWS):
        block_h = min(next_pow2(heads), rows)
        tile = TileShape(block_h, rows // block_h)
        config = launch_config(LaunchPlan(tile, select_config(tile), 1), wgmma)
        launches += [(tile, config, splits) for splits in sorted({*PLAN_SEARCH_SPLITS, planned_splits})
                     if seq_len // splits >= config.block_n]
    return launches


def plan_search() -> None:
    """On PLAN_SEARCH_SHAPES, time plan_launch's launch against alternative_launches' and print the
    planned launch next to the fastest three (their outputs checked like the table's)."""
    print("\nplan search: the planned launch against every tile x split count (us; tile splits kernel)")
    for shape in PLAN_SEARCH_SHAPES:
        case = Case(*shape)
        plan, config = case.plan()
        wgmma = wgmma_tile.supports(case.q, case.kv_pool[0])
        alternatives = alternative_launches(case.heads, case.seq_len, wgmma, plan.num_splits)
        call_lists = [[case.triton_call(r) for r in range(case.rotations)]]
        call_lists += [[case.launch_call(r, splits, alt_config, tile) for r in range(case.rotations)]
                       for tile, alt_config, splits in alternatives]
        times = []
        for first in range(0, len(call_lists), 8):  # a few graphs at a time: each holds its partials
            times += graph_times_us(*call_lists[first:first + 8], min_calls=100, samples=3)
        ranked = sorted(zip(times[1:], alternatives), key=lambda timed: timed[0])[:3]
        _, (tile, alt_config, splits) = ranked[0]
        case.launch_call(0, splits, alt_config, tile)()
        reference = case.reference(0)
        err = (case.out[:case.q_len].float() - reference).abs().max().item() / reference.abs().max().item()

        def label(tile: TileShape, config: KernelConfig, splits: int) -> str:
            return f"{tile.block_h}x{tile.block_q} {splits:>3} {'wgmma' if config.wgmma else 'triton'}"

        best = ", ".join(f"{label(*launch)} {us:.2f}" for us, launch in ranked)
        print(f"{shape}: planned {label(plan.tile, config, plan.num_splits)} {times[0]:.2f} | fastest {best} "
              f"| planned/fastest {times[0] / ranked[0][0]:.3f}, fastest's err {err:.4f}", flush=True)
        del case, call_lists
        torch.cuda.empty_cache()


@triton.jit
def _empty_kernel(flag_ptr):
    """A launch that does nothing but wait for the kernel before it (as ours do) and store a flag."""
    tl.extra.cuda.gdc_wait()
    tl.store(flag_ptr + tl.program_id(0), 1)


def breakdown() -> None:
    """Graph time of the default path against its attention kernel alone on the small-batch shapes
    (the difference: the reduce of the split partials), after the floor: the graph time of a
    programmatic dependent launch of a wave of empty programs. Meant for the latency-bound rows: on
    the longest ones the clock the power cap leaves moves either time by more than the reduce. Not
    for launches that discard their partials from L2 (plan_launch's discard_partials): the attention
    kernel alone leaves them to be written back, which the full path does not (reduce_us: nan)."""
    flag = torch.zeros(_BREAKDOWN_GRID, dtype=torch.int32, device="cuda")

    def empty():
        _empty_kernel[(_BREAKDOWN_GRID,)](flag, launch_pdl=True)

    floor = graph_time_us([empty] * 20)
    print(f"\nfloor: {floor:.2f} us a launch of {_BREAKDOWN_GRID} empty programs, back to back in a graph")
    print_row(None, _BREAKDOWN_COLUMNS)
    for shape in itertools.product([1, 8], [1024, 4096, 16384], [1, 4], [16, 128]):
        case = Case(*shape)
        full, attention = graph_times_us([case.triton_call(r) for r in range(case.rotations)],
                                         [case.attention_call(r) for r in range(case.rotations)])
        discards = case.plan()[0].discard_partials
        print_row(dict(case.plan_fields(), full_us=full, attention_us=attention,
                       reduce_us=float("nan") if discards else full - attention), _BREAKDOWN_COLUMNS)
        del case
        torch.cuda.empty_cache()


def profile() -> None:
    """Eager calls of the default path on a few shapes, to run under ncu."""
    for shape in [(1, 1024, 1, 16), (1, 16384, 1, 16), (8, 4096, 1, 16), (32, 4096, 4, 128)]:
        case = Case(*shape)
        for _ in range(2):
            case.triton_call(0)()
        torch.cuda.synchronize()
        del case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_mutually_exclusive_group(required=True)
    modes.add_argument("--sweep", action="store_true", help="time alternative configs and split counts")
    modes.add_argument("--plan-search", action="store_true",
                       help="time the planned launch of the latency-bound shapes against every tile and split count")
    modes.add_argument("--breakdown", action="store_true",
                       help="time the small-batch shapes' attention kernel alone and with the reduce")
    modes.add_argument("--profile", action="store_true", help="run a few shapes eagerly (for ncu)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("these tools need a CUDA GPU")
    if args.sweep:
        sweep(copy_bandwidth())
    elif args.plan_search:
        plan_search()
    elif args.breakdown:
        breakdown()
    else:
        profile()


if __name__ == "__main__":
    main()
