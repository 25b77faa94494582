"""The grouped GEMM's tile sweep (GPU), for retuning moe_kernels.tiles_for' decode (16-row) tiles.

    python -m benchmarks.moe_tiles [--tokens 1,4,32,128] [--csv benchmarks/results/moe_tiles.csv]

At the rank slice's MoE shapes (E 256, D 7168, I 256, k 8, bf16), for each token count and each
(N tile, K tile, warps, stages) of either kernel: a CUDA graph of 24 calls, each with its own
uniform random routing (so the weights rotate past L2), replayed (mla_kernels.graph_time_us); us
a call, against the floor of the chosen experts' weight bytes at 4300 GB/s. Also the shared expert's two
GEMVs (gemv.linear; silu_mul, then gemv.linear) against a 9th routed block at today's tiles. Compiles run
first in 16 processes (Triton's disk cache), so a sweep of ~90 configurations takes 1-2 minutes.
Prints each kernel's six best a token count and today's tiles; the CSV has every row.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import multiprocessing as mp
import statistics

import torch

from benchmarks.mla_kernels import graph_time_us

E, D, I, K = 256, 7168, 256, 8
CALLS = 24  # calls in a graph, each with its own routing
BANDWIDTH = 4.3e12  # B/s: the GEMV sweep's measured read bandwidth (docs/benchmarks.md)
SMEM = 200_000  # bytes of pipelined tiles a configuration may take


def configs() -> list[tuple[str, int, int, int, int]]:
    """(kernel, N tile, K tile, warps, stages): "gu" the gate/up kernel, "dn" the down kernel."""
    out = []
    for n, k, (w, s) in itertools.product((16, 32, 64), (64, 128, 256, 512), ((4, 3), (4, 4), (4, 5), (8, 4), (2, 4))):
        if (2 * k * n + 16 * k) * 2 * s <= SMEM:
            out.append(("gu", n, k, w, s))
    for n, k, (w, s) in itertools.product((32, 64, 128, 256), (64, 128, 256), ((4, 2), (4, 3), (4, 4), (8, 3), (8, 2))):
        if (k * n + 16 * k) * 2 * s <= SMEM:
            out.append(("dn", n, k, w, s))
    return out


def setup(num_experts: int, tokens: int, calls: int, seed: int = 0, top_k: int = K):
    """Random expert weights and ``calls`` routings of ``tokens`` tokens: (gate_up, down, work)."""
    from specdec.models import moe_kernels as mk
    gen = torch.Generator().manual_seed(seed + tokens)
    gu = torch.randn(num_experts, 2 * I, D, dtype=torch.bfloat16, device="cuda") * 0.02
    dn = torch.randn(num_experts, D, I, dtype=torch.bfloat16, device="cuda") * 0.02
    work = []
    for _ in range(calls):
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]).cuda()
        x = torch.randn(tokens, D, dtype=torch.bfloat16, device="cuda")
        blocks = (mk.single_token_blocks if tokens == 1 else mk.sort_into_blocks)(ids, num_experts, 16)
        h = x.new_empty(blocks.row_pair.numel(), I)
        out = torch.empty(blocks.num_pairs, D, dtype=torch.float32, device="cuda")
        work.append((x, torch.rand(tokens * top_k, device="cuda"), blocks, h, out))
    return gu, dn, work


def launch(cfg, gu: torch.Tensor, dn: torch.Tensor, item) -> None:
    """One kernel of grouped_experts with ``cfg``'s tiles (its launch, with the tiles as arguments)."""
    import triton
    from specdec.models import moe_kernels as mk
    kind, n, k, w, s = cfg
    x, weights, blocks, h, out = item
    if kind == "gu":
        mk._gate_up_kernel[(blocks.num_blocks, triton.cdiv(I, n))](
            x, gu, h, blocks.row_pair, blocks.block_expert, blocks.num_pairs, gu.shape[0], D, I,
            x.stride(0), gu.stride(0), gu.stride(1), h.stride(0),
            TOP_K=blocks.top_k, BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, PRECISION="tf32", num_warps=w, num_stages=s)
    else:
        mk._down_kernel[(blocks.num_blocks, triton.cdiv(D, n))](
            h, dn, out, weights, blocks.row_pair, blocks.block_expert, blocks.num_pairs, dn.shape[0], D, I,
            h.stride(0), dn.stride(0), dn.stride(1), out.stride(0),
            BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, PRECISION="tf32", num_warps=w, num_stages=s)


