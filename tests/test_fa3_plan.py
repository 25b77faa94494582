"""The device-built FlashInfer MLA schedule (attn.kernels.fa3_plan), checked on the CPU by running it.

``run_schedule`` plays the attention kernel's contract in plain torch (mla_hopper.cuh: each
cluster's work items, a query tile over a kv range under the causal bound, partial outputs for
split tiles, then the merge CTAs) on the torch reference schedule (tests/fa3_reference.py), and
the result must equal a dense causal attention: any wrong work item, kv range, partial row or
merge entry shows up as a wrong or missing output row. The Triton kernel that writes the
schedule must write the reference's arrays exactly (Triton's interpreter, where Triton is
installed; on the GPU, tests/test_gpu_backends.py compares against FlashInfer's own plan). The
reference itself is held to FlashInfer's own MLAPlan, compiled from the pinned wheel's headers and
run on the host (tests/mlaplan_oracle.cu), where nvcc is installed.
"""

from __future__ import annotations

import importlib.util
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from attn.kernels.fa3_plan import MAX_WORKS, MERGE_FIELDS, PLAN_INFO_FIELDS, WORK_FIELDS, Fa3Geometry, ceil_div, schedule_layout
from fa3_reference import build_schedule
from interpreted import run_interpreted

D = 8  # head dim of the toy attention: the schedule does not depend on it


