"""Compile checks for the Blackwell (SM100 family) CuTe-DSL MLA decode kernels without a GPU.

Our GPUs are Hopper, and CI has none, yet two of the Blackwell-only decode kernels the worker can
select compile for ``sm_100a`` (B200) or ``sm_103a`` (B300) on any machine once their few device
queries are answered by a fixed description (devtools/fake_blackwell.py: :data:`B200`,
:data:`B300`): tokenspeed-mla's ``tokenspeed_mla_decode`` (the ``tokenspeed_mla`` backend) and
FlashInfer's ``trtllm_batch_decode_with_kv_cache_mla(..., backend="cute-dsl")`` (``cutedsl_mla``).
trtllm-gen ships precompiled cubins and cannot be checked this way.

What this module compiles is *exactly* the variant the runtime call would launch: it calls the
library's public entry point with host tensors of the requested shapes under :func:`fake_b200`,
intercepts the library's own compile function when the entry point asks for a kernel (before
anything launches), and compiles with those very arguments, instead of re-deriving tile shapes,
query folding, split-KV capacity or PDL. If a release moves its compile call, capture fails loudly.
Importing this module imports neither flashinfer, cutlass nor tokenspeed_mla.

Example::

    from devtools.fake_blackwell import B300
    from devtools.sm100_compile import compile_cutedsl_decode, compile_tokenspeed_decode

    seconds = compile_tokenspeed_decode(num_heads=128, q_len=4, page_size=64, kv_dtype=torch.float8_e4m3fn)
    seconds = compile_cutedsl_decode(num_heads=16, q_len=4, page_size=64, kv_dtype=torch.bfloat16,
                                     device=B300)  # sm_103a
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Collection, Mapping
from unittest import mock

import torch

from attn.values import is_int
from devtools.fake_blackwell import B200, DeviceDescription, fake_b200

__all__ = [
    "KernelUnsupportedError",
    "KernelVariant",
    "compile_cutedsl_decode",
    "compile_tokenspeed_decode",
    "cutedsl_decode_variant",
    "distinct_variants",
    "tokenspeed_decode_variant",
]

# DeepSeek-V3 MLA geometry: the paged latent cache is kv_lora_rank + qk_rope_head_dim = 576 wide.
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 128
HEAD_DIM_QK = KV_LORA_RANK + QK_ROPE_HEAD_DIM

SUPPORTED_KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


# --------------------------------------------------------------------------------------------
# Capturing the kernel variant a runtime call would compile
# --------------------------------------------------------------------------------------------


class KernelUnsupportedError(ValueError):
    """The library itself rejects this configuration (its own ``can_implement`` check) or device."""


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    """One compiled-kernel variant, as the library's runtime entry point asked for it.

    ``compile_fn`` is the library's own compile function (e.g.
    ``tokenspeed_mla.mla_decode._get_compiled_mla_kernel``) and ``kwargs`` the exact arguments the
    entry point passed it on ``device``; ``compile_fn(**kwargs)`` there is the kernel the runtime
    call would launch.
    """

    library: str
    compile_fn: Callable[..., Any]
    kwargs: Mapping[str, Any]
    device: DeviceDescription

    @property
    def name(self) -> str:
        return f"{self.compile_fn.__module__}.{self.compile_fn.__qualname__}"

    @property
    def key(self) -> str:
        """Equal for variants that compile the same kernel. The device is part of it: a compile
        function may ask the device more (tokenspeed reads its cluster capacity while compiling)."""
        return repr((self.name, self.device, sorted(self.kwargs.items())))

    def compile(self) -> float:
        """Compile this variant under :func:`fake_b200` of its device; return wall-clock seconds.

        Bypasses the library's ``functools.cache`` (calls ``__wrapped__``), so every call really
        compiles and no fake-device kernel is left in the library's cache.
        """
        fn = getattr(self.compile_fn, "__wrapped__", self.compile_fn)
        with fake_b200(self.device):
            start = time.perf_counter()
            compiled = fn(**self.kwargs)
            seconds = time.perf_counter() - start
        if compiled is None:
            raise RuntimeError(f"{self.name} returned no compiled kernel")
        return seconds


class _Captured(Exception):
    """Raised by the spy in place of the library's compile function."""

    def __init__(self, compile_fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        super().__init__(compile_fn.__qualname__)
        self.compile_fn = compile_fn
        self.args_ = args
        self.kwargs_ = kwargs


def _spy_on(module: Any, attr: str) -> Any:
    original = getattr(module, attr)

    def spy(*args: Any, **kwargs: Any) -> Any:
        raise _Captured(original, args, kwargs)

    return mock.patch.object(module, attr, spy)


def _bind(compile_fn: Callable[..., Any], args: tuple, kwargs: dict) -> dict:
    import inspect

    target = getattr(compile_fn, "__wrapped__", compile_fn)
    bound = inspect.signature(target).bind(*args, **kwargs)
    return dict(bound.arguments)


def _capture_variant(library: str, device: DeviceDescription, launch: Callable[[], Any],
                     unsupported_markers: tuple[str, ...], missed: str) -> KernelVariant:
    """Run a library entry point (under :func:`fake_b200` of ``device`` and the spies) and return
    the kernel variant it asked for.

    A ValueError containing one of ``unsupported_markers`` is the library rejecting the
    configuration or the device (:class:`KernelUnsupportedError`); returning without asking for a
    kernel is an error (``missed``).
    """
    try:
        launch()
    except _Captured as captured:
        kwargs = _bind(captured.compile_fn, captured.args_, captured.kwargs_)
        return KernelVariant(library, captured.compile_fn, kwargs, device)
    except ValueError as exc:
        if any(marker in str(exc) for marker in unsupported_markers):
            raise KernelUnsupportedError(str(exc)) from exc
        raise
    raise RuntimeError(missed)


def _check_shape_args(
    num_heads: int, q_len: int, page_size: int, kv_dtype: torch.dtype, batch_size: int,
    max_seq_len: int,
) -> None:
    for name, value in (
        ("num_heads", num_heads), ("q_len", q_len), ("page_size", page_size),
        ("batch_size", batch_size), ("max_seq_len", max_seq_len),
    ):
        if not is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if kv_dtype not in SUPPORTED_KV_DTYPES:
        raise ValueError(
            f"kv_dtype must be one of {SUPPORTED_KV_DTYPES} (the MLA KV pool dtypes), "
            f"got {kv_dtype!r}"
        )
    if max_seq_len < q_len:
        raise ValueError(f"max_seq_len ({max_seq_len}) must be >= q_len ({q_len})")


def _host_inputs(
    num_heads: int, q_len: int, page_size: int, kv_dtype: torch.dtype, batch_size: int,
    max_seq_len: int,
) -> dict[str, torch.Tensor]:
    """Host tensors shaped like the runtime call's (never read: capture stops before launch).

    query [B, q_len, H, 576] kv_dtype; kv_cache [1, page_size, 576] kv_dtype (the pool size is
    no compile parameter and is never checked against the block table); block_tables [B, pages] int32 with pages a multiple of 128/page_size
    (cute-dsl requires it); seq_lens [B] int32 = max_seq_len; workspace int8, sized for the
    largest split-KV partials the kernels can ask for (allocated, never touched).
    """
    tokens_per_tile = 128
    pages = math.ceil(max_seq_len / page_size)
    if page_size < tokens_per_tile and tokens_per_tile % page_size == 0:
        align = tokens_per_tile // page_size
        pages = math.ceil(pages / align) * align
    max_splits = 256
    workspace_bytes = batch_size * q_len * max(num_heads, 128) * max_splits * (KV_LORA_RANK + 1) * 4
    return dict(
        query=torch.empty(batch_size, q_len, num_heads, HEAD_DIM_QK, dtype=kv_dtype),
        kv_cache=torch.empty(1, page_size, HEAD_DIM_QK, dtype=kv_dtype),
        block_tables=torch.zeros(batch_size, pages, dtype=torch.int32),
        seq_lens=torch.full((batch_size,), max_seq_len, dtype=torch.int32),
        workspace_buffer=torch.empty(workspace_bytes, dtype=torch.int8, device="meta"),
    )


def _import(module: str, pip_name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module} is needed for this compile check; install {pip_name} "
            f"(without a CUDA torch: see tests/test_sm100_compile.py)"
        ) from exc


