"""The plain-torch backend: the reference every other backend is tested against. Runs anywhere."""

from __future__ import annotations

from typing import Optional

import torch

from attn.paged import PagedMLABackend
from attn.reference import paged_mla_reference


class TorchRefBackend(PagedMLABackend):
    """Paged MLA attention in plain torch (fp32 math); supports tree masks and CUDA graphs."""

    name = "torch_ref"
    kernel_family = "torch_ref"
    supports_tree_mask = True

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
        out = paged_mla_reference(
            query.flatten(0, 1), kv_cache, block_tables, seq_lens, cu, q_len, self.layer.sm_scale,
            custom_mask=custom_mask, kv_scale=self.bmm2_scale(),
        )
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
    ) -> torch.Tensor:
        return paged_mla_reference(
            query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, self.layer.sm_scale,
            kv_scale=self.bmm2_scale(),
        )
