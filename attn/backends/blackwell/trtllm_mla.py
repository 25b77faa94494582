"""FlashInfer trtllm-gen MLA decode (Blackwell, SM100 family), dense and sparse (DeepSeek-V3.2).

Also the prefill/draft-extend backend of decode-only families (cute-dsl). Ragged prefill runs the
decode kernel over chunks of 8 query tokens (the PagedMLABackend default), keeping one absorbed
576-wide cache for every pass. The sparse pass is the same entry point with ``sparse_mla_top_k``:
each query token one request of q_len 1 whose "block table" is its selected slots; the indexer's
top-k is triton_mla's (Triton runs on SM100).
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.backends.blackwell.device import sm_count
from attn.backends.triton_mla import TritonMLABackend
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
    supports_sparse = True
    max_index_topk = 2048  # DeepSeek-V3.2's; the sparse kernel's rows a token
    sparse_topk_multiple = 4  # the selected slots are 16-byte aligned rows of int32
    sparse_fp8_heads = (64, 128)  # the fp8 sparse kernel's head counts: fewer heads are zero-padded up

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

    _run_index_kernel = TritonMLABackend._run_index_kernel  # the indexer's top-k: Triton runs on SM100

    def _run_sparse_kernel(self, q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, 576]`` over slots ``[T, K]`` int32 (the indexer's: chosen rows first, then -1)
        -> ``[T, H, 512]``. Every token is a request of one query token: its valid slots as its
        table (``seq_lens``: how many), K padded with -1 to a multiple of sparse_topk_multiple. An
        fp8 cache takes fp8 queries (scale 1), their heads zero-padded to 64 or 128. A token with
        no slot (none in practice: a token sees its own row) gets 0, read from one dummy row."""
        from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

        tokens, heads = q.shape[:2]
        width = -(-slots.shape[1] // self.sparse_topk_multiple) * self.sparse_topk_multiple
        table = torch.nn.functional.pad(slots, (0, width - slots.shape[1]), value=-1)
        counts = (table >= 0).sum(1, dtype=torch.int32)
        empty = counts == 0
        table = torch.cat([torch.where(empty, 0, table[:, 0])[:, None], table[:, 1:]], dim=1)
        query = to_cache_dtype(q, kv_cache.dtype)
        padded = heads
        if kv_cache.dtype == torch.float8_e4m3fn:
            padded = next((n for n in self.sparse_fp8_heads if n >= heads), heads)
            query = torch.nn.functional.pad(query, (0, 0, 0, padded - heads))
        out = trtllm_batch_decode_with_kv_cache_mla(
            query=query.unsqueeze(1),  # [T, 1, H, 576]
            kv_cache=kv_cache.unsqueeze(1),  # [num_pages, 1, page_size, 576]
            workspace_buffer=self.workspace,
            qk_nope_head_dim=QK_NOPE_HEAD_DIM,
            kv_lora_rank=KV_LORA_RANK,
            qk_rope_head_dim=QK_ROPE_DIM,
            block_tables=table.unsqueeze(1),  # [T, 1, K] slots
            seq_lens=counts.clamp(min=1),
            max_seq_len=width,
            sparse_mla_top_k=width,
            bmm1_scale=self.bmm1_scale(),
            bmm2_scale=self.bmm2_scale(),
            backend=self.flashinfer_backend,
            multi_ctas_kv_counter_buffer=self._counters,
        )
        out = out.view(tokens, padded, KV_LORA_RANK)[:, :heads]
        return torch.where(empty[:, None, None], 0, out.to(q.dtype))
