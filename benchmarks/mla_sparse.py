"""Sparse MLA decode benchmark (DeepSeek-V3.2): triton_mla's sparse kernel against FlashMLA's SM90 sparse decode.

    python -m benchmarks.mla_kernels --sparse [--quick] [--kv-dtype fp8] [--out benchmarks/mla_sparse.png]

Every query token attends to its own index_topk (2048) rows, drawn at random without repeats from its
request's context, over a paged cache of 64-token pages; both kernels read the same rows (slots). Ours
runs on the 576-wide cache (bf16, or fp8 e4m3 with --kv-dtype fp8); FlashMLA's sparse decode takes only
its fp8 V3.2 layout (656 bytes a token: attn.v32_fp8.quantize_v32 quantises the same cache) and 64 or 128 heads, so a
16-head row runs it zero-padded to 64 heads, as an engine would. Timing as mla_kernels: CUDA graphs
whose samples alternate, the cache rotated between copies (ROTATE_BYTES a graph) and the selections
redrawn for each copy, so no kernel reads its rows from L2. Roofline (per kernel, its own row bytes) =
max(selected rows' bytes / copy bandwidth, FLOPs / PEAK_FLOPS), FLOPs = tokens * heads * topk * 1088 * 2.
err / flashmla_err: the first token's largest error against an fp32 attention over its rows of the
16-bit cache, relative to the largest output value. targets: ``flashmla:yes`` where ours is at least
FlashMLA's speed.
"""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path

import torch

from attn.base import KV_DIM, KV_LORA_RANK
from attn.v32_fp8 import V32_FP8_BYTES, quantize_v32
from benchmarks.mla_kernels import (KV_DTYPES, MAX_ROTATIONS, PAGE_SIZE, PEAK_FLOPS, ROTATE_BYTES, SM_SCALE,
                                    copy_bandwidth, graph_times_us, print_row)

INDEX_TOPK = 2048
FLASHMLA_HEADS = (64, 128)
CONVERT_PAGES = 4096  # pages quantised at a time (quantize_v32 holds fp32 copies of them)
TABLE = dict(batches=(1, 8, 32, 128), contexts=(4096, 16384, 65536, 131072), q_lens=(1, 4), heads=(16, 64, 128))
QUICK = [(1, 4096, 1, 16), (8, 65536, 1, 128), (32, 131072, 4, 64)]


