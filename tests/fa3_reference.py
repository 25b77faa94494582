"""The FlashInfer MLA schedule of attn.kernels.fa3_plan in plain torch ops: the reference its Triton kernel
is checked against (tests/test_fa3_plan.py), written from scheduler.cuh's MLAPlan with whole-
tensor ops (static shapes) instead of the kernel's per-tile loops."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn.kernels.fa3_plan import Fa3Geometry, ceil_div


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
