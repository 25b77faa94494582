"""The draft model interface the worker drives, and the standalone-draft adapter."""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from attn.base import AttnBatch, LayerSpec
from specdec.config import ConfigError, SpecConfig


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


def check_draft(draft: DraftModel, target: torch.nn.Module, config: SpecConfig) -> None:
    """ConfigError where ``draft`` cannot draft for ``target`` under ``config``: another vocabulary,
    topk past it, a hidden-state draft in standalone mode or of another hidden size or dtype than
    the target (it reads the target's hidden states), an ordinary LM in eagle mode, or a draft
    module on another device."""
    if draft.vocab_size != target.config.vocab_size:
        raise ConfigError(f"the draft's vocabulary ({draft.vocab_size} tokens) must be the target's "
                          f"({target.config.vocab_size}): the draft proposes target token ids")
    if config.topk > draft.vocab_size:
        raise ConfigError(f"topk {config.topk} exceeds the vocabulary ({draft.vocab_size} tokens); lower topk")
    if config.draft_mode == "standalone" and draft.needs_hidden_in:
        raise ConfigError("draft_mode='standalone' gives the draft no hidden states, which this draft reads "
                          "(an EAGLE/MTP head); set draft_mode='eagle'")
    if config.draft_mode == "eagle" and not draft.needs_hidden_in:
        raise ConfigError("draft_mode='eagle' feeds the draft each token one position early, beside the target's "
                          "hidden state, which this draft does not read (an ordinary LM); set draft_mode='standalone'")
    target_param = next(target.parameters())
    shared = {id(p) for p in target.parameters()}  # an MTP head's embedding and lm head may be the target's
    own = [p for p in draft.parameters() if id(p) not in shared] if isinstance(draft, torch.nn.Module) else []
    devices, dtypes = {p.device for p in own}, {p.dtype for p in own}
    if devices - {target_param.device}:
        raise ConfigError(f"the draft has parameters on {sorted(map(str, devices))} and the target on "
                          f"{target_param.device}; move the draft")
    if draft.needs_hidden_in:
        if draft.hidden_size != target.config.hidden_size:
            raise ConfigError(f"the draft reads the target's hidden states ({target.config.hidden_size} wide) "
                              f"but has hidden_size {draft.hidden_size}")
        if dtypes - {target_param.dtype}:
            raise ConfigError(f"the draft has parameters in {sorted(map(str, dtypes))} and the target's are "
                              f"{target_param.dtype}: the draft reads the target's hidden states; load it in "
                              f"{target_param.dtype}")


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
