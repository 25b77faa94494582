"""The plain-torch backend and its attention functions: the references every kernel is tested against.

:func:`paged_mla_reference` has the contract of
:func:`attn.kernels.triton_mla.kernel.mla_paged_attention`, vectorised over the batch (no host
sync, no data-dependent shapes), so it also runs inside CUDA graphs; :func:`indexer_topk_reference`
and :func:`sparse_mla_reference` are DeepSeek-V3.2's sparse passes (``index_topk``,
``forward_sparse``), alike. :class:`TorchRefBackend` runs them in fp32 over any cache dtype. Runs anywhere.
"""

from __future__ import annotations

from typing import Optional

import torch

import torch.nn.functional as F

from attn.base import KV_DIM, KV_LORA_RANK, decode_kv, kv_row_width
from attn.paged import RaggedKernelBackend

_CHUNK_BYTES = 256 << 20  # fp32 scores of one chunk of query positions, all requests and heads


def visible_positions(offsets: torch.Tensor, seq_lens: torch.Tensor, query_pos: torch.Tensor,
                      mask_rows: Optional[torch.Tensor]) -> torch.Tensor:
    """``[..., K]`` bool: which kv positions ``offsets`` ``[K]`` a query at kv position ``query_pos``
    ``[...]`` of a request of kv length ``seq_lens`` ``[...]`` sees. mask_rows ``[..., M]`` bool: the
    query's tree-mask row over its request's last M positions (earlier ones always visible); None:
    causal."""
    seen = offsets < seq_lens[..., None]
    if mask_rows is None:
        return seen & (offsets <= query_pos[..., None])
    mask_len = mask_rows.shape[-1]
    region_start = (seq_lens - mask_len)[..., None]  # [..., 1]
    rel = (offsets - region_start).clamp(0, mask_len - 1)
    return seen & ((offsets < region_start) | torch.gather(mask_rows, -1, rel))


