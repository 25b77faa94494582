"""FlashInfer's MLA work schedule (FA3 on SM90, FA2 elsewhere), built on the device.

FlashInfer's MLA kernel is persistent: cluster ``c`` runs work items ``work_indptr[c] ..
work_indptr[c + 1]``, each one query tile of one request over one kv range; the tiles whose kv
was split write partial outputs, which merge CTAs combine after a grid-wide sync. FlashInfer
fills that schedule on the host from host kv lengths (``MLAPlan`` in scheduler.cuh: a sync, and
0.6-1 ms of host time per pass on the H100 host). This module builds a schedule of the same form on the device from
device kv lengths, with static shapes, so it runs inside a CUDA graph and needs no host sync:
the same kv split length, work items and partial/merge layout as MLAPlan, but work items go to
clusters as contiguous runs of about equal cost where MLAPlan uses a min-heap. Which cluster
runs a work item does not change the result: every partial output has its own rows and the
merge reads them in the same order.

Uniform query lengths only (decode, draft steps, verify, draft-extend): the tile count per
request is then static.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_WORKS = 16384  # scheduler.cuh: capacity of each per-work array in the int workspace
CTA_TILE_Q = 64  # packed (token, head) query rows per CTA
WORK_FIELDS = ("q_indptr", "kv_indptr", "partial_indptr", "q_len", "kv_len", "q_start", "kv_start", "kv_end")
MERGE_FIELDS = ("merge_start", "merge_end", "merge_partial_start", "merge_partial_end", "merge_stride")
# MLAPlanInfo::ToVector order: grid dims, then byte offsets into the int (then float) workspace.
PLAN_INFO_FIELDS = (
    "num_blks_x", "num_blks_y", "q_indptr", "kv_indptr", "partial_indptr", "merge_start", "merge_end",
    "merge_partial_start", "merge_partial_end", "merge_stride", "q_len", "kv_len", "q_start", "kv_start",
    "kv_end", "work_indptr", "partial_o", "partial_lse",
)


def ceil_div(a, b):
    return (a + b - 1) // b


@dataclass(frozen=True)
class Fa3Geometry:
    """The static shape of a schedule: ``batch_size`` requests of ``q_len`` query tokens each,
    ``num_heads`` heads, on a GPU with ``num_sm`` SMs."""

    batch_size: int
    q_len: int
    num_heads: int
    num_sm: int

    def __post_init__(self) -> None:
        if min(self.batch_size, self.q_len, self.num_heads) < 1:
            raise ValueError(f"batch_size, q_len and num_heads must be positive, got {self}")
        if self.num_tiles > 1 and self.tile_q % self.num_heads:
            # FlashInfer's kernel drops a visible key where a causal tile ends mid-token
            # (its _validate_fa_causal_tile_bound); whole tokens per tile avoid it.
            raise ValueError(f"flashinfer_mla: {self.num_heads} heads do not divide the {self.tile_q}-row query "
                             f"tile of a {self.q_len}-token request; use a head count dividing {self.tile_q}")
        if self.max_works > MAX_WORKS:
            raise ValueError(f"flashinfer_mla: a batch of {self.batch_size} x {self.q_len} tokens can need "
                             f"{self.max_works} work items, over FlashInfer's {MAX_WORKS}; use smaller batches")

    @property
    def packed_q_len(self) -> int:
        return self.q_len * self.num_heads

    @property
    def cluster_size(self) -> int:
        return 2 if self.packed_q_len > CTA_TILE_Q else 1

    @property
    def num_clusters(self) -> int:
        return self.num_sm // self.cluster_size

    @property
    def tile_q(self) -> int:
        return CTA_TILE_Q * self.cluster_size

    @property
    def num_tiles(self) -> int:
        """Query tiles per request."""
        return ceil_div(self.packed_q_len, self.tile_q)

    @property
    def max_works(self) -> int:
        """Bound on work items: a tile splits into at most ``ceil(len / limit) <= len / limit + 1``
        items and the split length is at least the total kv length over the clusters."""
        return self.batch_size * self.num_tiles + self.num_clusters


@dataclass
class Fa3Schedule:
    """A schedule as the kernel reads it, all int32 on the device.

    works: ``[8, max_works]`` (WORK_FIELDS rows, in cluster order; entries past the last work
    item are unused); work_indptr: ``[num_clusters + 1]``; merge: ``[5, num_sm]`` (MERGE_FIELDS
    rows; unused merge CTAs have empty ranges).
    """

    works: torch.Tensor
    work_indptr: torch.Tensor
    merge: torch.Tensor


def split_limit(avg: torch.Tensor) -> torch.Tensor:
    """MLAPlan's kv split length from the average kv length per cluster (``[]`` int64)."""
    return torch.where(avg <= 8, 32, torch.where(avg <= 16, 64, torch.where(avg <= 32, 128, torch.where(
        avg <= 64, 192, ceil_div(avg, 256) * 256))))


