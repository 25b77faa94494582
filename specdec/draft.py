"""The model interfaces the worker drives (target and draft), their up-front checks, and the
standalone-draft adapter."""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from attn.base import AttnBatch, LayerSpec
from attn.registry import check_dense_support, check_sparse_support
from specdec.config import ConfigError, SpecConfig

# The roles (attn.registry.BackendChoice's fields) whose backends run each model's passes.
TARGET_ROLES = ("target", "prefill")
DRAFT_ROLES = ("draft", "draft_extend", "prefill")


class TargetModel(Protocol):
    """What the worker calls on an engine's target model (``specdec.models.DeepseekV3ForCausalLM``
    is one; tests/toy_models.py has a minimal other).

    forward: ids ``[T]`` int64, positions ``[T]`` int64, backend, batch -> hidden ``[T, D]`` in
    the dtype of its parameters. Each of its MLA layers ``i`` calls ``backend.forward(q, kv_new, i,
    batch)`` once: q ``[T, H, 576]`` (absorbed: the nope part through W_UK, the rope part last;
    last dim contiguous), kv_new ``[T, 576]`` (latent and roped key; or None after writing those
    rows itself where ``backend.kv_rows(i, batch, dtype)`` said) -> ``[T, H, 512]`` (the model
    applies W_UV); it does not scale q (the backend applies attn_spec's sm_scale). Rotary
    embeddings come from ``positions`` alone: in a tree verify a token's kv slot is not its
    position. Nothing mixes tokens but attention, and the model is deterministic (eval mode:
    dropout would make verifying differ from decoding).
    num_attention_layers: its MLA layers (the KV pool's), so layer ids ``0..num_attention_layers-1``.
    config.vocab_size: the width of compute_logits' logits; config.hidden_size: D (read by an
    EAGLE draft's check). parameters(): the first one's dtype and device are the worker's (the KV
    cache's dtype under kv_dtype "auto", and the draft's).
    compute_logits: hidden ``[N, D]`` -> logits ``[N, vocab_size]`` (float). Optional,
    compute_logits_argmax: hidden -> (those logits, their rows' greedy picks or None), the picks
    an object with ``argmax()`` and ``top1()`` (specdec.tree.head_logits; the worker's greedy
    passes take them where the model has it).
    attn_spec: its LayerSpec. A sparse model (DeepSeek-V3.2) sets its index_topk and index_head_dim
    and calls ``backend.index_topk`` then ``backend.forward_sparse`` where a dense one calls
    ``backend.forward``; the worker then builds its pool with the indexer keys and refuses backends
    without such passes (check_sparse).
    """

    config: object
    num_attention_layers: int

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, backend, batch: AttnBatch) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def attn_spec(self) -> LayerSpec: ...

    def parameters(self): ...


class DraftModel(Protocol):
    """An EAGLE/MTP head (``specdec.models.mtp.DeepseekMTP``) or a wrapped ordinary LM, with the
    attention contract of TargetModel's forward (layer ids over its own num_attention_layers).

    forward: ids ``[T]`` int64, positions ``[T]`` int64, hidden_in ``[T, D]`` or None -> hidden
    ``[T, D]``. An EAGLE/MTP head (needs_hidden_in; SpecConfig.draft_mode "eagle" only) gets the
    target's hidden states at the previous position (prefill, draft-extend) or its own output
    (draft steps); an ordinary LM gets None in prefill and hidden states it may ignore otherwise.
    Rows of a draft-extend past a request's accepted tokens carry some valid token id (0, or the
    target's argmax there) and are discarded: compute each row on its own. vocab_size: the width
    of compute_logits' logits, which must be the target's (the draft proposes target token ids);
    compute_logits_argmax as TargetModel's (optional). hidden_size: D of forward's output (the
    target's, for a head that reads the target's), in the dtype of its parameters (a torch
    module's). attn_spec: as TargetModel's (a sparse draft: V3.2's MTP layer).
    """

    num_attention_layers: int
    vocab_size: int
    needs_hidden_in: bool
    hidden_size: int

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, hidden_in: Optional[torch.Tensor], backend, batch: AttnBatch) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def attn_spec(self) -> LayerSpec: ...


