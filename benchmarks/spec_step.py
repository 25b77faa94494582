"""Spec-step benchmark: eager vs CUDA graphs per backend and batch size (GPU).

    python benchmarks/spec_step.py --out benchmarks/spec_step.png

Per backend and batch size: step time eager and with graphs, host time per step (launch: pages,
inputs, host plans, the replay; finish: the bookkeeping after the step's one copy to the host;
the median step of the fastest of HOST_ROUNDS rounds, that round's mean of launch + finish, and
its median thread CPU time, which leaves out time spent waiting for a core),
host syncs in launch_step (torch's sync debug mode: implicit copies to the host and stream
syncs; finish_step then waits on the step's one event by design), mean accept length, tokens/s
with spec decoding (graphs where supported) and target-only (graphed where the spec step is); then
graph capture time and memory. Uses the identity draft (the target as its own standalone draft)
so nearly every step accepts num_steps tokens and the numbers show the machinery's cost, not a
draft model's quality. --sampling: every request samples (SAMPLING) through tree rejection
sampling, and the identity draft then accepts less. Prints a table, writes CSV and a PNG; results
and their dates: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import statistics
import time
import warnings

import torch

from specdec.baseline import GreedyDecoder
from specdec.config import SpecConfig
from specdec.draft import StandaloneDraft
from specdec.models import DeepseekV3Config, DeepseekV3ForCausalLM
from specdec.sampling import SamplingParams
from specdec.worker import EagleWorker


def bench_model() -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=4096, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=16, q_lora_rank=384, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=4, max_position_embeddings=4096,
    )
    return DeepseekV3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


HOST_ROUNDS = 3  # rounds of host-timed steps; the round with the lowest median counts


def max_new_tokens(steps: int) -> int:
    """Room for warm-up, timed, host-timed and sync-counting steps at 4 tokens a step (num_steps 3)."""
    return 4 * ((1 + HOST_ROUNDS) * steps + 5)


def count_syncs(fn) -> int:
    """Host syncs ``fn`` performs, as torch's sync debug mode reports them: implicit copies to the
    host and stream syncs (not CUDA event waits, nor syncs inside other libraries' C++)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


SAMPLING = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)  # --sampling's, every request (seed i: request i)


