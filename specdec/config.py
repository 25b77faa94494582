"""SpecConfig: every setting of the spec-decode worker, validated once, up front."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from attn.base import KV_DTYPES
from attn.registry import (
    BackendChoice, backend_names, check_context_len, check_device, check_kv_dtype, check_page_size, check_query_lens,
    check_tree_support, resolve_backends,
)
from attn.values import int_list, is_kv_scale, require_int
from specdec.batch import MAX_PREFILL_TOKENS


class ConfigError(ValueError):
    """A setting is invalid; the message names the setting and what to change."""


DRAFT_MODES = ("eagle", "standalone")


@dataclass
class SpecConfig:
    """Spec-decode settings.

    num_steps: draft forwards per step (tree depth). topk: branches kept per draft step.
    num_draft_tokens: verified tree nodes per request, the root (last verified token) included;
        must be num_steps + 1 for topk = 1 (None, the default, derives it and stores it here: so
        ``dataclasses.replace(cfg, num_steps=n, num_draft_tokens=None)`` for a chain of another
        depth), at most ``1 + topk + (num_steps - 1) * topk**2`` otherwise.
    draft_mode: "eagle" (MTP/EAGLE head fed the target's hidden states) or "standalone"
        (an ordinary LM of the target's architecture).
    attention_backend: target backend (verify, decode). decode_backend: the draft's multi-step
        backend (default: attention_backend). prefill_backend: prefill and draft-extend
        (default: attention_backend, or its family's fallback; see attn.registry).
    page_size: tokens per KV page; must divide max_context_len. The Blackwell backends take 32 or
        64: another value becomes 64 here, with a warning.
    kv_dtype: "auto" (model dtype), "bf16", "fp16", "fp8_e4m3", or "fp32" / "fp64" (torch_ref only);
        "fp8_v32": FlashMLA's 656-byte V3.2 rows with their own scales (flashmla_sparse, torch_ref).
    kv_scale: the per-tensor scale of an fp8_e4m3 cache, both pools: the cache stores kv / kv_scale
        (saturating at +-448) and the kernels scale back (a checkpoint's k_scale, or a calibration).
        1.0 for other kv dtypes.
    max_batch_size / max_context_len: pool and buffer sizes. num_pages: KV pages per pool; None
        (default): every request at full context plus the padding page (``pool_pages``).
    cuda_graph_batch_sizes: buckets for CUDA graphs (graphs.runner.GraphRunner's default).
    max_prefill_tokens: prompt tokens a prefill pass takes: add_requests prefills its prompts in
        consecutive passes of at most this many tokens, a longer prompt over several passes
        (chunked prefill; a standalone draft's pass takes one token more per prompt it finishes).
        Bounds the pass's activations; a prefill backend that takes fewer tokens a pass (its
        max_prefill_tokens: flashinfer_mla, about 16k at 128 heads) gets passes of its size.
    enable_sampling: verify by tree rejection sampling so requests may use temperature > 0
        (greedy requests still get exactly the greedy output); off: argmax verification only.
    check_ranks: under tensor parallelism, compare a hash of every step's accepted tokens across
        the ranks and raise if they differ (a debug check: one small collective a step).
    """

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: Optional[int] = None
    draft_mode: str = "eagle"
    attention_backend: str = "torch_ref"
    decode_backend: Optional[str] = None
    prefill_backend: Optional[str] = None
    page_size: int = 16
    kv_dtype: str = "auto"
    kv_scale: float = 1.0
    max_batch_size: int = 8
    max_context_len: int = 512
    num_pages: Optional[int] = None
    cuda_graph_batch_sizes: list[int] = field(default_factory=list)
    enable_sampling: bool = False
    check_ranks: bool = False
    max_prefill_tokens: int = MAX_PREFILL_TOKENS

    def __post_init__(self) -> None:
        self.validate()

    def __setattr__(self, name: str, value: object) -> None:
        self._refuse_if_locked(name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:  # (a deleted field read as the class default)
        self._refuse_if_locked(name)
        super().__delattr__(name)

    def _refuse_if_locked(self, name: str) -> None:
        if vars(self).get("_locked"):
            raise ConfigError(
                f"this SpecConfig is a worker's (worker.config), read-only: its pools, buffers, backends and graphs "
                f"were sized from it. Build a new worker from dataclasses.replace(worker.config, {name}=...)")

    def __getstate__(self) -> dict:
        """Copies (copy, deepcopy, pickle) are editable: the lock stays with the worker's object."""
        return {k: v for k, v in vars(self).items() if k != "_locked"}

    def lock(self) -> None:
        """Make this config read-only: a later assignment or deletion raises ConfigError, and
        cuda_graph_batch_sizes becomes a tuple. EagleWorker locks its own validated copy, so an
        edit of ``worker.config`` is refused instead of reaching half the worker. Copies of a
        locked config are not locked (replace's and validate's take the tuple as a list again)."""
        vars(self)["cuda_graph_batch_sizes"] = tuple(self.cuda_graph_batch_sizes)
        vars(self)["_locked"] = True

    @property
    def pool_pages(self) -> int:
        """KV pages of each pool: num_pages, else every request at full context plus the padding
        page (derived here, so a copy with other sizes derives its own)."""
        if self.num_pages is not None:
            return self.num_pages
        return self.max_batch_size * (self.max_context_len // self.page_size) + 1

    @property
    def draft_offset(self) -> int:
        """Where the draft's cache runs ahead of the target's: 0 for an EAGLE draft (it processes
        t_{p+1} at position p), 1 for a standalone one (t_p at p)."""
        return 0 if self.draft_mode == "eagle" else 1

    @property
    def spec_headroom(self) -> int:
        """Context positions a request needs past its prompt and max_new_tokens. Its last step runs
        at N = prompt + max_new_tokens - 2 (that step emits the last token) and writes the target's
        kv up to N + num_draft_tokens, the draft's up to N + draft offset (standalone: 1) + the
        draft region."""
        return max(self.num_draft_tokens, self.draft_region_len + self.draft_offset) - 2

    @property
    def backends(self) -> BackendChoice:
        return resolve_backends(self.attention_backend, self.decode_backend, self.prefill_backend)

    def cache_dtype(self, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The KV caches' dtype on ``device`` for a model of ``model_dtype`` (kv_dtype 'auto': the
        model's, which must suit the backends as a named one would). ConfigError where a backend
        cannot run on the device or take that dtype."""
        try:
            check_device(self.backends, device)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.kv_dtype != "auto":
            return KV_DTYPES[self.kv_dtype]
        name = next((n for n, d in KV_DTYPES.items() if d == model_dtype), str(model_dtype))
        try:
            check_kv_dtype(self.backends, name)
        except ValueError as err:
            raise ConfigError(f"kv_dtype='auto' is the model's dtype, {name}: {err}") from None
        return model_dtype

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid setting. EagleWorker validates again, so a
        config changed after construction is checked too. Settings are normalised (ints, kv_scale
        as a float, the derived num_draft_tokens, the backends' page size) only once all checks
        pass: a config that fails is left as it was."""
        checked = copy.copy(self)
        checked._check()
        vars(self).update(vars(checked))
        if vars(self).get("_locked"):  # (the check made the buckets a list again)
            self.lock()

    def _check(self) -> None:
        """validate's checks, normalising this object's settings as they go."""
        self._check_ints()
        if self.num_draft_tokens is None and self.topk == 1:
            self.num_draft_tokens = self.num_steps + 1
        if self.num_steps < 1:
            raise ConfigError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.topk < 1:
            raise ConfigError(f"topk must be >= 1, got {self.topk}")
        if self.num_draft_tokens is None:
            raise ConfigError("num_draft_tokens must be set when topk > 1 (tree size including the root)")
        if self.topk > self.num_draft_tokens:
            raise ConfigError(f"topk ({self.topk}) must not exceed num_draft_tokens ({self.num_draft_tokens})")
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ConfigError(
                f"with topk=1 the tree is a chain: num_draft_tokens must be num_steps + 1 = {self.num_steps + 1} "
                f"or None (derived), got {self.num_draft_tokens} (a dataclasses.replace copy or an edit of num_steps "
                f"keeps the value derived for the old one: set num_draft_tokens=None with the new one)"
            )
        if self.num_draft_tokens - 1 > self.max_tree_candidates or self.num_draft_tokens < 2:
            raise ConfigError(
                f"num_draft_tokens ({self.num_draft_tokens}) must be in [2, {1 + self.max_tree_candidates}] "
                f"for num_steps={self.num_steps}, topk={self.topk}"
            )
        if self.draft_mode not in DRAFT_MODES:
            raise ConfigError(f"draft_mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")
        if not isinstance(self.kv_dtype, str) or (self.kv_dtype != "auto" and self.kv_dtype not in KV_DTYPES):
            raise ConfigError(f"kv_dtype must be 'auto' or one of {sorted(KV_DTYPES)}, got {self.kv_dtype!r}")
        for name in ("attention_backend", "decode_backend", "prefill_backend"):
            value, optional = getattr(self, name), name != "attention_backend"
            if not (optional and value is None) and (not isinstance(value, str) or value not in backend_names()):
                raise ConfigError(f"{name} must be one of {backend_names()}{' or None' if optional else ''}, "
                                  f"got {value!r}")
        if not is_kv_scale(self.kv_scale):
            raise ConfigError(f"kv_scale must be a finite number in [2**-64, 2**64], got {self.kv_scale!r}")
        self.kv_scale = float(self.kv_scale)
        if self.kv_scale != 1.0 and self.kv_dtype != "fp8_e4m3":
            raise ConfigError(f"kv_scale {self.kv_scale} scales an fp8_e4m3 cache only; set kv_dtype='fp8_e4m3' or kv_scale=1.0")
        if not isinstance(self.enable_sampling, (bool, np.bool_)):
            raise ConfigError(f"enable_sampling must be a bool, got {self.enable_sampling!r}")
        self.enable_sampling = bool(self.enable_sampling)
        if not isinstance(self.check_ranks, (bool, np.bool_)):
            raise ConfigError(f"check_ranks must be a bool, got {self.check_ranks!r}")
        self.check_ranks = bool(self.check_ranks)
        given_page_size = self.page_size
        try:
            choice = self.backends
            self.page_size = check_page_size(choice, self.page_size)
            check_kv_dtype(choice, self.kv_dtype)
            check_tree_support(choice, self.topk)
            check_query_lens(choice, self.num_draft_tokens, self.num_steps, self.topk)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.page_size < 1 or self.max_context_len < 1 or self.max_context_len % self.page_size:
            adjusted = f", the backends' for the {given_page_size} given" if given_page_size != self.page_size else ""
            raise ConfigError(f"page_size ({self.page_size}{adjusted}) must divide max_context_len "
                              f"({self.max_context_len}), both >= 1")
        try:
            check_context_len(choice, self.max_context_len)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.max_context_len < self.spec_headroom + 3:
            raise ConfigError(f"max_context_len ({self.max_context_len}) leaves no room for a spec step: a one-token "
                              f"prompt and two new tokens need {self.spec_headroom + 3} with this tree; raise it")
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if (self.max_batch_size + 1) * self.max_context_len >= 2**31:
            raise ConfigError(f"(max_batch_size + 1) * max_context_len must stay below 2**31 (int32 KV slot "
                              f"indices), got {self.max_batch_size + 1} * {self.max_context_len}; lower one of them")
        if self.max_prefill_tokens < 1:
            raise ConfigError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"num_pages must be at least 2 (page 0 is the padding sink), got {self.num_pages}")
        if any(bs < 1 or bs > self.max_batch_size for bs in self.cuda_graph_batch_sizes):
            raise ConfigError(f"cuda_graph_batch_sizes must lie in [1, max_batch_size={self.max_batch_size}], got {self.cuda_graph_batch_sizes}")

    def _check_ints(self) -> None:
        for name in ("num_steps", "topk", "page_size", "max_batch_size", "max_context_len", "max_prefill_tokens"):
            setattr(self, name, require_int(getattr(self, name), f"{name} must be an int", ConfigError))
        self.cuda_graph_batch_sizes = int_list(self.cuda_graph_batch_sizes, "cuda_graph_batch_sizes must be a list of ints",
                                               ConfigError)
        for name in ("num_draft_tokens", "num_pages"):
            if getattr(self, name) is not None:
                setattr(self, name, require_int(getattr(self, name), f"{name} must be an int", ConfigError))

    @property
    def max_tree_candidates(self) -> int:
        """Draft candidates a tree can choose from: topk at the first step, topk**2 after."""
        return self.topk + (self.num_steps - 1) * self.topk**2

    @property
    def draft_region_len(self) -> int:
        """Draft-pool positions past the verified prefix one step writes (drafts or draft-extend)."""
        return max(self.num_steps + 1, (self.num_steps - 1) * self.topk)
