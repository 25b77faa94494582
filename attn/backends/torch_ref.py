"""The plain-torch backend and its attention function: the reference every kernel is tested against.

:func:`paged_mla_reference` has the contract of
:func:`attn.kernels.triton_mla.kernel.mla_paged_attention`, vectorised over the batch (no host
sync, no data-dependent shapes), so it also runs inside CUDA graphs. :class:`TorchRefBackend`
runs it in fp32 over any cache dtype. Runs anywhere.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.base import KV_DIM, KV_LORA_RANK
from attn.paged import RaggedKernelBackend

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


class TorchRefBackend(RaggedKernelBackend):
    """Paged MLA attention in plain torch (fp32 math); supports tree masks and CUDA graphs."""

    name = "torch_ref"
    kernel_family = "torch_ref"
    kv_dtypes = (*RaggedKernelBackend.kv_dtypes, "fp64")  # any cache dtype: attention math is fp32 regardless

    def _run_ragged_kernel(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, custom_mask,
                           max_seq_len):
        return paged_mla_reference(
            query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, self.layer.sm_scale,
            custom_mask=custom_mask, kv_scale=self.bmm2_scale(),
        )