def _warm(job) -> None:
    """Compile ``cfgs`` at each token count's specialisation (16 experts: the same divisibility)."""
    cfgs, token_counts = job
    for tokens in token_counts:
        gu, dn, work = setup(16, tokens, 1)
        for cfg in cfgs:
            try:
                launch(cfg, gu, dn, work[0])
            except Exception:  # out of resources: the timing pass reports it as inf
                pass
    torch.cuda.synchronize()


def sweep(token_counts: list[int]) -> list[dict]:
    from specdec.models import moe_kernels as mk
    cfgs = configs()
    with mp.get_context("spawn").Pool(16) as pool:
        pool.map(_warm, [(cfgs[i::16], token_counts) for i in range(16)])
    rows = []
    for tokens in token_counts:
        gu, dn, work = setup(E, tokens, CALLS)
        today = mk.tiles_for(tokens * K, E, D, I, torch.bfloat16)
        current = {("gu", today.n1, today.k1, today.warps1, today.stages1),
                   ("dn", today.n2, today.k2, today.warps2, today.stages2)}
        blocks = statistics.mean(int((item[2].block_expert < E).sum()) for item in work)
        floors = {"gu": blocks * 2 * I * D * 2 / BANDWIDTH * 1e6, "dn": blocks * I * D * 2 / BANDWIDTH * 1e6}
        for cfg in cfgs:
            try:
                us = graph_time_us([lambda item=item, c=cfg: launch(c, gu, dn, item) for item in work])
            except Exception:
                us = float("inf")
            rows.append({"tokens": tokens, "kernel": cfg[0], "n": cfg[1], "k": cfg[2], "warps": cfg[3],
                         "stages": cfg[4], "us": us, "floor_us": floors[cfg[0]], "current": cfg in current})
        for kind in ("gu", "dn"):
            mine = sorted((r for r in rows if r["tokens"] == tokens and r["kernel"] == kind), key=lambda r: r["us"])
            now = next(r for r in mine if r["current"])
            print(f"T={tokens} {kind} blocks~{blocks:.1f} floor {floors[kind]:.1f} us; "
                  f"current {(now['n'], now['k'], now['warps'], now['stages'])} {now['us']:.1f} us")
            for r in mine[:6]:
                print(f"   {(r['n'], r['k'], r['warps'], r['stages'])} {r['us']:.1f} us ({r['floor_us'] / r['us']:.2f})")
        del gu, dn, work
        torch.cuda.empty_cache()
    return rows


def shared_against_a_block() -> None:
    """The shared expert's GEMVs (24 weight copies) against one more routed block a token."""
    from specdec.models import gemv, moe_kernels as mk, ops
    gate_up = [torch.randn(2 * I, D, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(CALLS)]
    down = [torch.randn(D, I, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(CALLS)]
    for tokens in (1, 4):
        x = torch.randn(tokens, D, dtype=torch.bfloat16, device="cuda")
        h = gemv.linear(x, gate_up[0])
        t_gu = graph_time_us([lambda w=w: gemv.linear(x, w) for w in gate_up])
        t_dn = graph_time_us([lambda w=w: gemv.linear(ops.silu_mul(h), w) for w in down])
        print(f"shared T={tokens}: gate_up GEMV {t_gu:.1f} us, down+silu GEMV {t_dn:.1f} us "
              f"(floor {2 * I * D * 2 / BANDWIDTH * 1e6:.1f} + {I * D * 2 / BANDWIDTH * 1e6:.1f})")
        for top_k in (K, K + 1):
            gu, dn, work = setup(E, tokens, CALLS, seed=7, top_k=top_k)
            t = mk.tiles_for(tokens * K, E, D, I, torch.bfloat16)
            a = graph_time_us([lambda it=it: launch(("gu", t.n1, t.k1, t.warps1, t.stages1), gu, dn, it) for it in work])
            b = graph_time_us([lambda it=it: launch(("dn", t.n2, t.k2, t.warps2, t.stages2), gu, dn, it) for it in work])
            print(f"   grouped at {top_k} choices a token, T={tokens}: gate_up {a:.1f} us, down {b:.1f} us")
            del gu, dn, work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,32,128", help="token counts, comma-separated")
    ap.add_argument("--csv", default="benchmarks/results/moe_tiles.csv")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.moe_tiles times Triton kernels under CUDA graphs: it needs a CUDA device")
    rows = sweep([int(t) for t in args.tokens.split(",")])
    shared_against_a_block()
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
