"""FlashInfer's BatchMLAPagedAttentionWrapper (FA3 on SM90, FA2 elsewhere), scheduled on the device.

FlashInfer plans its persistent MLA kernel on the host from host kv lengths. Here the uniform
passes (decode, draft steps, verify, draft-extend) get their schedule from ``attn.kernels.fa3_plan``,
built on the device from the device metadata: the block table is packed into the CSR page list
(``kv_indices``) and the schedule is written into the wrapper's int workspace, so those passes
need no host sync and capture in CUDA graphs with nothing to do on the host before a replay
(``needs_cpu_seq_lens = False``). Each wrapper is planned once on the host, for one request,
to compile the kernel and fix the workspace layout, which does not depend on the batch. Ragged
prefill keeps FlashInfer's host plan (a sync, outside the spec step). run() is the kernel call,
on the packed 576-wide query and cache. No custom masks: topk must be 1.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.base import KV_LORA_RANK, QK_ROPE_DIM, AttnBatch, const_arange
from attn.kernels.fa3_plan import MAX_WORKS, Fa3Geometry, schedule_layout, write_schedule
from attn.paged import PagedMLABackend


class FlashInferMLABackend(PagedMLABackend):
    name = "flashinfer_mla"
    kernel_family = "flashinfer"
    required_sm = (8, 9, 10, 12)
    kv_dtypes = ("auto", "bf16", "fp16")
    workspace_bytes = 128 * 1024 * 1024

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        device = self.kv.device
        self._backend = "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"
        self._num_sm = torch.cuda.get_device_properties(device).multi_processor_count
        # The largest uniform pass this backend serves must fit FlashInfer's tiles (raises if not).
        Fa3Geometry(self.max_batch_size, self.max_q_len, self.layer.num_heads, self._num_sm)
        # A prefill plan holds MAX_WORKS work items: a query tile per 128 rows of tokens x heads, one more
        # per request at most, and split kv adds at most one per cluster (at most one per SM).
        heads = self.layer.num_heads
        self.max_prefill_tokens = (MAX_WORKS - self.max_batch_size - self._num_sm) * 128 // heads
        # The family's float workspace (split-KV partials, attn.workspace) serves every wrapper of every
        # flashinfer_mla backend: passes run one at a time, in stream order.
        self.wrapper = BatchMLAPagedAttentionWrapper(self.workspace, backend=self._backend)  # host-planned prefill
        self.wrapper_in_use = self.wrapper  # or a device-scheduled wrapper (init_forward_metadata)
        self._scheduled: dict[int, object] = {}  # cluster size -> wrapper planned once, scheduled on the device
        self._layouts: dict[Fa3Geometry, tuple[int, ...]] = {}  # where each geometry's schedule goes
        # The CSR page list of a uniform pass: [max_bs * max_pages + 1] int32, the last entry trash.
        self._kv_indices = torch.zeros(self.max_batch_size * self.max_pages + 1, dtype=torch.int32, device=device)

    def _plan(self, wrapper, metadata) -> None:
        dtype = self.kv.kv_buffers[0].dtype
        wrapper.plan(
            metadata=metadata, num_heads=self.layer.num_heads, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=QK_ROPE_DIM,
            page_size=self.page_size, causal=True, sm_scale=self.layer.sm_scale, q_data_type=dtype, kv_data_type=dtype,
            query_layout="packed", kv_cache_layout="packed",
        )

    def init_forward_metadata(self, batch: AttnBatch, shared_block_tables: Optional[torch.Tensor] = None) -> None:
        super().init_forward_metadata(batch, shared_block_tables)
        try:
            self._schedule(batch)
        except BaseException:
            self.metadata = None  # forward must not run the last pass's schedule with this pass's metadata
            raise

    def _schedule(self, batch: AttnBatch) -> None:
        """Plan the pass (wrapper_in_use): on the host for variable query lengths, else on the device."""
        from flashinfer.mla import MLAPlanMetadata

        md = self.metadata
        if not batch.uniform_q_len:
            self._plan(self.wrapper, MLAPlanMetadata.dense(md.cu_seqlens_q, md.block_tables, md.seq_lens, batch.max_q_len))
            self.wrapper_in_use = self.wrapper
            return
        geometry = Fa3Geometry(batch.batch_size, batch.max_q_len, self.layer.num_heads, self._num_sm)
        wrapper = self._scheduled_wrapper(geometry)
        layout = self._layouts.get(geometry)
        if layout is None:
            layout = self._layouts[geometry] = schedule_layout(geometry, list(wrapper._plan_info))
        write_schedule(wrapper._int_workspace_buffer, layout, geometry, md.seq_lens, self._pack_kv_indices())
        self.wrapper_in_use = wrapper

    def _scheduled_wrapper(self, g: Fa3Geometry):
        """The wrapper of g's cluster size, planned once on the host for one request of g's
        q_len (over the pages its q_len tokens fill: FlashInfer checks the count): that compiles
        the kernel and publishes the workspace layout the device schedule fills (FlashInfer's
        offsets are capacities, the same for every batch)."""
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        wrapper = self._scheduled.get(g.cluster_size)
        if wrapper is not None:
            return wrapper
        device, q_len = self.kv.device, g.q_len
        wrapper = BatchMLAPagedAttentionWrapper(
            self.workspace, use_cuda_graph=True, backend=self._backend, kv_indices=self._kv_indices,
            qo_indptr=torch.zeros(2, dtype=torch.int32, device=device), kv_indptr=torch.zeros(2, dtype=torch.int32, device=device),
            kv_len_arr=torch.zeros(1, dtype=torch.int32, device=device),
        )
        pages = -(-q_len // self.page_size)
        one = MLAPlanMetadata.csr(qo_indptr=torch.tensor([0, q_len], dtype=torch.int32),
                                  kv_indptr=torch.tensor([0, pages], dtype=torch.int32),
                                  kv_indices=self._kv_indices[:pages], kv_len_arr=torch.tensor([q_len], dtype=torch.int32))
        with torch.inference_mode():  # the wrapper's buffers are inference tensors wherever planning is first called from
            self._plan(wrapper, one)
        self._scheduled[g.cluster_size] = wrapper
        return wrapper

    def _pack_kv_indices(self) -> torch.Tensor:
        """The block table's live pages, packed request after request into ``_kv_indices`` (the
        CSR page list); dead columns go to the trash entry. Returns each request's first entry
        ``[B]`` int32."""
        md, ps = self.metadata, self.page_size
        live = (md.seq_lens + ps - 1) // ps  # [bs] int32 pages in use
        start = torch.cumsum(live, 0, dtype=torch.int32) - live
        cols = const_arange(md.block_tables.shape[1], live.device)
        trash = self._kv_indices.shape[0] - 1
        dest = torch.where(cols < live[:, None], start[:, None] + cols, trash)
        self._kv_indices.scatter_(0, dest.flatten().long(), md.block_tables.flatten())
        return start

    def _run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """query ``[T, H, 576]``; kv_cache ``[P, ps, 576]`` -> ``[T, H, 512]``."""
        out = self.wrapper_in_use.run(query=query.to(kv_cache.dtype), kv_cache=kv_cache)  # queries in the cache's dtype
        return out.to(query.dtype)

    def _run_decode_kernel(self, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask):
        bs, q_len = query.shape[:2]
        return self._run(query.flatten(0, 1), kv_cache).view(bs, q_len, *query.shape[2:3], KV_LORA_RANK)

    def _run_prefill_kernel(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, max_seq_len):
        return self._run(query, kv_cache)