def tokenspeed_decode_variant(
    num_heads: int,
    q_len: int,
    page_size: int,
    kv_dtype: torch.dtype,
    *,
    batch_size: int = 1,
    max_seq_len: int = 4096,
    enable_pdl: bool = True,
    device: DeviceDescription = B200,
) -> KernelVariant:
    """The decode kernel ``tokenspeed_mla.tokenspeed_mla_decode`` would compile for these shapes.

    Calls it as the ``tokenspeed_mla`` backend does (query ``[B, q_len, H, 576]`` and kv_cache
    ``[pages, page_size, 576]`` in kv_dtype, block_tables ``[B, pages]`` int32, seq_lens ``[B]``
    int32; enable_pdl as SGLang passes it on SM100) and captures the arguments it passes to
    ``mla_decode._get_compiled_mla_kernel``. batch_size and max_seq_len pick split-KV (the FP8
    kernel's reducer capacity and D-band count); ``device``'s capability the target arch and the
    MMA tile (``select_mla_decode_tilers``: the FP8 M64 tile is SM100's only, an SM103 takes the
    2-CTA M128 tile). KernelUnsupportedError: ``_check_can_implement`` or ``get_mla_decode_arch``
    refused.
    """
    _check_shape_args(num_heads, q_len, page_size, kv_dtype, batch_size, max_seq_len)
    tokenspeed_mla = _import("tokenspeed_mla", "tokenspeed-mla")
    mla_decode = _import("tokenspeed_mla.mla_decode", "tokenspeed-mla")
    inputs = _host_inputs(num_heads, q_len, page_size, kv_dtype, batch_size, max_seq_len)
    with fake_b200(device), _spy_on(mla_decode, "_get_compiled_mla_kernel"):
        return _capture_variant(
            "tokenspeed_mla",
            device,
            lambda: tokenspeed_mla.tokenspeed_mla_decode(
                **inputs,
                kv_lora_rank=KV_LORA_RANK,
                qk_rope_head_dim=QK_ROPE_HEAD_DIM,
                max_seq_len=max_seq_len,
                softmax_scale=1.0 / math.sqrt(QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM),
                output_scale=1.0,
                enable_pdl=enable_pdl,
            ),
            unsupported_markers=("unsupported configuration", "MLA decode requires"),
            missed="tokenspeed_mla_decode returned without calling mla_decode._get_compiled_mla_kernel; "
            "the library's compile path changed, update devtools/sm100_compile.py",
        )


