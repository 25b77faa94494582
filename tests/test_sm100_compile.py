"""Compile checks for the Blackwell CuTe-DSL MLA decode kernels, on a CPU-only machine.

Each test compiles, for sm_100a, the exact kernel variant that the library's runtime entry point
would launch for one (num_heads, q_len, page_size, kv dtype) of the worker: q_len 1 is a draft /
decode step, q_len 4 a verify pass with num_draft_tokens=4. The libraries also pick split-KV (the
reducer compiled into the kernel) from the batch size and max_seq_len, so the serving tests
capture a worker's every batch size and compile each distinct variant of its graph buckets. See
attn/sm100_compile.py.

The kernel libraries are optional. Install them without pulling a CUDA build of torch (the torch
pin keeps the preinstalled CPU torch; ~1 min on 2 cores):

    echo "torch==2.13.0" > /tmp/torch-pin.txt
    pip install -c /tmp/torch-pin.txt flashinfer-python==0.7.2.post1 \
        nvidia-cutlass-dsl==4.8.1 tokenspeed-mla==2.0.4

Without them the compile tests skip (pytest.importorskip). Each compile takes 3-6 s on 2 cores;
the 24 shape variants take about 2 minutes in all, the 19 serving variants about 70 s.
"""

from __future__ import annotations

import pytest
import torch

from attn import sm100_compile
from attn.sm100_compile import (
    B200,
    KernelUnsupportedError,
    compile_cutedsl_decode,
    compile_tokenspeed_decode,
    cutedsl_decode_variant,
    distinct_variants,
    fake_b200,
    tokenspeed_decode_variant,
)

# The kernel sources (flashinfer, tokenspeed-mla) trip hundreds of CuTe-DSL deprecation and
# "slow static loop" warnings while compiling; they are the libraries' business, not ours.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

NUM_HEADS = (16, 64, 128)
Q_LENS = (1, 4)  # 1: draft / decode step; 4: verify with num_draft_tokens=4
PAGE_SIZE = 64
KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)

SHAPES = [
    pytest.param(h, q, dt, id=f"h{h}-q{q}-{str(dt).removeprefix('torch.')}")
    for dt in KV_DTYPES
    for h in NUM_HEADS
    for q in Q_LENS
]


def _need_tokenspeed() -> None:
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    pytest.importorskip("tokenspeed_mla", reason="tokenspeed-mla not installed")


def _need_flashinfer() -> None:
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    pytest.importorskip("flashinfer", reason="flashinfer-python not installed")


# ---------------------------------------------------------------------------------------------
# The fake device (no kernel library needed)
# ---------------------------------------------------------------------------------------------


def test_import_does_not_pull_kernel_libraries() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import attn.sm100_compile; "
        "bad = [m for m in ('flashinfer', 'cutlass', 'tokenspeed_mla') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=_repo_root())


def _repo_root() -> str:
    import pathlib

    return str(pathlib.Path(sm100_compile.__file__).resolve().parents[1])


def test_fake_b200_answers_device_queries_and_restores_them() -> None:
    get_capability = torch.cuda.get_device_capability
    get_properties = torch.cuda.get_device_properties
    with fake_b200() as device:
        assert device is B200
        assert torch.cuda.get_device_capability() == (10, 0)
        assert torch.cuda.get_device_capability(torch.device("cuda", 0)) == (10, 0)
        props = torch.cuda.get_device_properties(0)
        assert props.multi_processor_count == 148
        assert (props.major, props.minor) == (10, 0)
        assert B200.max_active_clusters(2) == 74
    assert torch.cuda.get_device_capability is get_capability
    assert torch.cuda.get_device_properties is get_properties


def test_fake_b200_restores_on_error() -> None:
    get_capability = torch.cuda.get_device_capability
    with pytest.raises(RuntimeError, match="boom"):
        with fake_b200():
            raise RuntimeError("boom")
    assert torch.cuda.get_device_capability is get_capability


