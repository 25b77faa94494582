"""FlashMLA's SM90 dense decode (``flash_mla`` of the sgl-flash-mla wheel, ``use_legacy=True``).

Decode, the verify chain (causal, q_len = num_draft_tokens), draft-extend and the draft's steps are
one kernel call each over the packed 576-wide cache in pages of 64, bf16 or fp8 (FlashMLA's dense
fp8 decode: fp8 queries, per-tensor descales). The split schedule is FlashMLA's own scheduler
kernel (``get_mla_decoding_metadata``), run once a pass in init_forward_metadata on the device
seq_lens: no host sync, and inside a captured step it is a kernel of the graph, so every replay
schedules its own lengths; the layers of the pass share it. No custom masks (topk 1 only); ragged
prefill goes to triton_mla, as FlashMLA has no prefill kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.base import KV_LORA_RANK, AttnBatch, to_cache_dtype
from attn.paged import PagedMLABackend


def load_flash_mla():
    """The ``flash_mla`` module with its legacy (SM90) kernels; ImportError naming the wheel if not."""
    try:
        import flash_mla
    except ImportError as exc:
        raise ImportError("flashmla needs FlashMLA's kernels: install the sgl-flash-mla wheel (flash_mla), "
                          f"or pick another attention backend ({exc})") from exc
    if not flash_mla.has_legacy():
        raise ImportError("flashmla needs FlashMLA's legacy SM90 kernels, which this flash_mla build lacks "
                          "(built with FLASH_MLA_BUILD_LEGACY=0); pick another attention backend")
    return flash_mla


def pass_schedule(flash_mla, *args, **kwargs):
    """A FlashMLASchedMeta holding the split schedule that FlashMLA's scheduler kernel makes on the
    device (legacy ``get_mla_decoding_metadata(*args, **kwargs)``): one a pass, its layers share it."""
    tiles, splits = flash_mla.get_mla_decoding_metadata(*args, use_legacy=True, **kwargs)
    schedule, _ = flash_mla.get_mla_metadata()
    schedule.tile_scheduler_metadata, schedule.num_splits = tiles, splits
    return schedule


class FlashMLABackend(PagedMLABackend):
    name = "flashmla"
    kernel_family = "flashmla"
    required_sm = ((9, 0),)
    page_sizes = (64,)
    kv_dtypes = ("auto", "bf16", "fp8_e4m3")
    supports_prefill = False
    prefill_fallback = "triton_mla"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._flash_mla = load_flash_mla()
        self._fp8 = self.kv.kv_buffers[0].dtype == torch.float8_e4m3fn
        self._schedule: Optional[object] = None  # the pass's FlashMLASchedMeta
        self._descales: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        if self._fp8:  # queries cast at scale 1 (as trtllm_mla's), the cache's per-tensor scale
            device = self.kv.device
            self._descales = (torch.ones(1, dtype=torch.float32, device=device),
                              torch.full((1,), self.kv.kv_scale, dtype=torch.float32, device=device))

    def init_forward_metadata(self, batch: AttnBatch, shared_block_tables: Optional[torch.Tensor] = None) -> None:
        """The paged metadata, then FlashMLA's split schedule for it: ``[num_sm_parts, 8]`` and
        ``[B + 1]`` int32 on the device, from seq_lens and q_len x heads query rows a request."""
        self._schedule = None
        super().init_forward_metadata(batch, shared_block_tables)
        if batch.batch_size == 0:
            return
        try:
            heads = self.layer.num_heads
            self._schedule = pass_schedule(self._flash_mla, self.metadata.seq_lens, batch.max_q_len * heads, 1, heads,
                                           is_fp8_kvcache=self._fp8)
        except BaseException:
            self.metadata = None
            raise

    def _run_decode_kernel(self, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask):
        """query ``[B, q_len, H, 576]`` -> ``[B, q_len, H, 512]`` in query's dtype; causal for q_len > 1
        (query i sees the kv rows up to seq_len - q_len + i, as a verify chain)."""
        descale_q, descale_k = self._descales or (None, None)
        dtype = kv_cache.dtype if self._fp8 else torch.bfloat16
        out, _ = self._flash_mla.flash_mla_with_kvcache(
            to_cache_dtype(query, dtype), kv_cache.unsqueeze(2), block_tables, seq_lens, KV_LORA_RANK,
            self._schedule, softmax_scale=self.layer.sm_scale, causal=query.shape[1] > 1,
            is_fp8_kvcache=self._fp8, use_legacy=True, descale_q=descale_q, descale_k=descale_k)
        return out.to(query.dtype)
