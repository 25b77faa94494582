"""tokenspeed-mla decode kernel (Blackwell, SM100 family; FP8 KV cache).

Verify, draft steps, draft-extend and (in chunks of 8 query tokens) prefill all run its decode
kernel over the absorbed 576-wide cache. Its split-KV workspace
(``num_sms * num_heads * max_q_len(8) * (kv_lora_rank + 1)`` fp32) is allocated at construction,
so a first request or a graph capture never allocates.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.backends.blackwell.device import sm_count
from attn.base import KV_LORA_RANK, QK_ROPE_DIM, to_cache_dtype
from attn.paged import PagedMLABackend

MAX_Q_LEN = 8


def tokenspeed_workspace_bytes(num_sms: int, num_heads: int) -> int:
    """Split-KV partial outputs + LSE, fp32: ``num_sms * num_heads * 8 * (512 + 1) * 4`` bytes."""
    return num_sms * num_heads * MAX_Q_LEN * (KV_LORA_RANK + 1) * 4


class TokenspeedMLABackend(PagedMLABackend):
    name = "tokenspeed_mla"
    kernel_family = "tokenspeed"
    required_sm = ((10, 0), (10, 3), (10, 7))  # tokenspeed_mla's get_mla_decode_arch takes these only
    page_sizes = (32, 64)
    kv_dtypes = ("fp8_e4m3",)
    max_decode_q_len = MAX_Q_LEN
    compiles_per_q_len = True
    max_heads = 128

    @property
    def workspace_bytes(self) -> int:
        return tokenspeed_workspace_bytes(sm_count(self.kv.device), self.layer.num_heads)

    def _run_decode_kernel(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        custom_mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        from tokenspeed_mla import tokenspeed_mla_decode

        out = tokenspeed_mla_decode(
            to_cache_dtype(query, kv_cache.dtype),
            kv_cache,
            self.workspace.view(torch.int8),
            KV_LORA_RANK,
            QK_ROPE_DIM,
            block_tables,
            seq_lens,
            max_seq_len,
            softmax_scale=self.bmm1_scale(),
            output_scale=self.bmm2_scale(),
            enable_pdl=True,
        )
        return out.to(query.dtype)
