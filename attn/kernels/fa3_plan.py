"""FlashInfer's MLA work schedule (FA3 on SM90, FA2 elsewhere), built on the device.

FlashInfer's MLA kernel is persistent: cluster ``c`` runs work items ``work_indptr[c] ..
work_indptr[c + 1]``, each one query tile of one request over one kv range; the tiles whose kv
was split write partial outputs, which merge CTAs combine after a grid-wide sync. FlashInfer
fills that schedule on the host from host kv lengths (``MLAPlan`` in scheduler.cuh: a sync per
pass). This module builds a schedule of the same form on the device from device kv lengths, with
static shapes, so it runs inside a CUDA graph and needs no host sync: the same kv split length,
work items and partial/merge layout as MLAPlan, but work items go to clusters as contiguous runs
of about equal cost where MLAPlan uses a min-heap. Which cluster runs a work item does not change
the result: every partial output has its own rows and the merge reads them in the same order.

One Triton program writes the whole schedule straight into FlashInfer's int workspace (its
reference, in whole-tensor torch ops: tests/fa3_reference.py; timings: docs/kernels.md). Uniform
query lengths only (decode, draft steps, verify, draft-extend): the tile count per request is then
static.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn.kernels.triton_lang import tl, triton

MAX_WORKS = 16384  # scheduler.cuh: capacity of each per-work array in the int workspace
CTA_TILE_Q = 64  # packed (token, head) query rows per CTA
WORK_FIELDS = ("q_indptr", "kv_indptr", "partial_indptr", "q_len", "kv_len", "q_start", "kv_start", "kv_end")
MERGE_FIELDS = ("merge_start", "merge_end", "merge_partial_start", "merge_partial_end", "merge_stride")
LAYOUT_FIELDS = (*WORK_FIELDS, "work_indptr", *MERGE_FIELDS)  # schedule_layout's order
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


def schedule_layout(g: Fa3Geometry, plan_info: list[int]) -> tuple[int, ...]:
    """Int32 offsets of LAYOUT_FIELDS in FlashInfer's int workspace, from the byte offsets of the
    host plan's ``plan_info`` (fixed for a GPU: every array has its full capacity whatever the
    batch). Checks that the layout is the one this schedule fills."""
    info = dict(zip(PLAN_INFO_FIELDS, plan_info))
    if len(plan_info) != len(PLAN_INFO_FIELDS) or (info["num_blks_x"], info["num_blks_y"]) != (g.cluster_size, g.num_clusters):
        raise RuntimeError(f"flashinfer_mla: FlashInfer's MLA plan layout {list(plan_info)} is not the one this "
                           f"schedule fills ({g}); pin flashinfer-python to the version in pyproject.toml")
    sizes = {**dict.fromkeys(WORK_FIELDS, g.max_works), "work_indptr": g.num_clusters + 1,
             **dict.fromkeys(MERGE_FIELDS, g.num_sm)}
    starts = sorted(info[name] for name in PLAN_INFO_FIELDS[2:16])
    for name, n in sizes.items():  # each array must fit before the next one starts
        room = next((s for s in starts if s > info[name]), None)
        if room is not None and info[name] + 4 * n > room:
            raise RuntimeError(f"flashinfer_mla: FlashInfer's {name} array holds {(room - info[name]) // 4} entries, "
                               f"the schedule needs {n}; pin flashinfer-python to the version in pyproject.toml")
    return tuple(info[name] // 4 for name in LAYOUT_FIELDS)


def _jit(fn):
    # NUM_REQ unspecialised: Triton would compile again for a batch of 1 and for multiples of 16.
    return triton.jit(do_not_specialize=["NUM_REQ"])(fn) if triton is not None else fn


@_jit
def _schedule_kernel(
    kv_lens_ptr, page_starts_ptr, ws_ptr,
    o_q_indptr, o_kv_indptr, o_partial, o_q_len, o_kv_len, o_q_start, o_kv_start, o_kv_end, o_work_indptr,
    o_m_start, o_m_end, o_mp_start, o_mp_end, o_m_stride,
    NUM_REQ, NUM_TILES: tl.constexpr, Q_LEN: tl.constexpr, HEADS: tl.constexpr, TILE: tl.constexpr,
    CLUSTER: tl.constexpr, NUM_CLUSTERS: tl.constexpr, NUM_SM: tl.constexpr,
    R_P2: tl.constexpr, C_BLOCK: tl.constexpr, SM_P2: tl.constexpr,
):
    """One program. Lanes are the tiles (request r's tiles, last first, as MLAPlan orders them);
    a tile's work items and merge CTAs are consecutive, so their positions are prefix sums over
    tiles and each item is written by its tile's lane in a loop over chunk indices. NUM_REQ (the
    batch size) is a runtime argument: eager passes, whose batch size changes as requests finish,
    compile once per power of two of lanes (R_P2), not once per batch size."""
    lane = tl.arange(0, R_P2)
    is_tile = lane < NUM_REQ * NUM_TILES
    req = lane // NUM_TILES
    t = NUM_TILES - 1 - lane % NUM_TILES
    kv = tl.load(kv_lens_ptr + req, mask=is_tile, other=0).to(tl.int64)
    page_start = tl.load(page_starts_ptr + req, mask=is_tile, other=0)
    # Kv length the tile attends to: causal, up to its last token (the last tile sees all).
    causal_end = tl.minimum(tl.maximum(kv - Q_LEN + ((t + 1) * TILE + HEADS - 1) // HEADS, 0), kv)
    rem = tl.where(t == NUM_TILES - 1, kv, causal_end)
    rem = tl.where(is_tile, rem, 0)
    avg = tl.maximum((tl.sum(rem, 0) + NUM_CLUSTERS - 1) // NUM_CLUSTERS, 1)
    limit = tl.where(avg <= 8, 32, tl.where(avg <= 16, 64, tl.where(avg <= 32, 128, tl.where(
        avg <= 64, 192, (avg + 255) // 256 * 256)))).to(tl.int64)
    split = rem > limit
    chunks = tl.where(is_tile, tl.where(split, (rem + limit - 1) // limit, 1), 0)  # work items of the tile
    row_tile = tl.minimum(Q_LEN * HEADS - t * TILE, TILE)  # query rows of the tile
    part_rows = tl.where(split, chunks * row_tile, 0)
    part_base = tl.cumsum(part_rows, 0) - part_rows
    work_base = tl.cumsum(chunks, 0) - chunks
    tile_cost = 2 * TILE * chunks + rem  # MLAPlan's cost_function summed over the tile's items
    cost_base = tl.cumsum(tile_cost, 0) - tile_cost
    total_cost = tl.sum(tile_cost, 0)

    q_indptr = req * Q_LEN
    for k in range(0, tl.max(chunks, 0)):
        live = k < chunks
        at = ws_ptr + work_base + k
        kv_start = k * limit
        tl.store(at + o_q_indptr, q_indptr.to(tl.int32), mask=live)
        tl.store(at + o_kv_indptr, page_start, mask=live)
        tl.store(at + o_partial, tl.where(split, part_base + k * row_tile, -1).to(tl.int32), mask=live)
        tl.store(at + o_q_len, tl.full([R_P2], Q_LEN, tl.int32), mask=live)
        tl.store(at + o_kv_len, kv.to(tl.int32), mask=live)
        tl.store(at + o_q_start, (t * TILE).to(tl.int32), mask=live)
        tl.store(at + o_kv_start, kv_start.to(tl.int32), mask=live)
        tl.store(at + o_kv_end, tl.minimum(kv_start + limit, rem).to(tl.int32), mask=live)

    # Cluster c runs the items whose cost prefix p has p * NUM_CLUSTERS < c * total_cost
    # (contiguous runs of about equal cost). Item k of a tile has prefix cost_base + k * step:
    # every item but a tile's last is a full `limit` long.
    # ceil(room / den) in fp64, not an int64 division (slow on the GPU), and exact: a quotient is
    # below 2^20 (items per tile), so fp64 is within 2^-32 of it, while a non-integer one lies at
    # least 1 / den from an integer (den: about the total kv length, below 2^28).
    den = ((2 * TILE + limit) * NUM_CLUSTERS).to(tl.float64)
    for c0 in range(0, NUM_CLUSTERS + 1, C_BLOCK):
        c = c0 + tl.arange(0, C_BLOCK)
        room = c[:, None].to(tl.int64) * total_cost - cost_base[None, :] * NUM_CLUSTERS
        below = tl.where(room > 0, tl.math.ceil(room.to(tl.float64) / den), 0.0)
        count = tl.sum(tl.minimum(below, chunks[None, :].to(tl.float64)), 1)
        tl.store(ws_ptr + o_work_indptr + c, count.to(tl.int32), mask=c <= NUM_CLUSTERS)

    # Merge CTAs: a split tile's rows in chunks, each combining its rows' partial outputs.
    qo_chunks = tl.maximum(rem * CLUSTER // limit, 1)
    row_chunk = (row_tile + qo_chunks - 1) // qo_chunks
    merges = tl.where(split, (row_tile + row_chunk - 1) // row_chunk, 0)
    merge_base = tl.cumsum(merges, 0) - merges
    row0 = req * Q_LEN * HEADS + t * TILE
    for m in range(0, tl.max(merges, 0)):
        live = m < merges
        at = ws_ptr + merge_base + m
        off = m * row_chunk
        tl.store(at + o_m_start, (row0 + off).to(tl.int32), mask=live)
        tl.store(at + o_m_end, (row0 + tl.minimum(off + row_chunk, row_tile)).to(tl.int32), mask=live)
        tl.store(at + o_mp_start, (part_base + off).to(tl.int32), mask=live)
        tl.store(at + o_mp_end, (part_base + chunks * row_tile).to(tl.int32), mask=live)
        tl.store(at + o_m_stride, row_tile.to(tl.int32), mask=live)
    cta = ws_ptr + tl.arange(0, SM_P2)
    idle = (tl.arange(0, SM_P2) >= tl.sum(merges, 0)) & (tl.arange(0, SM_P2) < NUM_SM)  # nothing to merge
    zero = tl.zeros([SM_P2], tl.int32)
    tl.store(cta + o_m_start, zero, mask=idle)
    tl.store(cta + o_m_end, zero, mask=idle)
    tl.store(cta + o_mp_start, zero, mask=idle)
    tl.store(cta + o_mp_end, zero, mask=idle)
    tl.store(cta + o_m_stride, zero, mask=idle)


def write_schedule(int_workspace: torch.Tensor, layout: tuple[int, ...], g: Fa3Geometry,
                   kv_lens: torch.Tensor, page_starts: torch.Tensor) -> None:
    """Write the schedule of ``g.batch_size`` requests with kv lengths ``kv_lens`` (``[B]`` int32,
    new tokens included) whose pages start at ``page_starts`` (``[B]`` int32) in the CSR page
    list into FlashInfer's int workspace (uint8) at ``layout`` (schedule_layout). Causal: query
    token i of a request sees kv positions ``< kv_len - q_len + i + 1``. One launch; no sync."""
    if triton is None:
        raise RuntimeError("flashinfer_mla's device schedule needs Triton, which is not installed")
    r_p2 = triton.next_power_of_2(g.batch_size * g.num_tiles)
    _schedule_kernel[(1,)](
        kv_lens, page_starts, int_workspace.view(torch.int32), *layout,
        NUM_REQ=g.batch_size, NUM_TILES=g.num_tiles, Q_LEN=g.q_len, HEADS=g.num_heads, TILE=g.tile_q,
        CLUSTER=g.cluster_size, NUM_CLUSTERS=g.num_clusters, NUM_SM=g.num_sm,
        R_P2=r_p2, C_BLOCK=max(1, min(triton.next_power_of_2(g.num_clusters + 1), 4096 // r_p2)),
        SM_P2=triton.next_power_of_2(g.num_sm), num_warps=4,
    )