def paged_mla_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_q_len: int,
    sm_scale: float,
    custom_mask: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of packed latent queries over a paged latent cache: mla_paged_attention's contract.

    q ``[T, H, 576]``; kv_cache ``[num_pages, page_size, 576]`` (K the row, V its first 512);
    block_tables ``[B, max_pages]`` int32; seq_lens ``[B]`` int32 (new tokens included);
    cu_seqlens_q ``[B + 1]`` int32. Query i of request b sits at kv index ``seq_lens[b] - q_len_b +
    i`` and sees up to it, or with custom_mask ``[B, max_q_len, M]`` bool every index before
    ``seq_lens[b] - M`` and the masked-in ones of the last M. Returns ``[T, H, 512]`` in q's dtype: 0
    for a query that sees nothing or lies past max_q_len; rows from cu_seqlens_q[B] on are padding
    (0, and left as they were in ``out``). Work grows with B x max_q_len (queries padded per
    request); memory: the requests' kv ``[B, table width, 576]`` fp32, and scores of up to
    _CHUNK_BYTES a chunk of query positions (one position at least), no kv copy per query token.
    """
    num_tokens, num_heads, dim = q.shape
    if dim != KV_DIM or kv_cache.shape[-1] != kv_row_width(kv_cache.dtype):
        raise ValueError(f"expected 576-wide queries and cache rows (656 bytes: fp8_v32), got q {tuple(q.shape)}, "
                         f"cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
    page_size = kv_cache.shape[1]
    batch_size, max_pages = block_tables.shape
    max_kv = max_pages * page_size
    result = torch.zeros(num_tokens + 1, num_heads, KV_LORA_RANK, dtype=q.dtype, device=q.device)  # + a trash row
    if num_tokens > 0 and batch_size > 0 and max_q_len > 0:
        # Gather every request's kv rows up to the static table width: [B, max_kv, 576]. Pages past
        # a request's length may hold anything (never read, as in the kernels): slot 0 stands in for
        # them, and its rows are zeroed, as a NaN there would survive its zero probability.
        offsets = torch.arange(max_kv, device=q.device)
        seq_lens = seq_lens.long()
        in_request = offsets[None, :] < seq_lens[:, None]  # [B, max_kv]
        slots = block_tables.long()[:, offsets // page_size] * page_size + offsets % page_size
        slots = torch.where(in_request, slots, 0)
        cached = kv_cache.reshape(-1, kv_cache.shape[-1])[slots]
        kv = torch.where(in_request[..., None], decode_kv(cached, kv_scale), 0.0)
        # Queries padded per request, [B, max_q_len] cells (no kv copy per token), in chunks of
        # query positions whose scores stay within _CHUNK_BYTES.
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        chunk = max(1, min(max_q_len, _CHUNK_BYTES // (batch_size * num_heads * max_kv * 4)))
        for first in range(0, max_q_len, chunk):
            idx = torch.arange(first, min(first + chunk, max_q_len), device=q.device)  # [C]
            is_query = idx[None, :] < q_lens[:, None]  # [B, C]
            token = torch.where(is_query, cu_seqlens_q[:-1].long()[:, None] + idx, num_tokens)  # trash row if not
            query_pos = seq_lens[:, None] - q_lens[:, None] + idx  # [B, C]
            mask_rows = None if custom_mask is None else custom_mask[:, idx.clamp(max=custom_mask.shape[1] - 1)]
            visible = is_query[..., None] & visible_positions(offsets, seq_lens[:, None].expand_as(query_pos),
                                                              query_pos, mask_rows)  # [B, C, max_kv]
            q_cells = q[token.clamp(max=num_tokens - 1)].float()  # [B, C, H, 576]
            scores = torch.einsum("bchd,bkd->bchk", q_cells, kv).mul_(sm_scale)
            scores.masked_fill_(~visible[:, :, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # all-masked rows -> 0
            del scores
            cells = torch.einsum("bchk,bkd->bchd", probs, kv[..., :KV_LORA_RANK])
            result.index_copy_(0, token.flatten(), cells.flatten(0, 1).to(q.dtype))
    result = result[:num_tokens]
    if out is None:
        return result
    is_query = torch.arange(num_tokens, device=q.device) < cu_seqlens_q[-1]  # [T]: False for padding rows
    out.copy_(torch.where(is_query[:, None, None], result, out))
    return out


def indexer_topk_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    topk: int,
    custom_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """DeepSeek-V3.2's lightning indexer over a paged key cache: ``index_topk``'s contract.

    q ``[T, Hi, D]``; weights ``[T, Hi]`` fp32; index_cache ``[num_pages, page_size, D]``; the rest
    as paged_mla_reference's. Token i of request b sits at kv position ``seq_lens[b] - q_len_b + i``
    and scores each position it sees (causal, or custom_mask's) ``sum_h weights[t, h] * relu(q[t, h]
    . k)`` in fp32. Returns ``[T, topk]`` int32 slots of the best, best first, -1 past the positions
    it sees (all -1 for padding tokens from cu_seqlens_q[B] on). Memory: each token's request's keys
    ``[T, table width, D]`` fp32.
    """
    num_tokens, _, dim = q.shape
    batch_size, max_pages = block_tables.shape
    page_size = index_cache.shape[1]
    offsets = torch.arange(max_pages * page_size, device=q.device)
    token = torch.arange(num_tokens, device=q.device)
    cu = cu_seqlens_q.long()
    req = torch.searchsorted(cu[1:], token, right=True)  # [T]: the request of each token; B for padding
    is_query = req < batch_size
    req = req.clamp(max=batch_size - 1)
    index_in_req = token - cu[req]
    kv_len = seq_lens.long()[req]
    query_pos = kv_len - (cu[req + 1] - cu[req]) + index_in_req
    mask_rows = None if custom_mask is None else custom_mask[req, index_in_req.clamp(0, custom_mask.shape[1] - 1)]
    seen = is_query[:, None] & visible_positions(offsets, kv_len, query_pos, mask_rows)  # [T, max_kv]
    slots = block_tables.long()[req][:, offsets // page_size] * page_size + offsets % page_size  # [T, max_kv]
    keys = index_cache.reshape(-1, dim)[torch.where(seen, slots, 0)].float()  # [T, max_kv, D]
    scores = torch.einsum("thd,tkd->thk", q.float(), keys).relu_()
    index = torch.einsum("th,thk->tk", weights.float(), scores).masked_fill_(~seen, float("-inf"))
    best = index.topk(min(topk, offsets.shape[0]), dim=-1)
    chosen = torch.where(best.values > float("-inf"), slots.gather(1, best.indices), -1)
    return F.pad(chosen, (0, topk - chosen.shape[1]), value=-1).int()


def sparse_mla_reference(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, sm_scale: float,
                         kv_scale: float = 1.0) -> torch.Tensor:
    """Attention of latent queries q ``[T, H, 576]`` over their own rows ``slots`` ``[T, K]`` int32
    (cache slots, -1: none) of kv_cache ``[num_pages, page_size, 576]`` (K the row, V its first 512;
    fp8_v32's 656-byte rows dequantised: attn.base.decode_kv).
    Returns ``[T, H, 512]`` in q's dtype, 0 for a token with no row; fp32 math over ``[T, K, 576]``
    gathered rows."""
    valid = slots >= 0
    kv = decode_kv(kv_cache.reshape(-1, kv_cache.shape[-1])[torch.where(valid, slots, 0).long()], kv_scale)
    kv = torch.where(valid[..., None], kv, 0.0)  # a NaN in a stand-in row would survive its zero probability
    scores = torch.einsum("thd,tkd->thk", q.float(), kv).mul_(sm_scale)
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a token with no row -> 0
    return torch.einsum("thk,tkd->thd", probs, kv[..., :KV_LORA_RANK]).to(q.dtype)


class TorchRefBackend(RaggedKernelBackend):
    """Paged MLA attention in plain torch (fp32 math); supports tree masks, sparse passes and CUDA graphs."""

    name = "torch_ref"
    kernel_family = "torch_ref"
    supports_sparse = True
    kv_dtypes = (*RaggedKernelBackend.kv_dtypes, "fp64", "fp8_v32")  # any cache dtype: the math is fp32 regardless

    def _run_ragged_kernel(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, custom_mask,
                           max_seq_len):
        return paged_mla_reference(
            query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, self.layer.sm_scale,
            custom_mask=custom_mask, kv_scale=self.bmm2_scale(),
        )

    def _run_index_kernel(self, q, weights, index_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, topk,
                          custom_mask, max_seq_len):
        return indexer_topk_reference(q, weights, index_cache, block_tables, seq_lens, cu_seqlens_q, topk, custom_mask)

    def _run_sparse_kernel(self, q, kv_cache, slots):
        return sparse_mla_reference(q, kv_cache, slots, self.layer.sm_scale, self.bmm2_scale())
