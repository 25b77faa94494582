"""FlashInfer's BatchMLAPagedAttentionWrapper (FA3 on SM90, FA2 elsewhere).

Its plan() schedules on the host from the kv lengths, so this backend has
``needs_cpu_seq_lens = True``. Eager passes plan in init_forward_metadata from the device
metadata, which FlashInfer copies to the host (a sync per pass). Under CUDA graphs each batch
size gets a graph-mode wrapper whose CSR metadata lives at fixed addresses: the graph packs the
block table into the CSR page list on the device (kv_indices), and
``init_forward_metadata_replay_cuda_graph`` plans from host kv lengths (indptrs derived on the
host, staged in pinned memory) before each replay, so a graphed step does not sync. run() is the
kernel call, on the packed 576-wide query and cache. No custom masks: topk must be 1.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.base import KV_LORA_RANK, QK_ROPE_DIM, AttnBatch, const_arange
from attn.paged import PagedMLABackend


class FlashInferMLABackend(PagedMLABackend):
    name = "flashinfer_mla"
    kernel_family = "flashinfer"
    needs_cpu_seq_lens = True
    supports_cuda_graph = True
    required_sm = (8, 9, 10, 12)
    kv_dtypes = ("auto", "bf16", "fp16")
    workspace_bytes = 128 * 1024 * 1024

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self._backend = "fa3" if torch.cuda.get_device_capability(self.kv.device)[0] == 9 else "fa2"
        # One float workspace (split-KV partials) for this backend's wrappers: they run one at a time.
        self._float_workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.kv.device)
        self.wrapper = BatchMLAPagedAttentionWrapper(self._float_workspace, backend=self._backend)
        self.wrapper_in_use = self.wrapper  # or the batch size's graph-mode wrapper (init_forward_metadata)
        self._graph_wrappers: dict[int, object] = {}  # batch size -> graph-mode wrapper, planned on the host
        self._kv_indices: Optional[torch.Tensor] = None  # graph mode: [max_bs * max_pages + 1] int32, last entry trash
        self._host_csr: Optional[torch.Tensor] = None

    def _allocate_workspace(self) -> Optional[torch.Tensor]:
        return None

    def _plan(self, wrapper, metadata) -> None:
        dtype = self.kv.kv_buffers[0].dtype
        wrapper.plan(
            metadata=metadata, num_heads=self.layer.num_heads, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=QK_ROPE_DIM,
            page_size=self.page_size, causal=True, sm_scale=self.layer.sm_scale, q_data_type=dtype, kv_data_type=dtype,
            query_layout="packed", kv_cache_layout="packed",
        )

    def init_forward_metadata(self, batch: AttnBatch, shared_block_tables: Optional[torch.Tensor] = None) -> None:
        from flashinfer.mla import MLAPlanMetadata

        super().init_forward_metadata(batch, shared_block_tables)
        graph_wrapper = self._graph_wrappers.get(batch.batch_size) if self._graph_buffers is not None else None
        if graph_wrapper is not None:
            self._pack_kv_indices()
            self.wrapper_in_use = graph_wrapper
            return
        md = self.metadata
        self._plan(self.wrapper, MLAPlanMetadata.dense(md.cu_seqlens_q, md.block_tables, md.seq_lens, batch.max_q_len))
        self.wrapper_in_use = self.wrapper

    def _pack_kv_indices(self) -> None:
        """The block table's live pages, packed request after request into ``_kv_indices`` (the
        CSR page list the host plan's kv_indptr describes); dead columns go to the trash entry."""
        md, ps = self.metadata, self.page_size
        live = (md.seq_lens + ps - 1) // ps  # [bs] int32 pages in use
        start = torch.cumsum(live, 0, dtype=torch.int32) - live
        cols = const_arange(md.block_tables.shape[1], live.device)
        trash = self._kv_indices.shape[0] - 1
        dest = torch.where(cols < live[:, None], start[:, None] + cols, trash)
        self._kv_indices.scatter_(0, dest.flatten().long(), md.block_tables.flatten())

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        self._kv_indices = torch.zeros(max_bs * self.max_pages + 1, dtype=torch.int32, device=self.kv.device)
        self._host_csr = torch.zeros(3, max_bs + 1, dtype=torch.int32, pin_memory=True)  # qo_indptr, kv_indptr, kv lens

    @torch.inference_mode()  # the wrappers' buffers are inference tensors wherever planning is first called from
    def init_forward_metadata_replay_cuda_graph(self, bs: int, seq_lens: torch.Tensor, q_len: int) -> None:
        """Plan the graph-mode wrapper of batch size ``bs`` from host kv lengths (``[bs]`` int32,
        new tokens included) and ``q_len`` query tokens per request; no device-to-host copy.
        The pinned staging rows are reused: one plan per backend between two host syncs."""
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        if self._graph_buffers is None:
            raise RuntimeError(f"{self.name}: init_cuda_graph_state must come before graph planning")
        device = self.kv.device
        if bs not in self._graph_wrappers:
            self._graph_wrappers[bs] = BatchMLAPagedAttentionWrapper(
                self._float_workspace, use_cuda_graph=True, backend=self._backend,
                qo_indptr=torch.zeros(bs + 1, dtype=torch.int32, device=device),
                kv_indptr=torch.zeros(bs + 1, dtype=torch.int32, device=device),
                kv_indices=self._kv_indices, kv_len_arr=torch.zeros(bs, dtype=torch.int32, device=device),
            )
        qo_indptr, kv_indptr, kv_lens = self._host_csr[0, : bs + 1], self._host_csr[1, : bs + 1], self._host_csr[2, :bs]
        torch.arange(0, (bs + 1) * q_len, q_len, dtype=torch.int32, out=qo_indptr)
        kv_lens.copy_(seq_lens)
        torch.cumsum((kv_lens + self.page_size - 1) // self.page_size, 0, dtype=torch.int32, out=kv_indptr[1:])
        metadata = MLAPlanMetadata.csr(qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                                       kv_indices=self._kv_indices[: int(kv_indptr[-1])], kv_len_arr=kv_lens)
        self._plan(self._graph_wrappers[bs], metadata)

    def _run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """query ``[T, H, 576]``; kv_cache ``[P, ps, 576]`` -> ``[T, H, 512]``."""
        out = self.wrapper_in_use.run(query=query.to(kv_cache.dtype), kv_cache=kv_cache)  # queries in the cache's dtype
        return out.to(query.dtype)

    def _run_decode_kernel(self, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask):
        bs, q_len = query.shape[:2]
        return self._run(query.flatten(0, 1), kv_cache).view(bs, q_len, *query.shape[2:3], KV_LORA_RANK)

    def _run_prefill_kernel(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, max_seq_len):
        return self._run(query, kv_cache)
