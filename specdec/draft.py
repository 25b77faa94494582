"""The draft model interface the worker drives, and the standalone-draft adapter."""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from attn.base import AttnBatch, LayerSpec


class DraftModel(Protocol):
    """An EAGLE/MTP head (``specdec.models.mtp.DeepseekMTP``) or a wrapped ordinary LM.

    forward: ids ``[T]`` int64, positions ``[T]`` int64, hidden_in ``[T, D]`` (the target's hidden
    states at the previous position, or the draft's own while drafting; None where unused)
    -> hidden ``[T, D]``. vocab_size: the width of compute_logits' logits, which must be the
    target's (the draft proposes target token ids). needs_hidden_in: forward reads hidden_in
    (an EAGLE/MTP head: SpecConfig.draft_mode "eagle" only). hidden_size: D of forward's output,
    in the dtype of its parameters (a torch module's).
    """

    num_attention_layers: int
    vocab_size: int
    needs_hidden_in: bool
    hidden_size: int

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, hidden_in: Optional[torch.Tensor], backend, batch: AttnBatch) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def attn_spec(self) -> LayerSpec: ...


class StandaloneDraft(torch.nn.Module):
    """An ordinary LM of the target's architecture used as the draft (no hidden-state input)."""

    needs_hidden_in = False

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @property
    def num_attention_layers(self) -> int:
        return self.lm.num_attention_layers

    @property
    def vocab_size(self) -> int:
        return self.lm.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.lm.config.hidden_size

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden_in: Optional[torch.Tensor], backend, batch: AttnBatch) -> torch.Tensor:
        return self.lm(ids, positions, backend, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm.compute_logits(hidden)

    def attn_spec(self) -> LayerSpec:
        return self.lm.attn_spec()
