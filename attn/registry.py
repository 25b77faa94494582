"""Backend names -> classes, per-role selection with fallbacks, and validation.

Every rule here reads a class attribute of the backend it concerns, so a new backend states its
constraints once, next to its kernel call. Nothing here imports a kernel library: validation runs
before any library is asked to do work.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from attn.base import KV_DTYPES
from attn.paged import PagedMLABackend

_BACKENDS = {
    "torch_ref": "attn.backends.torch_ref:TorchRefBackend",
    "triton_mla": "attn.backends.triton_mla:TritonMLABackend",
    "flashinfer_mla": "attn.backends.flashinfer_mla:FlashInferMLABackend",
    "flashmla": "attn.backends.flashmla:FlashMLABackend",
    "flashmla_sparse": "attn.backends.flashmla_sparse:FlashMLASparseBackend",
    "trtllm_mla": "attn.backends.blackwell.trtllm_mla:TrtllmMLABackend",
    "cutedsl_mla": "attn.backends.blackwell.cutedsl_mla:CuteDslMLABackend",
    "tokenspeed_mla": "attn.backends.blackwell.tokenspeed_mla:TokenspeedMLABackend",
}

DEFAULT_BLACKWELL_PAGE_SIZE = 64


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def sparse_backend_names() -> list[str]:
    """The backends with DeepSeek-V3.2's sparse passes (supports_sparse), for messages that name them."""
    return [n for n in backend_names() if get_backend_class(n).supports_sparse]


