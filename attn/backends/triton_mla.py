"""Our Triton MLA kernel on Hopper: paged, split-KV, tree masks, no host sync, graph safe; and its
sparse variant (DeepSeek-V3.2): the indexer's top-k (attn.kernels.triton_mla.indexer) and attention
over the selected rows (attn.kernels.triton_mla.sparse), alike."""

from __future__ import annotations

import torch

from attn.base import KV_DIM
from attn.paged import RaggedKernelBackend


class TritonMLABackend(RaggedKernelBackend):
    name = "triton_mla"
    kernel_family = "triton"
    required_sm = (8, 9, 10, 12)
    kv_dtypes = ("auto", "bf16", "fp16", "fp8_e4m3")
    supports_sparse = True
    max_index_topk = None  # any: the sparse kernel cuts a token's rows into split chunks

    def _query_dtype(self) -> torch.dtype:
        """The kernel takes queries in the cache's 16-bit dtype (bf16 for an fp8 cache)."""
        dtype = self.kv.kv_buffers[0].dtype
        return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16

    def _run_ragged_kernel(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, custom_mask,
                           max_seq_len):
        from attn.kernels.triton_mla.kernel import mla_paged_attention

        out = mla_paged_attention(
            query.to(self._query_dtype()), kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len,
            self.layer.sm_scale, custom_mask=custom_mask, kv_scale=self.bmm2_scale(), max_kv_len=max_seq_len,
        )
        return out.to(query.dtype)

    def _run_index_kernel(self, q, weights, index_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, topk,
                          custom_mask, max_seq_len):
        from attn.kernels.triton_mla.indexer import indexer_topk

        return indexer_topk(q, weights, index_cache, block_tables, seq_lens, cu_seqlens_q, topk, custom_mask,
                            max_kv_len=max_seq_len)

    def _run_sparse_kernel(self, q, kv_cache, slots):
        from attn.kernels.triton_mla.sparse import sparse_mla_decode

        out = sparse_mla_decode(q.to(self._query_dtype()), kv_cache, slots, self.layer.sm_scale, self.bmm2_scale())
        return out.to(q.dtype)

    def kv_len_bounds(self, batch_size: int, q_len: int) -> tuple[int, ...]:
        """The kv lengths up to which the kernel plans another launch than for the next longer
        one (attn.kernels.triton_mla.kernel.kv_plan_bounds): the latency-bound narrow Triton tile
        where the longest context's plan runs the wgmma tile, and fewer splits for shorter contexts,
        which a plan for the longest context would leave empty (docs/kernels.md)."""
        from attn.kernels.triton_mla.kernel import kv_plan_bounds

        cache = self.kv.kv_buffers[0]
        query = cache.new_empty(1, self.layer.num_heads, KV_DIM, dtype=self._query_dtype())
        return kv_plan_bounds(query, cache, self.max_pages, batch_size, q_len)
