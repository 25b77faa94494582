"""FlashInfer's BatchMLAPagedAttentionWrapper (FA3 on SM90, FA2 elsewhere).

Its plan() schedules on the host from the kv lengths (it copies the dense block-table metadata's
seq_lens to the host: a sync per pass), so this backend has ``needs_cpu_seq_lens = True`` and
plans in init_forward_metadata, outside any graph; run() is the kernel call, on the packed
576-wide query and cache. No custom masks: topk must be 1.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.base import KV_LORA_RANK, QK_ROPE_DIM, AttnBatch
from attn.paged import PagedMLABackend


class FlashInferMLABackend(PagedMLABackend):
    name = "flashinfer_mla"
    kernel_family = "flashinfer"
    needs_cpu_seq_lens = True
    supports_cuda_graph = False
    required_sm = (8, 9, 10, 12)
    kv_dtypes = ("auto", "bf16", "fp16")
    workspace_bytes = 128 * 1024 * 1024

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        backend = "fa3" if torch.cuda.get_device_capability(self.kv.device)[0] == 9 else "fa2"
        # A float workspace of its own: the wrapper keeps its plan in it.
        self.wrapper = BatchMLAPagedAttentionWrapper(torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.kv.device), backend=backend)

    def _allocate_workspace(self) -> Optional[torch.Tensor]:
        return None

    def init_forward_metadata(self, batch: AttnBatch, shared_block_tables: Optional[torch.Tensor] = None) -> None:
        super().init_forward_metadata(batch, shared_block_tables)
        from flashinfer.mla import MLAPlanMetadata

        md = self.metadata
        dtype = self.kv.kv_buffers[0].dtype
        self.wrapper.plan(
            metadata=MLAPlanMetadata.dense(md.cu_seqlens_q, md.block_tables, md.seq_lens, batch.max_q_len),
            num_heads=self.layer.num_heads, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=QK_ROPE_DIM,
            page_size=self.page_size, causal=True, sm_scale=self.layer.sm_scale, q_data_type=dtype, kv_data_type=dtype,
            query_layout="packed", kv_cache_layout="packed",
        )

    def _run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """query ``[T, H, 576]``; kv_cache ``[P, ps, 576]`` -> ``[T, H, 512]``."""
        out = self.wrapper.run(query=query.to(kv_cache.dtype), kv_cache=kv_cache)  # queries in the cache's dtype
        return out.to(query.dtype)

    def _run_decode_kernel(self, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask):
        bs, q_len = query.shape[:2]
        return self._run(query.flatten(0, 1), kv_cache).view(bs, q_len, *query.shape[2:3], KV_LORA_RANK)

    def _run_prefill_kernel(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, max_seq_len):
        return self._run(query, kv_cache)