def time_steps(worker: EagleWorker, prompts: list[list[int]], steps: int) -> dict[str, float]:
    sampling = None
    if worker.config.enable_sampling:
        sampling = [dataclasses.replace(SAMPLING, seed=i) for i in range(len(prompts))]
    worker.add_requests(prompts, max_new_tokens=max_new_tokens(steps), sampling=sampling)
    for _ in range(3):
        worker.step()
    torch.cuda.synchronize()
    gc.collect()
    gc.freeze()  # as an engine would after start-up: no full collection walks the models mid-run
    accept, emitted = [], 0
    start = time.perf_counter()
    for _ in range(steps):
        stats = worker.step()
        accept += stats.accept_lens
        emitted += stats.num_emitted
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    rounds = []
    for _ in range(HOST_ROUNDS):  # host work alone: the GPU is drained before the bookkeeping is timed
        launch, finish, cpu = [], [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            result = worker.launch_step()
            launch.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.thread_time()
            worker.finish_step(result)
            finish.append(time.perf_counter() - t0)
            cpu[-1] += time.thread_time() - c0
        rounds.append((launch, finish, cpu))
    # A host's speed can drift over seconds (docs/benchmarks.md: the spec step's host time): the round
    # with the lowest median step is the host work, not the drift.
    # The thread's CPU time (host_cpu_us) leaves out the time the thread waited for a core.
    launch, finish, cpu = min(rounds, key=lambda r: statistics.median(a + b for a, b in zip(*r[:2])))
    launched = []
    syncs = count_syncs(lambda: launched.append(worker.launch_step()))  # the step's device work, enqueued
    worker.finish_step(launched[0])
    replay = [float("nan")]
    if worker.graph_runner is not None:  # the floor of launch: the bucket's graph launch alone (no kv bound)
        replay, bucket = [], worker.graph_runner.buckets[0]
        for _ in range(steps):  # (runs the device state past the host's view, within max_context_len: last)
            t0 = time.perf_counter()
            worker.graph_runner.replay(bucket)
            replay.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
    gc.unfreeze()
    worker.abort(worker.requests)
    # Medians per step: a host's scheduler adds spikes to single steps. The mean of launch + finish
    # (host_mean_us) also carries the rare page-crossing steps.
    host = [a + b for a, b in zip(launch, finish)]
    return {"step_ms": wall / steps * 1e3, "replay_us": statistics.median(replay) * 1e6,
            "launch_us": statistics.median(launch) * 1e6, "finish_us": statistics.median(finish) * 1e6,
            "host_us": statistics.median(host) * 1e6, "host_mean_us": statistics.mean(host) * 1e6,
            "host_cpu_us": statistics.median(cpu) * 1e6, "launch_syncs": syncs,
            "accept": sum(accept) / len(accept), "tok_s": emitted / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="triton_mla,torch_ref,flashinfer_mla,flashmla")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--sampling", action="store_true", help=f"tree rejection sampling at {SAMPLING}, not greedy")
    ap.add_argument("--out", default="benchmarks/spec_step.png")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    target = bench_model()
    vocab = target.config.vocab_size
    rows = []
    for backend in args.backends.split(","):
        for bs in batch_sizes:
            prompts = torch.randint(0, vocab, (bs, args.prompt_len)).tolist()
            cfg = SpecConfig(num_steps=3, attention_backend=backend, draft_mode="standalone", kv_dtype="bf16", page_size=64,
                             enable_sampling=args.sampling, max_batch_size=bs, max_context_len=128 * ((args.prompt_len + max_new_tokens(args.steps) + 4 * args.steps + 64 + 127) // 128))
            try:
                row = run_one(target, backend, bs, cfg, prompts, args.steps)
            except torch.OutOfMemoryError:  # torch_ref gathers whole contexts per query token
                print(f"# {backend} batch {bs}: out of memory, skipped")
                torch.cuda.empty_cache()
                continue
            rows.append(row)
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        if backend != "torch_ref":
            capture_all(target, backend, max(batch_sizes), args.prompt_len)
    _report(rows, args.out)


@torch.inference_mode()
def capture_all(target, backend: str, max_bs: int, prompt_len: int) -> None:
    """Capture every default bucket up to max_bs (one graph of the step's three stages each);
    prints time and pool memory."""
    cfg = SpecConfig(num_steps=3, attention_backend=backend, draft_mode="standalone", kv_dtype="bf16", page_size=64,
                     max_batch_size=max_bs, max_context_len=128 * ((prompt_len + 256 + 127) // 128))
    worker = EagleWorker(target, StandaloneDraft(target), cfg)
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    runner = worker.capture_graphs(progress=False)
    print(f"# {backend}: captured {len(runner.captured)} graphs for buckets {runner.buckets} in "
          f"{runner.capture_seconds:.2f} s, {(torch.cuda.memory_allocated() - before) / 2**20:.0f} MiB", flush=True)


@torch.inference_mode()
def run_one(target, backend: str, bs: int, cfg: SpecConfig, prompts: list[list[int]], steps: int) -> dict:
    """One table row: eager and graph steps, capture cost, and target-only decoding (graphed
    when the spec step is)."""
    eager = time_steps(EagleWorker(target, StandaloneDraft(target), cfg), prompts, steps)
    graph, capture_s, capture_mb = None, float("nan"), float("nan")
    worker = EagleWorker(target, StandaloneDraft(target), cfg)
    try:
        before = torch.cuda.memory_allocated()
        runner = worker.capture_graphs([bs], progress=False)
        capture_s, capture_mb = runner.capture_seconds, (torch.cuda.memory_allocated() - before) / 2**20
        graph = time_steps(worker, prompts, steps)
    except ValueError as err:
        print(f"# {backend}: no graphs ({err})")
    best = graph or eager
    return {
        "backend": backend, "batch": bs, "eager_ms": eager["step_ms"], "graph_ms": graph["step_ms"] if graph else float("nan"),
        "speedup": eager["step_ms"] / graph["step_ms"] if graph else float("nan"),
        **{k: best[k] for k in ("replay_us", "launch_us", "finish_us", "host_us", "host_mean_us", "host_cpu_us")},
        "launch_syncs": best["launch_syncs"], "accept": best["accept"], "spec_tok_s": best["tok_s"],
        "target_tok_s": target_only_tok_s(target, prompts, backend, graph is not None), "capture_s": capture_s, "capture_MiB": capture_mb,
    }


def target_only_tok_s(target, prompts: list[list[int]], backend: str, cuda_graph: bool, steps: int = 64) -> float:
    """Decode tokens/s of target-only greedy decoding in its steady state: ``steps`` steps of a
    GreedyDecoder after its eager warm-up and capture, timed together, so that neither the
    capture's garbage collection nor the prefill's jitter enters the time."""
    decoder = GreedyDecoder(target, prompts, steps + 3, backend=backend, page_size=64, cuda_graph=cuda_graph)
    for _ in range(2):
        decoder.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    torch.cuda.synchronize()
    return len(prompts) * steps / (time.perf_counter() - start)


def write_table(rows: list[dict], out: str) -> None:
    """The rows as a markdown table on stdout and as CSV beside the plot ``out``."""
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    with open(out.rsplit(".", 1)[0] + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)


def _report(rows: list[dict], out: str) -> None:
    write_table(rows, out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for backend in dict.fromkeys(r["backend"] for r in rows):
        rs = [r for r in rows if r["backend"] == backend]
        bss = [r["batch"] for r in rs]
        axes[0].plot(bss, [r["eager_ms"] for r in rs], "o--", label=f"{backend} eager")
        axes[0].plot(bss, [r["graph_ms"] for r in rs], "o-", label=f"{backend} graphs")
        axes[1].plot(bss, [r["spec_tok_s"] for r in rs], "o-", label=f"{backend} spec")
        axes[1].plot(bss, [r["target_tok_s"] for r in rs], "x:", label=f"{backend} target-only")
    for ax, title in zip(axes, ("step time (ms)", "tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
