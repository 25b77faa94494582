"""Compile checks for the Blackwell CuTe-DSL MLA decode kernels, on a CPU-only machine.

Each test compiles, for sm_100a, the exact kernel variant that the library's runtime entry point
would launch for one (num_heads, q_len, page_size, kv dtype) of the worker: q_len 1 is a draft /
decode step, q_len 4 a verify pass with num_draft_tokens=4. See attn/sm100_compile.py.

The kernel libraries are optional. Install them without pulling a CUDA build of torch (the torch
pin keeps the preinstalled CPU torch; ~1 min on 2 cores):

    echo "torch==2.13.0" > /tmp/torch-pin.txt
    pip install -c /tmp/torch-pin.txt flashinfer-python==0.7.2.post1 \
        nvidia-cutlass-dsl==4.8.1 tokenspeed-mla==2.0.4

Without them the compile tests skip (pytest.importorskip). Each compile takes 3-6 s on 2 cores;
the 24 variants below take about 2 minutes in all.
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


@pytest.mark.parametrize("library", ["tokenspeed", "cutedsl"])
def test_capture_at_serving_sizes_allocates_no_workspace(library) -> None:
    if library == "tokenspeed":
        _need_tokenspeed()
        variant_fn = tokenspeed_decode_variant
    else:
        _need_flashinfer()
        variant_fn = cutedsl_decode_variant
    small = variant_fn(128, 4, PAGE_SIZE, torch.float8_e4m3fn, batch_size=1, max_seq_len=4096)
    large = variant_fn(128, 4, PAGE_SIZE, torch.float8_e4m3fn, batch_size=256,
                       max_seq_len=163840)
    assert small.kwargs != large.kwargs  # different split-KV reducer -> a different kernel


def test_fake_b200_pins_the_cute_dsl_default_arch() -> None:
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from cutlass.cutlass_dsl import BaseDSL

    dsl = BaseDSL._get_dsl()
    before = dsl.envar.arch
    with fake_b200():
        assert str(dsl.get_arch_enum()) == "sm_100a"
    assert dsl.envar.arch == before