def cutedsl_decode_variant(
    num_heads: int,
    q_len: int,
    page_size: int,
    kv_dtype: torch.dtype,
    *,
    batch_size: int = 1,
    max_seq_len: int = 4096,
    cute_dsl_impl: str = "auto",
    device: DeviceDescription = B200,
) -> KernelVariant:
    """The kernel ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla(backend="cute-dsl")``
    would compile for these shapes, called as the ``cutedsl_mla`` backend does (query ``[B, q_len,
    H, 576]``, kv_cache ``[pages, 1, page_size, 576]`` in kv_dtype, block_tables ``[B, pages]``
    int32, seq_lens ``[B]`` int32; cute_dsl_impl "auto" resolves to the monolithic kernels unless
    ``sinks`` are passed): the arguments of the monolithic ``_get_compiled_mla_kernel`` or, for
    "modular", ``wrappers.batch_mla._compile_mla_kernel``. It compiles for ``device``'s arch; its
    tiles and split-KV do not depend on the arch (split-KV follows the SM count).
    KernelUnsupportedError: FlashInfer's ``_cute_dsl_incompatibility_reason`` refused.
    """
    _check_shape_args(num_heads, q_len, page_size, kv_dtype, batch_size, max_seq_len)
    core = _import("flashinfer.mla._core", "flashinfer-python")
    monolithic = _import("flashinfer.cute_dsl.attention.monolithic.mla_decode", "flashinfer-python")
    modular = _import("flashinfer.cute_dsl.attention.wrappers.batch_mla", "flashinfer-python")
    inputs = _host_inputs(num_heads, q_len, page_size, kv_dtype, batch_size, max_seq_len)
    inputs["kv_cache"] = inputs["kv_cache"].unsqueeze(1)  # [pages, 1, page_size, 576], as SGLang

    def capability(_device: Any = None) -> tuple[int, int]:
        return (device.major, device.minor)

    # FlashInfer's device helpers refuse non-CUDA tensors: besides fake_b200, its capability, PDL and
    # SM-count queries in _core and the monolithic module are answered for the call (enable_pdl then
    # resolves as on a B200: True).
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_b200(device))
        stack.enter_context(mock.patch.object(core, "get_compute_capability", capability))
        stack.enter_context(
            mock.patch.object(core, "device_support_pdl", lambda _d=None: device.major >= 9)
        )
        stack.enter_context(
            mock.patch.object(
                core, "get_device_sm_count", lambda _d=None: device.multi_processor_count
            )
        )
        stack.enter_context(mock.patch.object(monolithic, "get_compute_capability", capability))
        stack.enter_context(_spy_on(monolithic, "_get_compiled_mla_kernel"))
        stack.enter_context(_spy_on(modular, "_compile_mla_kernel"))
        return _capture_variant(
            "flashinfer",
            device,
            lambda: core.trtllm_batch_decode_with_kv_cache_mla(
                **inputs,
                qk_nope_head_dim=QK_NOPE_HEAD_DIM,
                kv_lora_rank=KV_LORA_RANK,
                qk_rope_head_dim=QK_ROPE_HEAD_DIM,
                max_seq_len=max_seq_len,
                bmm1_scale=1.0 / math.sqrt(QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM),
                bmm2_scale=1.0,
                backend="cute-dsl",
                cute_dsl_impl=cute_dsl_impl,
            ),
            unsupported_markers=("cute-dsl backend",),
            missed="trtllm_batch_decode_with_kv_cache_mla(backend='cute-dsl') returned without calling a "
            "known cute-dsl compile function; update devtools/sm100_compile.py",
        )


