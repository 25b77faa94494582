"""Our Triton MLA kernel on Hopper: paged, split-KV, tree masks, no host sync, graph safe."""

from __future__ import annotations

import torch

from attn.paged import RaggedKernelBackend


class TritonMLABackend(RaggedKernelBackend):
    name = "triton_mla"
    kernel_family = "triton"
    required_sm = (8, 9, 10, 12)
    kv_dtypes = ("auto", "bf16", "fp16", "fp8_e4m3")

    def _run_ragged_kernel(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, custom_mask):
        from attn.triton_mla_kernel import mla_paged_attention

        # The kernel takes queries in the cache's 16-bit dtype (bf16 for an fp8 cache).
        q_dtype = kv_cache.dtype if kv_cache.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        out = mla_paged_attention(
            query.to(q_dtype), kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, self.layer.sm_scale,
            custom_mask=custom_mask, kv_scale=self.bmm2_scale(),
        )
        return out.to(query.dtype)
