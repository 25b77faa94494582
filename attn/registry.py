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

from attn.paged import PagedMLABackend

_BACKENDS = {
    "torch_ref": "attn.torch_ref:TorchRefBackend",
    "triton_mla": "attn.triton_mla:TritonMLABackend",
    "flashinfer_mla": "attn.flashinfer_mla:FlashInferMLABackend",
    "trtllm_mla": "attn.trtllm_mla:TrtllmMLABackend",
    "cutedsl_mla": "attn.cutedsl_mla:CuteDslMLABackend",
    "tokenspeed_mla": "attn.tokenspeed_mla:TokenspeedMLABackend",
}

DEFAULT_BLACKWELL_PAGE_SIZE = 64


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend_class(name: str) -> type[PagedMLABackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {backend_names()}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class BackendChoice:
    """Which backend serves which role.

    target: target verify. draft: the draft's multi-step decode. prefill: prefill (target and
    draft) and draft-extend.
    """

    target: str
    draft: str
    prefill: str

    def classes(self) -> dict[str, type[PagedMLABackend]]:
        return {role: get_backend_class(name) for role, name in vars(self).items()}


def resolve_backends(attention: str, decode: Optional[str] = None, prefill: Optional[str] = None) -> BackendChoice:
    """Fill in the draft and prefill roles; refuse decode-only kernels as prefill backend."""
    target_cls = get_backend_class(attention)
    draft = decode or attention
    get_backend_class(draft)
    if prefill is None:
        prefill = attention if target_cls.supports_prefill else target_cls.prefill_fallback
    if not get_backend_class(prefill).supports_prefill:
        raise ValueError(
            f"prefill_backend {prefill!r} is decode-only and cannot run prefill or draft-extend; "
            f"set prefill_backend to {get_backend_class(prefill).prefill_fallback!r} or leave it unset"
        )
    return BackendChoice(target=attention, draft=draft, prefill=prefill)


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


def check_tree_support(choice: BackendChoice, topk: int) -> None:
    """topk > 1 trees need tree masks in the target verify and in the draft's steps."""
    if topk == 1:
        return
    for role in ("target", "draft"):
        cls = get_backend_class(getattr(choice, role))
        if not cls.supports_tree_mask:
            raise ValueError(f"{cls.name} ({role}) cannot attend with a tree mask: use topk=1, or torch_ref/triton_mla for {role}")


def check_device(choice: BackendChoice, device: torch.device) -> None:
    """Refuse kernels the device cannot run, before any kernel library is touched."""
    device = torch.device(device)
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None
    for role, cls in choice.classes().items():
        if cls.required_sm is None or major in cls.required_sm:
            continue
        runnable = [n for n in backend_names() if _runs_on(get_backend_class(n), major)]
        here = f"SM{major}0 GPU {torch.cuda.get_device_name(device)}" if major is not None else f"device {device}"
        arch = "/".join(f"SM{m}x" for m in cls.required_sm)
        raise ValueError(f"{cls.name} ({role}) needs a {arch} GPU but runs on the {here}; backends that run here: {runnable}")


def _runs_on(cls: type[PagedMLABackend], major: Optional[int]) -> bool:
    return cls.required_sm is None or major in cls.required_sm
