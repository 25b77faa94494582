"""Plain-torch paged MLA attention: the reference every kernel is tested against.

Same contract as :func:`attn.triton_mla_kernel.mla_paged_attention`. Vectorised over the batch
(no host sync, no data-dependent shapes), so it also runs inside CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.base import KV_DIM, KV_LORA_RANK

_CHUNK_BYTES = 256 << 20  # fp32 scores of one chunk of query positions, all requests and heads


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
    """Attention of packed latent queries over a paged latent cache.

    q: ``[T, H, 576]``; kv_cache: ``[num_pages, page_size, 576]`` (K = 576 dims, V = first 512);
    block_tables: ``[B, max_pages]`` int32; seq_lens: ``[B]`` int32 kv length including the new
    tokens; cu_seqlens_q: ``[B + 1]`` int32; custom_mask: ``[B, max_q_len, M]`` bool or None.
    Query i of request b sits at kv index ``seq_lens[b] - q_len_b + i`` and sees kv indices up to
    it (causal), or with a mask every index before ``seq_lens[b] - M`` plus the masked-in ones of
    the last M. A query that sees nothing outputs 0. Rows from cu_seqlens_q[B] on are padding:
    0 in the result, left as they were in ``out``. Returns ``[T, H, 512]`` in q's dtype.
    max_q_len bounds every request's query count (a host value, as for the kernels; queries past it
    come back 0). Queries are padded to ``[B, max_q_len]``, so the work grows with B x max_q_len
    (one long prompt among short ones pays for the padding). Memory: the requests' kv ``[B, table
    width, 576]`` fp32 and, a chunk of query positions at a time, scores and probabilities of up to
    _CHUNK_BYTES each (one query position at least), not a copy of a request's kv per query token.
    """
    num_tokens, num_heads, dim = q.shape
    if dim != KV_DIM or kv_cache.shape[-1] != KV_DIM:
        raise ValueError(f"expected 576-wide query and cache rows, got q {tuple(q.shape)}, cache {tuple(kv_cache.shape)}")
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
        kv = torch.where(in_request[..., None], kv_cache.reshape(-1, KV_DIM)[slots].float() * kv_scale, 0.0)
        # Queries padded per request, [B, max_q_len] cells (no kv copy per token), in chunks of
        # query positions whose scores stay within _CHUNK_BYTES.
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        chunk = max(1, min(max_q_len, _CHUNK_BYTES // (batch_size * num_heads * max_kv * 4)))
        for first in range(0, max_q_len, chunk):
            idx = torch.arange(first, min(first + chunk, max_q_len), device=q.device)  # [C]
            is_query = idx[None, :] < q_lens[:, None]  # [B, C]
            token = torch.where(is_query, cu_seqlens_q[:-1].long()[:, None] + idx, num_tokens)  # trash row if not
            query_pos = seq_lens[:, None] - q_lens[:, None] + idx  # [B, C]
            visible = in_request[:, None, :] & is_query[..., None]  # [B, C, max_kv]
            if custom_mask is None:
                visible &= offsets <= query_pos[..., None]
            else:
                mask_len = custom_mask.shape[2]
                region_start = (seq_lens - mask_len)[:, None, None]  # [B, 1, 1]
                rel = (offsets - region_start).clamp(0, mask_len - 1).expand(-1, idx.shape[0], -1)
                rows = custom_mask[:, idx.clamp(max=custom_mask.shape[1] - 1)]  # [B, C, M]
                visible &= (offsets < region_start) | torch.gather(rows, 2, rel)
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
