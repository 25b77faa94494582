"""Our Triton MLA kernel on Hopper: paged, split-KV, tree masks, no host sync, graph safe."""

from __future__ import annotations

from typing import Optional

import torch

from attn.paged import PagedMLABackend


class TritonMLABackend(PagedMLABackend):
    name = "triton_mla"
    kernel_family = "triton"
    supports_tree_mask = True
    required_sm = (8, 9, 10, 12)
    kv_dtypes = ("auto", "bf16", "fp16", "fp8_e4m3")

    def _run_decode_kernel(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        custom_mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        bs, q_len = query.shape[:2]
        cu = torch.arange(0, (bs + 1) * q_len, q_len, dtype=torch.int32, device=query.device)
        out = self._run_prefill_kernel(query.flatten(0, 1), kv_cache, block_tables, seq_lens, cu, q_len, max_seq_len, custom_mask)
        return out.view(bs, q_len, *out.shape[1:])

    def _run_prefill_kernel(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        max_q_len: int,
        max_seq_len: int,
        custom_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        from attn.triton_mla_kernel import mla_paged_attention

        # The kernel takes queries in the cache's 16-bit dtype (bf16 for an fp8 cache).
        q_dtype = kv_cache.dtype if kv_cache.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        out = mla_paged_attention(
            query.to(q_dtype), kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, self.layer.sm_scale,
            custom_mask=custom_mask, kv_scale=self.bmm2_scale(),
        )
        return out.to(query.dtype)
