"""FlashInfer trtllm-gen MLA decode (Blackwell, SM100 family).

Also the prefill/draft-extend backend of decode-only families (cute-dsl). Ragged prefill runs the
decode kernel over chunks of 8 query tokens (the PagedMLABackend default), keeping one absorbed
576-wide cache for every pass.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.backends.blackwell.device import sm_count
from attn.base import KV_LORA_RANK, QK_ROPE_DIM, to_cache_dtype
from attn.paged import PagedMLABackend

QK_NOPE_HEAD_DIM = 128


class TrtllmMLABackend(PagedMLABackend):
    name = "trtllm_mla"
    kernel_family = "trtllm_gen"
    flashinfer_backend = "trtllm-gen"
    required_sm = (10,)
    page_sizes = (32, 64)
    kv_dtypes = ("auto", "bf16", "fp8_e4m3")
    max_decode_q_len = 8
    max_heads = 128
    skipped_heads = range(65, 128)  # FlashInfer's trtllm-gen entry point refuses these
    workspace_bytes = 150 * 1024 * 1024
    # trtllm-gen's multi-CTA split-KV semaphores: a zeroed buffer the backend owns (the kernel
    # resets them after every launch); FlashInfer allocates and zeroes one per call when none is
    # passed, inside captured graphs too. cute-dsl has none.
    multi_cta_counters = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._counters: Optional[torch.Tensor] = None
        if self.multi_cta_counters:
            from flashinfer.utils import get_trtllm_gen_multi_ctas_kv_counter_bytes

            num_bytes = get_trtllm_gen_multi_ctas_kv_counter_bytes(
                self.max_batch_size, self.layer.num_heads, sm_count(self.kv.device))
            self._counters = torch.zeros(num_bytes, dtype=torch.uint8, device=self.kv.device)

    def _run_decode_kernel(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        custom_mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

        # The kernel takes the query in the cache's dtype (fp8 queries for an fp8 cache, q_scale 1)
        # and writes bf16.
        out = trtllm_batch_decode_with_kv_cache_mla(
            query=to_cache_dtype(query, kv_cache.dtype),
            kv_cache=kv_cache.unsqueeze(1),  # [num_pages, 1, page_size, 576]
            workspace_buffer=self.workspace,
            qk_nope_head_dim=QK_NOPE_HEAD_DIM,
            kv_lora_rank=KV_LORA_RANK,
            qk_rope_head_dim=QK_ROPE_DIM,
            block_tables=block_tables,
            seq_lens=seq_lens,
            max_seq_len=max_seq_len,
            bmm1_scale=self.bmm1_scale(),
            bmm2_scale=self.bmm2_scale(),
            backend=self.flashinfer_backend,
            multi_ctas_kv_counter_buffer=self._counters,
        )
        return out.to(query.dtype)
