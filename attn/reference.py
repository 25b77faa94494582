"""Plain-torch paged MLA attention: the reference every kernel is tested against.

Same contract as :func:`attn.triton_mla_kernel.mla_paged_attention`. Vectorised over the batch
(no host sync, no data-dependent shapes), so it also runs inside CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.base import KV_DIM, KV_LORA_RANK


def token_to_request(cu_seqlens_q: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map each packed query token to (request index, index within its request).

    cu_seqlens_q: ``[B + 1]`` int32. Returns two ``[num_tokens]`` int64 tensors. Tokens from
    cu_seqlens_q[B] on (padding) count as the last request's, past its query tokens.
    """
    tokens = torch.arange(num_tokens, device=cu_seqlens_q.device)
    req = torch.searchsorted(cu_seqlens_q[1:].long(), tokens, right=True).clamp(max=cu_seqlens_q.shape[0] - 2)
    return req, tokens - cu_seqlens_q.long()[req]


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
    """
    num_tokens, num_heads, dim = q.shape
    if dim != KV_DIM or kv_cache.shape[-1] != KV_DIM:
        raise ValueError(f"expected 576-wide query and cache rows, got q {tuple(q.shape)}, cache {tuple(kv_cache.shape)}")
    page_size = kv_cache.shape[1]
    batch_size, max_pages = block_tables.shape
    max_kv = max_pages * page_size

    # Gather every request's kv rows up to the static table width: [B, max_kv, 576]. Pages past a
    # request's length may hold anything (never read, as in the kernels): slot 0 stands in for them,
    # and its rows are zeroed, as a NaN there would survive its zero probability.
    offsets = torch.arange(max_kv, device=q.device)
    in_request = offsets[None, :] < seq_lens.long()[:, None]  # [B, max_kv]
    slots = block_tables.long()[:, offsets // page_size] * page_size + offsets % page_size
    slots = torch.where(in_request, slots, 0)
    kv = torch.where(in_request[..., None], kv_cache.reshape(-1, KV_DIM)[slots].float() * kv_scale, 0.0)

    req, idx = token_to_request(cu_seqlens_q, num_tokens)
    seq_lens = seq_lens.long()
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    is_query = idx < q_lens[req]  # [T]: False for padding rows
    query_pos = seq_lens[req] - q_lens[req] + idx  # [T]
    visible = (offsets[None, :] < seq_lens[req][:, None]) & is_query[:, None]  # [T, max_kv]
    if custom_mask is None:
        visible &= offsets[None, :] <= query_pos[:, None]
    else:
        mask_len = custom_mask.shape[2]
        region_start = seq_lens[req] - mask_len  # [T]
        rel = (offsets[None, :] - region_start[:, None]).clamp(0, mask_len - 1)
        in_region = offsets[None, :] >= region_start[:, None]
        masked_in = torch.gather(custom_mask[req, idx.clamp(max=custom_mask.shape[1] - 1)], 1, rel)
        visible &= ~in_region | masked_in

    kv_of_token = kv[req]  # [T, max_kv, 576]: fine for a reference, not for long contexts
    scores = torch.einsum("thd,tkd->thk", q.float(), kv_of_token) * sm_scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    result = torch.einsum("thk,tkd->thd", probs, kv_of_token[..., :KV_LORA_RANK]).to(q.dtype)
    if out is None:
        return result
    out.copy_(torch.where(is_query[:, None, None], result, out))
    return out