def test_fake_b200_patches_cutlass_hardware_info_and_restores_it() -> None:
    cutlass_utils = pytest.importorskip("cutlass.utils", reason="nvidia-cutlass-dsl not installed")
    real = cutlass_utils.HardwareInfo
    with fake_b200():
        info = cutlass_utils.HardwareInfo()
        assert info.get_max_active_clusters(2) == 74
        assert info.get_device_multiprocessor_count() == 148
    assert cutlass_utils.HardwareInfo is real


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=0, q_len=1, page_size=64, kv_dtype=torch.bfloat16), "num_heads"),
        (dict(num_heads=16, q_len=1, page_size=64, kv_dtype=torch.float16), "kv_dtype"),
        (dict(num_heads=16, q_len=1, page_size=64, kv_dtype=torch.bfloat16, max_seq_len=0),
         "max_seq_len"),
    ],
)
@pytest.mark.parametrize("compile_fn", [compile_tokenspeed_decode, compile_cutedsl_decode])
def test_bad_arguments_are_refused_before_any_library_is_used(compile_fn, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        compile_fn(**kwargs)


# ---------------------------------------------------------------------------------------------
# tokenspeed-mla decode (tokenspeed_mla.tokenspeed_mla_decode)
# ---------------------------------------------------------------------------------------------
# The specdec tokenspeed_mla backend only runs an FP8 KV cache (as upstream SGLang does), but the
# library's decode kernel itself supports BF16 too, so both dtypes are compiled: nothing here is
# skipped for lack of support. num_heads=16 with q_len=4 takes the FP8 M=64 tile family and folds
# the 4 query tokens into the head dimension (fold_sq_factor=4).


@pytest.mark.parametrize("num_heads, q_len, kv_dtype", SHAPES)
def test_tokenspeed_decode_compiles(num_heads, q_len, kv_dtype, record_property) -> None:
    _need_tokenspeed()
    variant = tokenspeed_decode_variant(num_heads, q_len, PAGE_SIZE, kv_dtype)
    assert variant.name == "tokenspeed_mla.mla_decode._get_compiled_mla_kernel"
    kw = variant.kwargs
    assert kw["compute_capability"] == (10, 0)
    assert (kw["num_heads"], kw["seq_len_q"], kw["page_size"]) == (num_heads, q_len, PAGE_SIZE)
    assert kw["torch_dtype"] == kv_dtype
    assert kw["use_pdl"] is True

    seconds = compile_tokenspeed_decode(num_heads, q_len, PAGE_SIZE, kv_dtype)
    record_property("compile_seconds", round(seconds, 2))
    assert seconds > 0


def test_tokenspeed_folds_verify_tokens_for_16_heads() -> None:
    _need_tokenspeed()
    variant = tokenspeed_decode_variant(16, 4, PAGE_SIZE, torch.float8_e4m3fn)
    assert variant.kwargs["fold_sq_factor"] == 4


def test_tokenspeed_rejects_more_than_128_heads() -> None:
    _need_tokenspeed()
    with pytest.raises(KernelUnsupportedError, match="unsupported configuration"):
        tokenspeed_decode_variant(256, 1, PAGE_SIZE, torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------
# FlashInfer cute-dsl MLA decode (trtllm_batch_decode_with_kv_cache_mla(backend="cute-dsl"))
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_heads, q_len, kv_dtype", SHAPES)
def test_cutedsl_decode_compiles(num_heads, q_len, kv_dtype, record_property) -> None:
    _need_flashinfer()
    variant = cutedsl_decode_variant(num_heads, q_len, PAGE_SIZE, kv_dtype)
    # cute_dsl_impl="auto" without sinks runs the monolithic kernels.
    assert variant.name == (
        "flashinfer.cute_dsl.attention.monolithic.mla_decode._get_compiled_mla_kernel"
    )
    kw = variant.kwargs
    assert kw["arch"] == "sm_100a"
    assert (kw["num_heads"], kw["seq_len_q"], kw["page_size"]) == (num_heads, q_len, PAGE_SIZE)
    assert kw["torch_dtype"] == kv_dtype
    assert kw["torch_out_dtype"] == torch.bfloat16
    assert kw["enable_pdl"] is True

    seconds = compile_cutedsl_decode(num_heads, q_len, PAGE_SIZE, kv_dtype)
    record_property("compile_seconds", round(seconds, 2))
    assert seconds > 0


def test_cutedsl_modular_variant_is_reachable() -> None:
    _need_flashinfer()
    variant = cutedsl_decode_variant(128, 1, PAGE_SIZE, torch.bfloat16, cute_dsl_impl="modular")
    assert variant.name == "flashinfer.cute_dsl.attention.wrappers.batch_mla._compile_mla_kernel"


def test_cutedsl_rejects_more_than_128_heads() -> None:
    _need_flashinfer()
    with pytest.raises(KernelUnsupportedError, match="cannot implement"):
        cutedsl_decode_variant(256, 1, PAGE_SIZE, torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------
# Serving sizes: the variant depends on batch size and max_seq_len (split-KV reducer capacity)
# ---------------------------------------------------------------------------------------------


# The worker's requests: a DeepSeek-V3 worker at tensor parallelism 8 (16 heads a rank) under CUDA
# graphs. Each backend's decode kernel serves the passes the registry gives its family, at the
# graph runner's batch buckets, over block tables max_context_len wide (max_seq_len).
SERVING = dict(num_steps=3, topk=1, page_size=64, max_batch_size=64, max_context_len=32768)
SERVING_HEADS = 16


def _serving_shapes(backend: str, kv_dtype: str, batch_sizes: list[int], num_heads: int,
                    page_size: int = SERVING["page_size"]) -> list[dict]:
    from attn.base import KV_DTYPES as POOL_DTYPES
    from attn.registry import decode_query_lens
    from specdec.config import SpecConfig

    cfg = SpecConfig(**{**SERVING, "page_size": page_size}, attention_backend=backend, kv_dtype=kv_dtype)
    q_lens = {q_len for role, q_len in decode_query_lens(cfg.num_draft_tokens, cfg.num_steps, cfg.topk).items()
              if getattr(cfg.backends, role) == backend}
    return [dict(num_heads=num_heads, q_len=q_len, page_size=page_size, kv_dtype=POOL_DTYPES[kv_dtype], batch_size=bs,
                 max_seq_len=cfg.max_context_len) for q_len in sorted(q_lens) for bs in batch_sizes]


def _prefill_shapes(backend: str, kv_dtype: str, num_heads: int, page_size: int = SERVING["page_size"]) -> list[dict]:
    """The family's prefill passes where it serves them through its decode kernel in chunks
    (PagedMLABackend.prefill_chunk_len): eager, so any batch up to max_batch_size, over block
    tables max_context_len wide; none where another family serves prefill."""
    from attn.base import KV_DTYPES as POOL_DTYPES
    from attn.registry import get_backend_class
    from specdec.config import SpecConfig

    cfg = SpecConfig(**{**SERVING, "page_size": page_size}, attention_backend=backend, kv_dtype=kv_dtype)
    if cfg.backends.prefill != backend:
        return []
    cls = get_backend_class(backend)
    # Prompts of any length: one width (the chunk does not follow the prompts).
    (q_len,) = {cls.prefill_chunk_len(max_q_len, cfg.max_context_len) for max_q_len in range(1, cfg.max_context_len + 1)}
    return [dict(num_heads=num_heads, q_len=q_len, page_size=page_size, kv_dtype=POOL_DTYPES[kv_dtype], batch_size=bs,
                 max_seq_len=cfg.max_context_len) for bs in range(1, cfg.max_batch_size + 1)]


SERVING_BACKENDS = [
    pytest.param("tokenspeed_mla", "fp8_e4m3", id="tokenspeed_mla"),
    pytest.param("cutedsl_mla", "bf16", id="cutedsl_mla"),
]


def _variant_fn(backend: str):
    if backend == "tokenspeed_mla":
        _need_tokenspeed()
        return tokenspeed_decode_variant
    _need_flashinfer()
    return cutedsl_decode_variant


@pytest.mark.parametrize("backend, kv_dtype", SERVING_BACKENDS)
def test_every_variant_the_worker_requests_compiles(backend, kv_dtype, record_property) -> None:
    """The variants at the graph runner's default buckets (1, 2, 4, 8, 16, ... 64) and the
    verify, draft and draft-extend q_lens the family serves, and its prefill chunks at every batch
    size (eager), each compiled once."""
    from graphs.runner import default_buckets

    shapes = _serving_shapes(backend, kv_dtype, default_buckets(SERVING["max_batch_size"]), SERVING_HEADS)
    shapes += _prefill_shapes(backend, kv_dtype, SERVING_HEADS)
    variants = distinct_variants(_variant_fn(backend), shapes)
    # Split-KV follows the batch size: more than one variant per q_len.
    assert len({shape["q_len"] for shape in shapes}) < len(variants) < len(shapes)
    seconds = [variant.compile() for variant, _ in variants]
    record_property("variants", len(variants))
    record_property("compile_seconds", round(sum(seconds), 1))


@pytest.mark.parametrize("page_size", [32, 64])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("backend, kv_dtype", SERVING_BACKENDS)
def test_every_eager_batch_size_is_a_variant_the_library_takes(backend, kv_dtype, num_heads, page_size) -> None:
    """Eager batches take any size up to max_batch_size: each size's variant is one the library's
    own checks accept (captured, not compiled: ~0.01 s each)."""
    shapes = _serving_shapes(backend, kv_dtype, list(range(1, SERVING["max_batch_size"] + 1)), num_heads, page_size)
    shapes += _prefill_shapes(backend, kv_dtype, num_heads, page_size)
    variants = distinct_variants(_variant_fn(backend), shapes)  # KernelUnsupportedError: a size refused
    assert {(v.kwargs["num_heads"], v.kwargs["page_size"]) for v, _ in variants} == {(num_heads, page_size)}
    assert all(v.kwargs["seq_len_q"] == shape["q_len"] for v, asked in variants for shape in asked)


def test_fake_b200_pins_the_cute_dsl_default_arch() -> None:
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from cutlass.cutlass_dsl import BaseDSL

    dsl = BaseDSL._get_dsl()
    before = dsl.envar.arch
    with fake_b200():
        assert str(dsl.get_arch_enum()) == "sm_100a"
    assert dsl.envar.arch == before