def draw_slots(pages: torch.Tensor, context: int, q_len: int, topk: int, generator: torch.Generator) -> torch.Tensor:
    """``[B * q_len, topk]`` int32 slots: each token's topk distinct positions of its request's
    ``context`` (all of them, in random order, when context < topk; -1 past it), through the
    request's pages ``[B, context / 64]``."""
    batch = pages.shape[0]
    keys = torch.rand(batch * q_len, context, generator=generator)
    take = min(topk, context)
    positions = keys.topk(take, dim=-1).indices  # [T, take] distinct
    request = torch.arange(batch).repeat_interleave(q_len)[:, None]
    slots = pages.cpu()[request, positions // PAGE_SIZE].long() * PAGE_SIZE + positions % PAGE_SIZE
    return torch.nn.functional.pad(slots, (0, topk - take), value=-1).int()


class SparseCase:
    """batch requests of ``context`` tokens, q_len query tokens each, ``heads`` heads: the 576-wide
    cache in ``kv_dtype`` (rotated copies), its V3.2 fp8 twin for FlashMLA, one selection a copy."""

    def __init__(self, batch: int, context: int, q_len: int, heads: int, kv_dtype: torch.dtype = torch.bfloat16,
                 topk: int = INDEX_TOPK, seed: int = 0):
        self.batch, self.context, self.q_len, self.heads, self.topk = batch, context, q_len, heads, topk
        generator = torch.Generator().manual_seed(seed)
        pages_per_req = math.ceil(context / PAGE_SIZE)
        num_pages = batch * pages_per_req
        copy_bytes = num_pages * PAGE_SIZE * KV_DIM * kv_dtype.itemsize
        self.rotations = max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / copy_bytes)))
        self.pages = torch.randperm(num_pages, generator=generator).int().view(batch, pages_per_req)
        source = torch.randn(self.rotations, num_pages, PAGE_SIZE, KV_DIM, device="cuda", dtype=torch.bfloat16)
        self.cache16 = source  # the 16-bit truth every error is measured against
        self.cache = source.to(kv_dtype)
        self.cache_v32 = torch.empty(*source.shape[:3], V32_FP8_BYTES, dtype=torch.uint8, device="cuda")
        for r, start in itertools.product(range(self.rotations), range(0, num_pages, CONVERT_PAGES)):
            self.cache_v32[r, start:start + CONVERT_PAGES] = quantize_v32(source[r, start:start + CONVERT_PAGES])
        self.slots = torch.stack([draw_slots(self.pages, context, q_len, topk, generator)
                                  for _ in range(self.rotations)]).cuda()  # [R, T, topk]
        tokens = batch * q_len
        self.q = torch.randn(tokens, heads, KV_DIM, device="cuda").to(torch.bfloat16)
        self.out = torch.empty(tokens, heads, KV_LORA_RANK, device="cuda", dtype=torch.bfloat16)
        self.kv_dtype = kv_dtype

    @property
    def tokens(self) -> int:
        return self.batch * self.q_len

    def rows_read(self) -> int:
        return self.tokens * min(self.topk, self.context)

    def roofline_us(self, bandwidth: float, row_bytes: int) -> float:
        """max(selected rows' bytes / bandwidth, FLOPs / PEAK_FLOPS), us, for rows of ``row_bytes``."""
        flops = self.rows_read() * self.heads * 1088 * 2
        return max(self.rows_read() * row_bytes / bandwidth, flops / PEAK_FLOPS) * 1e6

    def reference(self, rotation: int) -> torch.Tensor:
        """The first token's output in fp32 over its rows of the 16-bit cache: ``[heads, 512]``."""
        slots = self.slots[rotation, 0]
        rows = self.cache16[rotation].reshape(-1, KV_DIM)[slots[slots >= 0].long()].float()
        scores = (self.q[0].float() @ rows.T * SM_SCALE).softmax(-1)
        return scores @ rows[:, :KV_LORA_RANK]

    def triton_calls(self) -> list:
        from attn.kernels.triton_mla.sparse import sparse_mla_decode

        return [lambda r=r: sparse_mla_decode(self.q, self.cache[r], self.slots[r], SM_SCALE, out=self.out)
                for r in range(self.rotations)]


def flashmla_calls(case: SparseCase):
    """FlashMLA's sparse decode (``flash_mla_with_kvcache`` with indices, legacy SM90) over the V3.2
    fp8 copies and the same slots, heads zero-padded to 64 or 128; its schedule made at the first
    call, outside any graph. Returns the closures and a function giving the output ``[T, H, 512]``."""
    from attn.backends.flashmla import load_flash_mla

    flash_mla = load_flash_mla()
    heads = next((n for n in FLASHMLA_HEADS if n >= case.heads), None)
    if heads is None:
        raise ValueError(f"FlashMLA's sparse decode takes at most {FLASHMLA_HEADS[-1]} heads, not {case.heads}")
    q = torch.nn.functional.pad(case.q, (0, 0, 0, heads - case.heads)).view(case.batch, case.q_len, heads, KV_DIM)
    schedule, _ = flash_mla.get_mla_metadata()
    out = []

    def call(rotation: int) -> None:
        result, _ = flash_mla.flash_mla_with_kvcache(
            q, case.cache_v32[rotation].view(-1, PAGE_SIZE, 1, V32_FP8_BYTES), None, None, KV_LORA_RANK, schedule,
            softmax_scale=SM_SCALE, is_fp8_kvcache=True, indices=case.slots[rotation].view(case.batch, case.q_len, -1),
            use_legacy=True)
        out[:] = [result]

    calls = [lambda r=r: call(r) for r in range(case.rotations)]
    calls[0]()
    return calls, lambda: out[0].reshape(case.tokens, heads, KV_LORA_RANK)[:, :case.heads]