def build_schedule(g: Fa3Geometry, kv_lens: torch.Tensor, page_starts: torch.Tensor) -> Fa3Schedule:
    """The schedule of ``g.batch_size`` requests with kv lengths ``kv_lens`` (``[B]`` int, new
    tokens included) whose pages start at ``page_starts`` (``[B]`` int) in the CSR page list.
    Causal: query token i of a request sees kv positions ``< kv_len - q_len + i + 1``.
    Device ops only, static shapes."""
    dev, B, T, tile = kv_lens.device, g.batch_size, g.num_tiles, g.tile_q
    kv = kv_lens.long()[:, None]  # [B, 1]
    tiles = torch.arange(T - 1, -1, -1, device=dev)  # MLAPlan's order: last tile first
    # Kv length a tile attends to: causal, up to its last token (the last tile sees everything).
    causal_end = (kv - g.q_len + ceil_div((tiles + 1) * tile, g.num_heads)).clamp(min=0).minimum(kv)
    rem = torch.where(tiles == T - 1, kv, causal_end).flatten()  # [R = B * T]
    total = rem.sum()
    limit = split_limit(ceil_div(total, g.num_clusters).clamp(min=1))
    split = rem > limit
    chunks = torch.where(split, ceil_div(rem, limit), 1)  # work items per tile (one for an empty tile)
    row_tile = (g.packed_q_len - tiles * tile).clamp(max=tile).repeat(B)  # [R] query rows per tile
    part_rows = torch.where(split, chunks * row_tile, 0)
    part_base = torch.cumsum(part_rows, 0) - part_rows

    req = torch.arange(B * T, device=dev) // T  # [R] request of each tile
    k = torch.arange(g.num_clusters, device=dev)  # chunk index; a tile has at most num_clusters
    valid = k < chunks[:, None]  # [R, K]
    kv_start = k * limit
    per_tile = torch.stack([req * g.q_len, page_starts.long()[req], req.new_full((), g.q_len).expand(req.shape[0]),
                            kv_lens.long()[req], (tiles * tile).repeat(B)])  # [5, R]
    fields = torch.cat([
        per_tile[:2, :, None].expand(-1, -1, k.shape[0]),
        torch.where(split[:, None], part_base[:, None] + k * row_tile[:, None], -1)[None],
        per_tile[2:, :, None].expand(-1, -1, k.shape[0]),
        kv_start.expand(rem.shape[0], -1)[None],
        torch.minimum(kv_start + limit, rem[:, None])[None],
    ])  # [8, R, K]
    cost = 2 * tile + fields[7] - fields[6]  # MLAPlan's cost_function
    flat_valid = valid.flatten()
    pos = torch.cumsum(flat_valid, 0) - flat_valid.long()
    dest = torch.where(flat_valid, pos, g.max_works)  # invalid grid cells go to a trash column
    packed = torch.zeros(9, g.max_works + 1, dtype=torch.long, device=dev)
    packed.scatter_(1, dest.expand(9, -1), torch.cat([fields, cost[None]]).flatten(1))
    works, cost = packed[:8, :-1], packed[8, :-1]

    # Contiguous runs of about total / num_clusters cost per cluster.
    cum = torch.cumsum(cost, 0)
    cluster = torch.where(cost > 0, (cum - cost) * g.num_clusters // cum[-1], g.num_clusters)
    work_indptr = torch.searchsorted(cluster, torch.arange(g.num_clusters + 1, device=dev))

    # Merge CTAs: a split tile's rows in chunks, each CTA combining its rows' partial outputs.
    qo_chunks = (rem * g.cluster_size // limit).clamp(min=1)
    row_chunk = ceil_div(row_tile, qo_chunks)
    merges = torch.where(split, ceil_div(row_tile, row_chunk), 0)  # [R]
    m = torch.arange(tile, device=dev)
    m_valid = (m < merges[:, None]).flatten()
    m_dest = torch.where(m_valid, torch.cumsum(m_valid, 0) - m_valid.long(), g.num_sm)
    row0 = (req * g.packed_q_len + (tiles * tile).repeat(B))[:, None]
    off = m * row_chunk[:, None]  # [R, M]
    merge_vals = torch.stack([
        row0 + off, row0 + torch.minimum(off + row_chunk[:, None], row_tile[:, None]), part_base[:, None] + off,
        (part_base + chunks * row_tile)[:, None].expand_as(off), row_tile[:, None].expand_as(off),
    ]).flatten(1)
    merge = torch.zeros(5, g.num_sm + 1, dtype=torch.long, device=dev)
    merge.scatter_(1, m_dest.expand(5, -1), merge_vals)
    return Fa3Schedule(works.int(), work_indptr.int(), merge[:, :-1].int())


def schedule_index(g: Fa3Geometry, plan_info: list[int], device: torch.device) -> torch.Tensor:
    """Where each value of a flattened schedule (works, work_indptr, merge) goes in the int32
    view of FlashInfer's int workspace, from the byte offsets of the host plan's ``plan_info``
    (fixed for a given GPU: every array has its capacity, whatever the batch)."""
    info = dict(zip(PLAN_INFO_FIELDS, plan_info))
    if len(plan_info) != len(PLAN_INFO_FIELDS) or (info["num_blks_x"], info["num_blks_y"]) != (g.cluster_size, g.num_clusters):
        raise RuntimeError(f"flashinfer_mla: FlashInfer's MLA plan layout {list(plan_info)} is not the one this "
                           f"schedule fills ({g}); pin flashinfer-python to the version in pyproject.toml")
    spans = [(name, g.max_works) for name in WORK_FIELDS] + [("work_indptr", g.num_clusters + 1)]
    spans += [(name, g.num_sm) for name in MERGE_FIELDS]
    starts = sorted(info[name] for name in PLAN_INFO_FIELDS[2:16])
    for name, n in spans:  # each array must fit before the next one starts
        room = next((s for s in starts if s > info[name]), None)
        if room is not None and info[name] + 4 * n > room:
            raise RuntimeError(f"flashinfer_mla: FlashInfer's {name} array holds {(room - info[name]) // 4} entries, "
                               f"the schedule needs {n}; pin flashinfer-python to the version in pyproject.toml")
    return torch.cat([torch.arange(info[name] // 4, info[name] // 4 + n, device=device) for name, n in spans])


def write_schedule(int_workspace: torch.Tensor, index: torch.Tensor, sched: Fa3Schedule) -> None:
    """Scatter ``sched`` into FlashInfer's int workspace (uint8) at ``index`` (schedule_index)."""
    values = torch.cat([sched.works.flatten(), sched.work_indptr, sched.merge.flatten()])
    int_workspace.view(torch.int32).index_copy_(0, index, values)
