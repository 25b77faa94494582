"""FlashInfer's BatchMLAPagedAttentionWrapper (FA3 on SM90, FA2 elsewhere).

Its plan() schedules on the host from the kv lengths, so this backend needs seq_lens on the
host (``needs_cpu_seq_lens = True``) and plans in init_forward_metadata, outside any graph;
run() is the kernel call. No custom masks: topk must be 1.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.base import KV_LORA_RANK, AttnBatch
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
        self._planned: Optional[tuple] = None

    def _allocate_workspace(self) -> Optional[torch.Tensor]:
        return None

    def init_forward_metadata(self, batch: AttnBatch, shared_block_tables: Optional[torch.Tensor] = None) -> None:
        super().init_forward_metadata(batch, shared_block_tables)
        if batch.seq_lens_cpu is None:
            raise ValueError("flashinfer_mla plans on the host: the batch must carry seq_lens_cpu")
        md, bs = self.metadata, batch.batch_size
        device = self.kv.device
        kv_indptr = torch.arange(bs + 1, dtype=torch.int32, device=device) * self.max_pages
        self.wrapper.plan(
            batch.cu_seqlens_q.int(), kv_indptr, md.block_tables.flatten(), batch.seq_lens_cpu.int(),
            self.layer.num_heads, KV_LORA_RANK, 64, self.page_size, True, self.layer.sm_scale,
            self.kv.kv_buffers[0].dtype,
            self.kv.kv_buffers[0].dtype,
        )

    def _run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """query ``[T, H, 576]``; kv_cache ``[P, ps, 576]`` -> ``[T, H, 512]``."""
        q = query.to(kv_cache.dtype)  # the kernel takes queries in the cache's 16-bit dtype
        out = self.wrapper.run(q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:], kv_cache[..., :KV_LORA_RANK], kv_cache[..., KV_LORA_RANK:])
        return out.to(query.dtype)

    def _run_decode_kernel(self, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask):
        bs, q_len = query.shape[:2]
        return self._run(query.flatten(0, 1), kv_cache).view(bs, q_len, *query.shape[2:3], KV_LORA_RANK)

    def _run_prefill_kernel(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, max_seq_len):
        return self._run(query, kv_cache)