def bench(case: SparseCase, bandwidth: float, with_flashmla: bool) -> dict:
    """One row: both kernels timed alternately (FlashMLA's columns NaN, its reason printed, where it fails)."""
    nan = float("nan")
    ours = case.triton_calls()
    rival = None
    if with_flashmla:
        try:
            rival = flashmla_calls(case)
        except Exception as error:  # keep our numbers; say why FlashMLA has none
            print(f"flashmla failed: {type(error).__name__}: {error}")
    ours_us, *rival_us = graph_times_us(ours, *([rival[0]] if rival else []))
    truth = case.reference(case.rotations - 1)
    scale = truth.abs().max().item()

    def error(out: torch.Tensor) -> float:
        return (out[0].float() - truth).abs().max().item() / scale

    roof = case.roofline_us(bandwidth, KV_DIM * case.kv_dtype.itemsize)
    row = dict(batch=case.batch, context=case.context, q_len=case.q_len, heads=case.heads, topk=case.topk,
               triton_us=ours_us, roofline_us=roof, frac_roofline=roof / ours_us, err=error(case.out),
               flashmla_us=nan, flashmla_frac=nan, speedup_vs_flashmla=nan, flashmla_err=nan)
    if rival:
        flashmla_us = rival_us[0]
        row.update(flashmla_us=flashmla_us, flashmla_frac=case.roofline_us(bandwidth, V32_FP8_BYTES) / flashmla_us,
                   speedup_vs_flashmla=flashmla_us / ours_us, flashmla_err=error(rival[1]()))
    row["targets"] = targets(row)
    return row


def targets(row: dict) -> str:
    """``flashmla:yes`` / ``flashmla:no``: at least FlashMLA's speed, where it ran; else "-"."""
    speedup = row["speedup_vs_flashmla"]
    return "-" if math.isnan(speedup) else f"flashmla:{'yes' if speedup >= 1.0 else 'no'}"


COLUMNS = [("batch", "{:>5}"), ("context", "{:>7}"), ("q_len", "{:>5}"), ("heads", "{:>5}"), ("topk", "{:>5}"),
           ("triton_us", "{:>9.1f}"), ("roofline_us", "{:>11.1f}"), ("frac_roofline", "{:>13.2f}"),
           ("flashmla_us", "{:>11.1f}"), ("flashmla_frac", "{:>13.2f}"), ("speedup_vs_flashmla", "{:>19.2f}"),
           ("err", "{:>7.4f}"), ("flashmla_err", "{:>12.4f}"), ("targets", "{:<14}")]


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"b{r['batch']} c{r['context'] // 1024}k q{r['q_len']} h{r['heads']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(12, len(rows) * 0.3), 5))
    ax.bar(list(x), [r["speedup_vs_flashmla"] for r in rows], color="tab:green")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    ax.set_ylabel("speedup vs FlashMLA sparse (their us / ours)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(quick: bool, kv_dtype: str, out: Path) -> None:
    """The sparse table (TABLE's shapes, or QUICK's), printed, as CSV next to the PNG ``out``."""
    bandwidth = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); "
          f"index_topk {INDEX_TOPK}, our cache {kv_dtype}, FlashMLA's V3.2 fp8")
    try:
        from attn.backends.flashmla import load_flash_mla

        load_flash_mla()
        with_flashmla = True
    except ImportError as error:
        with_flashmla = False
        print(f"note: flashmla not importable ({error}); its columns are empty")
    shapes = QUICK if quick else list(itertools.product(*TABLE.values()))
    rows = []
    print_row(None, COLUMNS)
    for batch, context, q_len, heads in shapes:
        case = SparseCase(batch, context, q_len, heads, KV_DTYPES[kv_dtype])
        rows.append(bench(case, bandwidth, with_flashmla))
        print_row(rows[-1], COLUMNS)
        del case
        torch.cuda.empty_cache()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[name for name, _ in COLUMNS])
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out, f"Sparse MLA decode, top-{INDEX_TOPK}, {kv_dtype} cache ({torch.cuda.get_device_name()})")
    met = [r["targets"].endswith(":yes") for r in rows if r["targets"] != "-"]
    print(f"\ntarget flashmla: met on {sum(met)} of {len(met)} rows")
    print(f"wrote {out} and {out.with_suffix('.csv')}")