def run_schedule(g: Fa3Geometry, sched, q, pages, kv_indices, page_size, kv_lens):
    """Output ``[B * q_len, H, D]`` of the schedule, and how many times each row was written.

    q: ``[B * q_len, H, D]``; pages: ``[num_pages, page_size, D]`` (keys = values);
    kv_indices: the CSR page list the work items' kv_indptr point into.
    """
    H = g.num_heads
    out = torch.full_like(q, float("nan"))
    writes = torch.zeros(q.shape[:2], dtype=torch.long)
    partial_o, partial_lse = {}, {}
    works = dict(zip(WORK_FIELDS, sched.works.tolist()))
    indptr = sched.work_indptr.tolist()
    assert indptr[0] == 0 and all(a <= b for a, b in zip(indptr, indptr[1:]))
    for w in range(indptr[-1]):
        qi, ki, part, ql, kl, qs, ks, ke = (works[f][w] for f in WORK_FIELDS)
        for row in range(qs, min(qs + g.tile_q, ql * H)):
            tok, head = divmod(row, H)
            hi = min(ke, kl - ql + tok + 1)  # causal bound of this query token
            pos = torch.arange(ks, max(hi, ks))
            keys = pages.reshape(-1, D)[kv_indices[ki + pos // page_size].long() * page_size + pos % page_size]
            s = keys @ q[qi + tok, head]
            lse = torch.logsumexp(s, 0) if len(pos) else torch.tensor(float("-inf"))
            o = torch.softmax(s, 0) @ keys if len(pos) else torch.zeros(D)
            if part == -1:
                out[qi + tok, head] = o
                writes[qi + tok, head] += 1
            else:
                key = part + row - qs
                assert key not in partial_o, f"partial row {key} written twice"
                partial_o[key], partial_lse[key] = o, lse
    merge = dict(zip(MERGE_FIELDS, sched.merge.tolist()))
    for cta in range(g.num_sm):
        start, end, p0, p1, stride = (merge[f][cta] for f in MERGE_FIELDS)
        for local in range(end - start):
            tok, head = divmod(start + local, H)
            rows = range(p0 + local, p1, stride)
            lse = torch.stack([partial_lse[r] for r in rows])
            weights = torch.softmax(lse, 0)
            out[tok, head] = sum(wt * partial_o[r] for wt, r in zip(weights, rows))
            writes[tok, head] += 1
    return out, writes


def dense_causal(q, pages, block_tables, page_size, kv_lens, q_len):
    out = torch.empty_like(q)
    for b, kl in enumerate(kv_lens.tolist()):
        keys = pages[block_tables[b]].reshape(-1, D)[:kl]
        for t in range(q_len):
            s = q[b * q_len + t] @ keys[: kl - q_len + t + 1].T  # [H, n]
            out[b * q_len + t] = torch.softmax(s, -1) @ keys[: kl - q_len + t + 1]
    return out


CASES = [
    # batch, q_len, heads, sms, kv lengths: splits, one cluster of two CTAs, empty and one-token requests
    (1, 1, 16, 8, [1]),
    (3, 1, 16, 8, [40, 700, 3]),
    (4, 4, 16, 8, [4, 300, 129, 64]),
    (2, 4, 32, 6, [500, 60]),
    (5, 2, 128, 10, [2, 2, 900, 31, 257]),
    (3, 8, 16, 4, [8, 1000, 77]),
    (2, 1, 64, 132, [5000, 12]),
    (3, 4, 32, 2, [0, 4, 650]),  # a request with no kv at all; one cluster of two CTAs
    (1, 1, 16, 2, [512]),  # two equal kv chunks: a cluster boundary falls exactly between them
]


@pytest.mark.parametrize("bs,q_len,heads,sms,kv", CASES)
def test_schedule_computes_causal_attention(bs, q_len, heads, sms, kv):
    gen = torch.Generator().manual_seed(bs * 100 + q_len)
    page_size = 16
    g = Fa3Geometry(bs, q_len, heads, sms)
    kv_lens = torch.tensor(kv, dtype=torch.int32)
    live = (kv_lens + page_size - 1) // page_size
    num_pages = int(live.sum()) + 3
    block_tables = torch.randperm(num_pages, generator=gen)[: int(live.sum())].split(live.tolist())
    kv_indices = torch.cat(block_tables)
    page_starts = torch.cumsum(live, 0) - live
    pages = torch.randn(num_pages, page_size, D, generator=gen, dtype=torch.float64)
    q = torch.randn(bs * q_len, heads, D, generator=gen, dtype=torch.float64)

    sched = build_schedule(g, kv_lens, page_starts.int())
    out, writes = run_schedule(g, sched, q, pages, kv_indices, page_size, kv_lens)
    assert (writes == 1).all(), "every output row written exactly once"
    ref = dense_causal(q, pages, [t.tolist() for t in block_tables], page_size, kv_lens, q_len)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    assert int(sched.work_indptr[-1]) <= g.max_works


BALANCE_CASES = [(2, 1, 16, [16000, 300]), (64, 4, 128, [50000] + list(range(100, 6400, 100)))]


@pytest.mark.parametrize("bs,q_len,heads,kv", BALANCE_CASES)
def test_schedule_splits_long_kv_and_balances_clusters(bs, q_len, heads, kv):
    """Long requests are split into kv chunks spread over the clusters; no cluster's cost
    (MLAPlan's 2 * tile + kv length per item) is more than one item above the mean."""
    g = Fa3Geometry(bs, q_len, heads, 132)
    kv_lens = torch.tensor(kv, dtype=torch.int32)
    sched = build_schedule(g, kv_lens, torch.cumsum(kv_lens, 0).int() - kv_lens)
    works = dict(zip(WORK_FIELDS, sched.works.long()))
    n = int(sched.work_indptr[-1])
    cost = 2 * g.tile_q + works["kv_end"][:n] - works["kv_start"][:n]
    bounds = sched.work_indptr.tolist()
    per_cluster = torch.stack([cost[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])])
    assert (works["partial_indptr"][:n] >= 0).sum() >= 8  # the longest request is split
    assert per_cluster.max() - per_cluster.float().mean() <= cost.max()
    assert (per_cluster > 0).sum() >= min(n, g.num_clusters) // 2  # the work is spread, not piled up


def fake_plan_info(g: Fa3Geometry) -> tuple[list[int], int]:
    """A plan_info laid out as FlashInfer's MLAPlan lays it out (each array at full capacity, in
    its allocation order, 16-byte aligned), and the workspace bytes it spans."""
    offsets, at = {}, 0
    for name, n in [(f, MAX_WORKS) for f in WORK_FIELDS[:3]] + [(f, g.num_sm) for f in MERGE_FIELDS] + \
                   [(f, MAX_WORKS) for f in WORK_FIELDS[3:]] + [("work_indptr", MAX_WORKS)]:
        offsets[name] = ceil_div(at, 16) * 16
        at = offsets[name] + 4 * n
    return [g.cluster_size, g.num_clusters] + [offsets[f] for f in PLAN_INFO_FIELDS[2:16]] + [0, 0], at


def test_schedule_shapes_are_static_and_layout_follows_plan_info():
    """Shapes depend only on the geometry (graph safe); the layout is plan_info's byte offsets
    in int32 units, and a layout of another shape or with too little room is refused."""
    g = Fa3Geometry(3, 2, 16, 12)
    a = build_schedule(g, torch.tensor([5, 80, 9], dtype=torch.int32), torch.tensor([0, 1, 6], dtype=torch.int32))
    b = build_schedule(g, torch.tensor([900, 2, 40], dtype=torch.int32), torch.tensor([0, 57, 58], dtype=torch.int32))
    assert [t.shape for t in vars(a).values()] == [t.shape for t in vars(b).values()]
    info, _ = fake_plan_info(g)
    byte_offsets = dict(zip(PLAN_INFO_FIELDS, info))
    assert schedule_layout(g, info)[:3] == tuple(byte_offsets[f] // 4 for f in WORK_FIELDS[:3])
    with pytest.raises(RuntimeError, match="plan layout"):
        schedule_layout(g, [2, g.num_clusters] + info[2:])
    cramped = list(info)
    cramped[PLAN_INFO_FIELDS.index("kv_indptr")] = info[PLAN_INFO_FIELDS.index("q_indptr")] + 4 * (g.max_works - 1)
    with pytest.raises(RuntimeError, match="q_indptr array holds"):
        schedule_layout(g, cramped)


@pytest.fixture(scope="session")
def mlaplan(tmp_path_factory):
    """FlashInfer's MLAPlan as a function of (geometry, kv lengths, page starts): the plan_info
    and arrays tests/mlaplan_oracle.cu prints, built once from the installed flashinfer-python's
    headers (skipped without nvcc or flashinfer)."""
    spec = importlib.util.find_spec("flashinfer")
    nvcc = shutil.which("nvcc")
    if spec is None or nvcc is None:
        pytest.skip("FlashInfer's MLAPlan oracle needs flashinfer-python and nvcc")
    data = Path(spec.submodule_search_locations[0]) / "data"
    binary = tmp_path_factory.mktemp("mlaplan") / "mlaplan_oracle"
    includes = [data / "cccl/libcudacxx/include", data / "cccl/cub", data / "cccl/thrust", data / "include"]
    build = subprocess.run([nvcc, "-std=c++17", *(f"-I{p}" for p in includes), str(Path(__file__).with_name("mlaplan_oracle.cu")),
                            "-o", str(binary)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr

    def plan(g: Fa3Geometry, kv_lens: list[int], page_starts: list[int]) -> dict[str, list[int]]:
        qo_indptr = [i * g.q_len for i in range(g.batch_size + 1)]
        kv_indptr = page_starts + [page_starts[-1] + 1]  # MLAPlan reads only the requests' starts
        args = [g.num_sm, g.batch_size, g.num_heads, 512, 1, *qo_indptr, *kv_indptr, *kv_lens]
        run = subprocess.run([str(binary)], input=" ".join(map(str, args)), capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        lines = [[int(x) for x in line.split()] for line in run.stdout.splitlines()]
        return dict(zip(("plan_info", "work_indptr", *WORK_FIELDS, *MERGE_FIELDS), lines))

    return plan


def random_cases(n: int, seed: int) -> list[tuple[int, int, int, int, list[int]]]:
    """Geometries the kernel runs (heads dividing the query tile where a request has several),
    with kv lengths from empty to 20k, batches of 1-64 on 2-132 SMs."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        bs, q_len, heads, sms = rng.randint(1, 64), rng.choice([1, 1, 2, 4, 6, 8]), rng.choice([8, 16, 32, 64, 128]), rng.choice([2, 7, 16, 78, 132])
        try:
            Fa3Geometry(bs, q_len, heads, sms)
        except ValueError:
            continue
        kv = [rng.choice([0, rng.randint(q_len, 64), rng.randint(q_len, 2000), rng.randint(q_len, 20000)]) for _ in range(bs)]
        cases.append((bs, q_len, heads, sms, [max(k, q_len) if k else 0 for k in kv]))
    return cases


# One request whose kv per cluster falls in each of MLAPlan's split-length bands (<= 8, 16, 32, 64,
# more), on one-CTA clusters and on two-CTA clusters (16 heads x 8 tokens).
SPLIT_BAND_CASES = [(1, q_len, 16, 132, [kv]) for q_len in (1, 8) for kv in (100, 1500, 3000, 6000, 20000)]


@pytest.mark.parametrize("bs,q_len,heads,sms,kv", CASES + [(bs, q, h, 132, kv) for bs, q, h, kv in BALANCE_CASES] + SPLIT_BAND_CASES + random_cases(24, seed=3))
def test_reference_schedule_is_flashinfers_mlaplan(mlaplan, bs, q_len, heads, sms, kv):
    """FlashInfer's own MLAPlan, on the same requests: its grid, its layout (which schedule_layout
    accepts), the same work items (which cluster runs one is ours to choose: only the set must
    match) and the same merge CTAs, entry for entry."""
    g = Fa3Geometry(bs, q_len, heads, sms)
    page_starts = [sum(k // 16 + 1 for k in kv[:i]) for i in range(bs)]
    theirs = mlaplan(g, kv, page_starts)
    ours = build_schedule(g, torch.tensor(kv, dtype=torch.int32), torch.tensor(page_starts, dtype=torch.int32))
    assert theirs["plan_info"][:16] == fake_plan_info(g)[0][:16]  # grid and int workspace layout
    schedule_layout(g, theirs["plan_info"])  # raises where an array has not the room the schedule fills
    works = int(ours.work_indptr[-1])
    assert works == theirs["work_indptr"][-1] <= g.max_works
    items = sorted(zip(*(theirs[f] for f in WORK_FIELDS)))
    assert sorted(zip(*(row[:works].tolist() for row in ours.works))) == items
    assert [row.tolist() for row in ours.merge] == [theirs[f] for f in MERGE_FIELDS]


_INTERPRETED = """
import torch

from attn.kernels.fa3_plan import Fa3Geometry, schedule_layout, write_schedule
from fa3_reference import build_schedule
from test_fa3_plan import BALANCE_CASES, CASES, fake_plan_info

for bs, q_len, heads, sms, kv in CASES + [(bs, q, h, 132, kv) for bs, q, h, kv in BALANCE_CASES]:
    g = Fa3Geometry(bs, q_len, heads, sms)
    kv_lens = torch.tensor(kv, dtype=torch.int32)
    page_starts = (torch.cumsum(kv_lens // 16 + 1, 0) - (kv_lens // 16 + 1)).int()
    info, nbytes = fake_plan_info(g)
    layout = schedule_layout(g, info)
    workspace = torch.full((nbytes,), 0x7F, dtype=torch.uint8)  # garbage wherever nothing is written
    write_schedule(workspace, layout, g, kv_lens, page_starts)
    ints, ref = workspace.view(torch.int32), build_schedule(g, kv_lens, page_starts)
    works = int(ref.work_indptr[-1])
    wanted = [r[:works] for r in ref.works] + [ref.work_indptr] + list(ref.merge)
    for offset, want in zip(layout, wanted):
        assert torch.equal(ints[offset:offset + len(want)], want), (g, offset)
print("ok")
"""


def test_kernel_writes_the_reference_schedule():
    """The Triton kernel, under Triton's interpreter, writes every case's reference arrays."""
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=0, q_len=1, num_heads=16, num_sm=132), "positive"),
    (dict(batch_size=2, q_len=8, num_heads=24, num_sm=132), "24 heads do not divide"),
    (dict(batch_size=2, q_len=1, num_heads=192, num_sm=132), "192 heads do not divide"),
    (dict(batch_size=16384, q_len=4, num_heads=16, num_sm=132), "work items"),
])
def test_geometry_refuses_what_the_kernel_cannot_run(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fa3Geometry(**kwargs)


def test_geometry_takes_any_head_count_in_one_tile():
    """One query tile per request has no tile boundary inside a token: 24 heads x 4 tokens."""
    assert Fa3Geometry(batch_size=2, q_len=4, num_heads=24, num_sm=132).num_tiles == 1