def compile_tokenspeed_decode(
    num_heads: int,
    q_len: int,
    page_size: int,
    kv_dtype: torch.dtype,
    *,
    batch_size: int = 1,
    max_seq_len: int = 4096,
    enable_pdl: bool = True,
    device: DeviceDescription = B200,
) -> float:
    """Compile tokenspeed-mla's MLA decode kernel for ``device`` (sm_100a on the default B200,
    sm_103a on a :data:`B300`), as the runtime would; return seconds.

    Shapes: query [batch_size, q_len, num_heads, 576] and KV pool [pages, page_size, 576], both
    ``kv_dtype`` (``torch.float8_e4m3fn`` or ``torch.bfloat16``); output [B, q_len, H, 512] bf16.
    ``q_len`` is 1 for draft/decode steps and ``num_draft_tokens`` for verify. Needs no GPU.
    See :func:`tokenspeed_decode_variant` for which variant is compiled.
    """
    return tokenspeed_decode_variant(
        num_heads, q_len, page_size, kv_dtype,
        batch_size=batch_size, max_seq_len=max_seq_len, enable_pdl=enable_pdl, device=device,
    ).compile()


def compile_cutedsl_decode(
    num_heads: int,
    q_len: int,
    page_size: int,
    kv_dtype: torch.dtype,
    *,
    batch_size: int = 1,
    max_seq_len: int = 4096,
    cute_dsl_impl: str = "auto",
    device: DeviceDescription = B200,
) -> float:
    """Compile FlashInfer's cute-dsl MLA decode kernel for ``device`` (sm_100a on the default
    B200, sm_103a on a :data:`B300`), as the runtime would; return seconds.

    Shapes as for :func:`compile_tokenspeed_decode` (query [B, q_len, H, 576], KV pool
    [pages, page_size, 576], same dtype; output bf16). Needs no GPU. See
    :func:`cutedsl_decode_variant` for which variant is compiled.
    """
    return cutedsl_decode_variant(
        num_heads, q_len, page_size, kv_dtype,
        batch_size=batch_size, max_seq_len=max_seq_len, cute_dsl_impl=cute_dsl_impl, device=device,
    ).compile()


def distinct_variants(
    variant_fn: Callable[..., KernelVariant], shapes: list[Mapping[str, Any]],
    known: Collection[KernelVariant] = (),
) -> list[tuple[KernelVariant, list[Mapping[str, Any]]]]:
    """The distinct kernel variants ``variant_fn`` (:func:`tokenspeed_decode_variant` or
    :func:`cutedsl_decode_variant`, a ``device`` bound with ``functools.partial``) captures for
    ``shapes`` (its keyword arguments, one dict a call), in first-seen order, each with the shapes
    that ask for it; those among ``known`` (already compiled elsewhere) left out.

    A worker's serving sizes (batch sizes x max_seq_len) map to a few variants, as the libraries
    pick split-KV from both: capturing is cheap (~0.01 s), so every size is captured and each
    variant compiled once.
    """
    skip = {variant.key for variant in known}
    seen: dict[str, tuple[KernelVariant, list[Mapping[str, Any]]]] = {}
    for shape in shapes:
        variant = variant_fn(**shape)
        if variant.key not in skip:
            seen.setdefault(variant.key, (variant, []))[1].append(shape)
    return list(seen.values())
