"""FlashMLA's SM90 sparse decode (``flash_mla`` of sgl-flash-mla, ``use_legacy=True``): DeepSeek-V3.2's
sparse passes over FlashMLA's own fp8 cache rows (kv_dtype ``fp8_v32``: 656 bytes a token, attn.v32_fp8).

Every sparse pass (prefill, verify, the draft's steps, draft-extend) is one kernel call: the pass's
tokens as a batch of one-token requests, each over its own index_topk rows (padded with -1 to a
multiple of TOPK_MULTIPLE), which triton_mla's indexer selects (FlashMLA has none). The kernel takes
64 or 128 heads: fewer are zero-padded to 64. A token's rows are only those it may see (its prefix
and tree ancestors: the indexer applies the tree mask), so trees need no mask in the kernel. The
split schedule depends on the pass's shapes only (tokens, heads, topk): FlashMLA's scheduler kernel
makes it once a pass, in init_forward_metadata, for the pass's layers to share; inside a captured
step it is a kernel of the graph. Dense (non-sparse) models are refused: the cache holds no rows a
dense kernel reads.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.backends.flashmla import load_flash_mla, pass_schedule
from attn.backends.triton_mla import TritonMLABackend
from attn.base import KV_LORA_RANK, AttnBatch
from attn.paged import PagedMLABackend
from attn.v32_fp8 import V32_FP8_BYTES

TOPK_MULTIPLE = 64  # the kernel's rows a tile: a token's slots are padded with -1 to a multiple
KERNEL_HEADS = (64, 128)  # head counts the kernel takes; fewer are zero-padded up


def kernel_heads(heads: int) -> int:
    """The head count a pass of ``heads`` runs the kernel with: 16 -> 64, 128 -> 128."""
    return next(n for n in KERNEL_HEADS if n >= heads)


def padded_topk(topk: int) -> int:
    """A token's slots as the kernel takes them: 8 -> 64, 2048 -> 2048."""
    return -(-topk // TOPK_MULTIPLE) * TOPK_MULTIPLE


class FlashMLASparseBackend(PagedMLABackend):
    name = "flashmla_sparse"
    kernel_family = "flashmla"
    required_sm = ((9, 0),)
    page_sizes = (64,)
    kv_dtypes = ("fp8_v32",)
    max_heads = KERNEL_HEADS[-1]
    supports_sparse = True
    supports_dense = False
    supports_tree_mask = True  # (the indexer's: the kernel reads only the rows a token selected)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._flash_mla = load_flash_mla()
        self._schedule: Optional[object] = None  # the pass's FlashMLASchedMeta

    def init_forward_metadata(self, batch: AttnBatch, shared_block_tables: Optional[torch.Tensor] = None) -> None:
        """The paged metadata (the indexer's), then FlashMLA's split schedule of the pass's tokens,
        each a request of one query token over padded_topk rows: ``[num_sm_parts, 8]`` and
        ``[tokens + 1]`` int32 on the device."""
        self._schedule = None
        super().init_forward_metadata(batch, shared_block_tables)
        if batch.num_tokens == 0 or not self.layer.sparse:
            return
        heads, topk = kernel_heads(self.layer.num_heads), padded_topk(self.layer.index_topk)
        lengths = torch.full((batch.num_tokens,), topk, dtype=torch.int32, device=self.kv.device)
        try:
            self._schedule = pass_schedule(self._flash_mla, lengths, heads, 1, heads, is_fp8_kvcache=True, topk=topk)
        except BaseException:
            self.metadata = None
            raise

    _run_index_kernel = TritonMLABackend._run_index_kernel  # the indexer's top-k: Triton's

    def _run_sparse_kernel(self, q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, 576]`` over slots ``[T, K]`` int32 (-1: none) of the fp8_v32 cache ``[pages,
        64, 656]`` uint8 -> ``[T, H, 512]`` in q's dtype; 0 for a token with no slot."""
        tokens, heads = q.shape[:2]
        padded_heads, width = kernel_heads(heads), padded_topk(slots.shape[1])
        if self._schedule is None or width != padded_topk(self.layer.index_topk):
            raise ValueError(f"{self.name}: this pass's schedule was made for index_topk={self.layer.index_topk} "
                             f"(the layer's), not {slots.shape[1]} slots a token; call init_forward_metadata")
        table = torch.nn.functional.pad(slots, (0, width - slots.shape[1]), value=-1)
        query = torch.nn.functional.pad(q.to(torch.bfloat16), (0, 0, 0, padded_heads - heads))
        out, _ = self._flash_mla.flash_mla_with_kvcache(
            query.unsqueeze(1), kv_cache.view(-1, self.page_size, 1, V32_FP8_BYTES), None, None, KV_LORA_RANK,
            self._schedule, softmax_scale=self.layer.sm_scale, is_fp8_kvcache=True, indices=table.unsqueeze(1),
            use_legacy=True)
        out = out.view(tokens, padded_heads, KV_LORA_RANK)[:, :heads]
        return torch.where((slots < 0).all(1)[:, None, None], 0, out.to(q.dtype))