def _missing(model, attributes: tuple[str, ...]) -> list[str]:
    """The names of a model's contract it lacks: the attributes, the methods attn_spec,
    compute_logits and parameters, and the call itself."""
    missing = [name for name in attributes if not hasattr(model, name)]
    missing += [name for name in ("attn_spec", "compute_logits", "parameters") if not callable(getattr(model, name, None))]
    return missing + ([] if callable(model) else ["__call__"])


def check_target(target: TargetModel) -> None:
    """ConfigError where ``target`` lacks what the worker calls (TargetModel), has no parameters
    (they give the worker its device and dtype), or is in training mode."""
    missing = _missing(target, ("config", "num_attention_layers"))
    if "config" not in missing and not hasattr(target.config, "vocab_size"):
        missing.append("config.vocab_size")
    if missing:
        raise ConfigError(f"the target model lacks {missing}: specdec.draft.TargetModel lists what the worker calls")
    if next(iter(target.parameters()), None) is None:
        raise ConfigError("the target model has no parameters: the worker takes its device and dtype from them")
    if getattr(target, "training", False):
        raise ConfigError("the target model is in training mode (dropout would make verifying differ from "
                          "decoding): call target.eval()")


def check_draft(draft: DraftModel, target: TargetModel, config: SpecConfig) -> None:
    """ConfigError where ``draft`` cannot draft for ``target`` under ``config``: another vocabulary,
    topk past it, a hidden-state draft in standalone mode or of another hidden size or dtype than
    the target (it reads the target's hidden states), an ordinary LM in eagle mode, or a draft
    module on another device; first, where it lacks what the worker calls (DraftModel)."""
    missing = _missing(draft, ("num_attention_layers", "vocab_size", "needs_hidden_in", "hidden_size"))
    if missing:
        lm = hasattr(getattr(draft, "config", None), "vocab_size") and "vocab_size" in missing
        hint = "; an ordinary LM drafts as specdec.draft.StandaloneDraft(lm) with draft_mode='standalone'" if lm else ""
        raise ConfigError(f"the draft model lacks {missing}: specdec.draft.DraftModel lists what the worker calls{hint}")
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
        width = getattr(target.config, "hidden_size", None)
        if draft.hidden_size != width:
            raise ConfigError(f"the draft reads the target's hidden states ({width} wide: the target's "
                              f"config.hidden_size) but has hidden_size {draft.hidden_size}")
        if dtypes - {target_param.dtype}:
            raise ConfigError(f"the draft has parameters in {sorted(map(str, dtypes))} and the target's are "
                              f"{target_param.dtype}: the draft reads the target's hidden states; load it in "
                              f"{target_param.dtype}")


def check_sparse(target: TargetModel, draft: DraftModel, config: SpecConfig, kv_dtype: torch.dtype) -> None:
    """ConfigError, before any pool or backend is built, where a sparse model (``attn_spec().sparse``:
    DeepSeek-V3.2's target, its MTP layer) would run passes on a backend that cannot run its sparse
    passes of its index_topk over a ``kv_dtype`` cache (attn.registry.check_sparse_support), or a
    dense one on a backend of sparse passes only (check_dense_support): the target's verify and
    prefill, the draft's steps, draft-extend and prefill."""
    for model, name, roles in ((target, "the target", TARGET_ROLES), (draft, "the draft", DRAFT_ROLES)):
        spec = model.attn_spec()
        try:
            if spec.sparse:
                check_sparse_support(config.backends, roles, spec.index_topk, kv_dtype, name)
            else:
                check_dense_support(config.backends, roles, name)
        except ValueError as err:
            raise ConfigError(str(err)) from None


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