def get_backend_class(name: str) -> type[PagedMLABackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {backend_names()}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class BackendChoice:
    """Which backend serves which role.

    target: target verify. draft: the draft's multi-step decode. draft_extend: the draft over the
    accepted tokens. prefill: prefill of target and draft.
    """

    target: str
    draft: str
    draft_extend: str
    prefill: str

    def classes(self) -> dict[str, type[PagedMLABackend]]:
        return {role: get_backend_class(name) for role, name in vars(self).items()}


def resolve_backends(attention: str, decode: Optional[str] = None, prefill: Optional[str] = None) -> BackendChoice:
    """Fill in the draft, draft-extend and prefill roles; refuse decode-only kernels as prefill backend.

    A family that cannot serve draft-extend or prefill hands it to its ``prefill_fallback``
    (cutedsl_mla -> trtllm_mla); an explicit prefill_backend serves both.
    """
    target_cls = get_backend_class(attention)
    draft = decode or attention
    get_backend_class(draft)
    if prefill is not None:
        prefill_cls = get_backend_class(prefill)
        if not (prefill_cls.supports_prefill and prefill_cls.supports_draft_extend):
            raise ValueError(
                f"prefill_backend {prefill!r} is decode-only and cannot run prefill or draft-extend; "
                f"set prefill_backend to {prefill_cls.prefill_fallback!r} or leave it unset"
            )
        return BackendChoice(target=attention, draft=draft, draft_extend=prefill, prefill=prefill)
    fallback = target_cls.prefill_fallback
    return BackendChoice(
        target=attention,
        draft=draft,
        draft_extend=attention if target_cls.supports_draft_extend else fallback,
        prefill=attention if target_cls.supports_prefill else fallback,
    )


def check_page_size(choice: BackendChoice, page_size: int) -> int:
    """The page size every chosen backend accepts: warns and returns 64 where a family needs 32/64."""
    for role, cls in choice.classes().items():
        if cls.page_sizes is not None and page_size not in cls.page_sizes:
            warnings.warn(
                f"{cls.name} ({role}) supports page_size {cls.page_sizes}, not {page_size}; "
                f"using page_size {DEFAULT_BLACKWELL_PAGE_SIZE}",
                stacklevel=2,
            )
            return DEFAULT_BLACKWELL_PAGE_SIZE
    return page_size


def check_kv_dtype(choice: BackendChoice, kv_dtype: str) -> None:
    for role, cls in choice.classes().items():
        if kv_dtype not in cls.kv_dtypes:
            raise ValueError(f"{cls.name} ({role}) supports kv_dtype {cls.kv_dtypes}, not {kv_dtype!r}; change kv_dtype")


# The setting that picks each role's backend (SpecConfig's names): what a refusal tells to change.
ROLE_SETTINGS = {"target": "attention_backend", "draft": "decode_backend", "draft_extend": "prefill_backend",
                 "prefill": "prefill_backend"}


def check_tree_support(choice: BackendChoice, topk: int) -> None:
    """topk > 1 trees need tree masks in the target verify and in the draft's steps."""
    if topk == 1:
        return
    for role in ("target", "draft"):
        cls, setting = get_backend_class(getattr(choice, role)), ROLE_SETTINGS[role]
        if not cls.supports_tree_mask:
            masked = [n for n in backend_names() if get_backend_class(n).supports_tree_mask]
            raise ValueError(f"{cls.name} ({role}) cannot attend with a tree mask: use topk=1, or set {setting} "
                             f"to one of {masked}")


def check_sparse_support(choice: BackendChoice, roles: tuple[str, ...], index_topk: int, kv_dtype: torch.dtype,
                         model: str) -> None:
    """A sparse model (DeepSeek-V3.2: ``index_topk`` rows a query token) runs its passes of
    ``roles`` (BackendChoice fields) on backends with sparse passes (supports_sparse) that select
    that many rows (max_index_topk) over a cache of ``kv_dtype`` (sparse_kv_dtypes, else
    kv_dtypes). ValueError naming ``model``, the role and the setting to change."""
    for role in roles:
        cls, setting = get_backend_class(getattr(choice, role)), ROLE_SETTINGS[role]
        needs = f"{model} (sparse attention, index_topk={index_topk}) runs its {role} passes on it"
        if not cls.supports_sparse:
            raise ValueError(f"{cls.name} ({role}) has no sparse attention (supports_sparse=False), and {needs}; set "
                             f"{setting} to one of {sparse_backend_names()}")
        if cls.max_index_topk is not None and index_topk > cls.max_index_topk:
            wide = [n for n in backend_names() if get_backend_class(n).supports_sparse
                    and (get_backend_class(n).max_index_topk or index_topk) >= index_topk]
            raise ValueError(f"{cls.name} ({role}) selects at most {cls.max_index_topk} rows a query token "
                             f"(max_index_topk), and {needs}; set {setting} to one of {wide}")
        dtypes = cls.sparse_kv_dtypes if cls.sparse_kv_dtypes is not None else cls.kv_dtypes
        if not any(KV_DTYPES.get(name) == kv_dtype for name in dtypes):
            raise ValueError(f"{cls.name} ({role}) runs sparse passes over kv caches of "
                             f"{[n for n in dtypes if n != 'auto']}, not {kv_dtype}, and {needs}; change kv_dtype "
                             f"or set {setting}")


def check_dense_support(choice: BackendChoice, roles: tuple[str, ...], model: str) -> None:
    """A dense model runs its passes of ``roles`` on backends with dense passes (supports_dense):
    ValueError naming ``model``, the role and the setting to change."""
    for role in roles:
        cls, setting = get_backend_class(getattr(choice, role)), ROLE_SETTINGS[role]
        if not cls.supports_dense:
            dense = [n for n in backend_names() if get_backend_class(n).supports_dense]
            raise ValueError(f"{cls.name} ({role}) runs sparse passes only (supports_dense=False), and {model} "
                             f"(dense attention) runs its {role} passes on it; set {setting} to one of {dense}")


def check_context_len(choice: BackendChoice, max_context_len: int) -> None:
    """Block tables span max_context_len tokens: a multiple of what every chosen backend needs."""
    for role, cls in choice.classes().items():
        step = cls.table_tokens_multiple
        if max_context_len % step:
            raise ValueError(f"{cls.name} ({role}) needs max_context_len to be a multiple of {step}; "
                             f"raise it to {-(-max_context_len // step) * step}")


def decode_query_lens(num_draft_tokens: int, num_steps: int, topk: int) -> dict[str, int]:
    """Query tokens per request of each role's decode passes: verify (num_draft_tokens),
    draft-extend (num_steps + 1) and the draft's steps (topk)."""
    return {"target": num_draft_tokens, "draft_extend": num_steps + 1, "draft": topk}


def check_query_lens(choice: BackendChoice, num_draft_tokens: int, num_steps: int, topk: int) -> None:
    """decode_query_lens must fit the decode kernel of the backend serving each role."""
    # With topk 1 the verify chain is num_steps + 1 tokens: num_steps is the setting to lower.
    settings = {"target": "num_steps" if topk == 1 else "num_draft_tokens", "draft_extend": "num_steps", "draft": "topk"}
    for role, q_len in decode_query_lens(num_draft_tokens, num_steps, topk).items():
        setting = settings[role]
        cls = get_backend_class(getattr(choice, role))
        if cls.max_decode_q_len is not None and q_len > cls.max_decode_q_len:
            raise ValueError(f"{cls.name} ({role}) takes at most {cls.max_decode_q_len} query tokens per request, "
                             f"got {q_len}; lower {setting}")


def check_device(choice: BackendChoice, device: torch.device) -> None:
    """Refuse kernels the device cannot run, before any kernel library is touched."""
    device = torch.device(device)
    capability = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    for role, cls in choice.classes().items():
        if cls.runs_on(capability):
            continue
        runnable = [n for n in backend_names() if get_backend_class(n).runs_on(capability)]
        here = (f"SM{capability[0]}{capability[1]} GPU {torch.cuda.get_device_name(device)}" if capability
                else f"device {device}")
        raise ValueError(f"{cls.name} ({role}) needs a {cls.required_arch()} GPU but runs on the {here}; set "
                         f"{ROLE_SETTINGS[role]} to one that runs here: {runnable}")
