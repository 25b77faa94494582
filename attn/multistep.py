"""Multi-step draft backend: one backend of the same family per draft forward.

The draft steps of one spec step attend over the same requests, so they share one block table
(built once by the first step's backend); each step has its own seq_lens and, for topk > 1, its
own tree-mask buffer ``[max_bs, topk, step * topk]``. Every step backend is an instance of the
class the user chose: a cute-dsl draft really drafts with cute-dsl.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn.base import AttnBatch, KVCacheView, LayerSpec
from attn.paged import PagedMLABackend


class MultiStepDraftBackend:
    """Backends for draft forwards 1..num_steps-1 (the first candidates come from draft-extend)."""

    def __init__(
        self,
        backend_cls: type[PagedMLABackend],
        kv: KVCacheView,
        layer: LayerSpec,
        max_batch_size: int,
        num_steps: int,
        topk: int,
    ) -> None:
        if topk > 1 and not backend_cls.supports_tree_mask:
            raise ValueError(f"{backend_cls.name} cannot attend with a tree mask, which a topk={topk} draft needs; "
                             "use topk=1 or a tree-mask backend")
        self.backend_cls = backend_cls
        self.topk = topk
        tree_mask_len = (lambda step: step * topk) if topk > 1 else (lambda step: 0)
        self.steps = [backend_cls(kv, layer, max_batch_size, topk, tree_mask_len(step)) for step in range(1, num_steps)]

    @property
    def needs_cpu_seq_lens(self) -> bool:
        return self.backend_cls.needs_cpu_seq_lens

    def init_forward_metadata(self, batches: list[AttnBatch]) -> None:
        """One batch per draft forward, same requests; the first builds the shared block table."""
        if len(batches) != len(self.steps):
            raise ValueError(f"{self.backend_cls.name} multi-step draft: {len(self.steps)} draft forwards take one batch "
                             f"each, got {len(batches)}")
        if not self.steps:  # num_steps 1: the draft runs no forward of its own
            return
        for backend in self.steps:  # a refused call leaves no step with the previous pass's metadata
            backend.metadata = None
        sizes = [batch.batch_size for batch in batches]
        if len(set(sizes)) != 1:
            raise ValueError(f"{self.backend_cls.name} multi-step draft: the draft forwards attend over the same "
                             f"requests, got batches of {sizes}")
        first = self.steps[0]
        first.init_forward_metadata(batches[0])
        for backend, batch in zip(self.steps[1:], batches[1:]):
            backend.init_forward_metadata(batch, shared_block_tables=first.metadata.block_tables)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        for backend in self.steps:
            backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def tree_masks(self) -> list[Optional[torch.Tensor]]:
        """Per draft forward: the ``[max_bs, topk, step * topk]`` mask buffer (None for topk 1)."""
        return [backend.get_verify_buffers_to_fill_after_draft()[0] for backend in self.steps]
