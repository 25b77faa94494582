"""Compile checks for the Blackwell CuTe-DSL MLA decode kernels, on a CPU-only machine.

Each test compiles, for sm_100a (B200), the exact kernel variant that the library's runtime entry
point would launch for one (num_heads, q_len, page_size, kv dtype) of the worker: q_len 1 is a
draft / decode step, q_len 4 a verify pass with num_draft_tokens=4. The libraries also pick
split-KV (the reducer compiled into the kernel) from the batch size and max_seq_len, so the serving
tests capture, at the SERVING sizes, a worker's every batch size up to max_batch_size (the graph
buckets and eager batches), its prefill chunks and its captures planned for a kv bound, and compile
each distinct variant once. For sm_103a (B300) the variants that differ from the B200's beyond the
target arch are compiled; the rest, over the same shapes, are asserted to be B200 variants (compiled
for sm_100a) but for the arch, and one per FlashInfer kernel source compiles for sm_103a too. At
other head counts and page sizes, eager batch sizes are only captured. See devtools/sm100_compile.py.

The kernel libraries are optional. Install them without pulling a CUDA build of torch (the torch
pin keeps the preinstalled CPU torch; ~1 min on 2 cores):

    echo "torch==2.13.0" > /tmp/torch-pin.txt
    pip install -c /tmp/torch-pin.txt flashinfer-python==0.7.2.post1 \
        nvidia-cutlass-dsl==4.8.1 tokenspeed-mla==2.0.4

Without them the compile tests skip (pytest.importorskip). Each compile takes 3-6 s on 2 cores
(10-25 s on a slower 2-core machine): 24 shape variants, 27 serving variants of the longest
context (every batch size, prefill chunks), 6 more of the kv-bounded captures, and 18 for sm_103a.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from devtools import sm100_compile
from devtools.fake_blackwell import B200, B300, fake_b200
from devtools.sm100_compile import (
    KernelUnsupportedError,
    KernelVariant,
    compile_cutedsl_decode,
    compile_tokenspeed_decode,
    cutedsl_decode_variant,
    distinct_variants,
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
# The same, as the variant functions' keyword arguments.
SHAPE_KWARGS = [dict(num_heads=h, q_len=q, page_size=PAGE_SIZE, kv_dtype=dt) for h, q, dt in (p.values for p in SHAPES)]
FP8 = torch.float8_e4m3fn


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
        "import sys; import devtools.sm100_compile; "
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


def _unbounded_shapes(backend: str, kv_dtype: str, num_heads: int = SERVING_HEADS,
                      page_size: int = SERVING["page_size"]) -> list[dict]:
    """The family's passes at every batch size up to max_batch_size, planned for the longest
    context (eager passes take any size; the graph runner's buckets, 1, 2, 4, 8, 16, ... 64, are
    among them), and its prefill chunks at every batch size (eager)."""
    shapes = _serving_shapes(backend, kv_dtype, list(range(1, SERVING["max_batch_size"] + 1)), num_heads, page_size)
    return shapes + _prefill_shapes(backend, kv_dtype, num_heads, page_size)


def _shape_variants(variant_fn) -> list[KernelVariant]:
    """The variants of SHAPES on the B200, which test_*_decode_compiles compile."""
    return [variant for variant, _ in distinct_variants(variant_fn, SHAPE_KWARGS)]


@pytest.mark.parametrize("backend, kv_dtype", SERVING_BACKENDS)
def test_every_variant_the_worker_requests_compiles(backend, kv_dtype, record_property) -> None:
    """The variants of the verify, draft and draft-extend q_lens the family serves at every batch
    size (the graph runner's buckets and eager batches), and of its prefill chunks
    (_unbounded_shapes), each compiled once for sm_100a; those of SHAPES left out (compiled above)."""
    from graphs.runner import default_buckets

    shapes = _unbounded_shapes(backend, kv_dtype)
    assert set(default_buckets(SERVING["max_batch_size"])) <= {shape["batch_size"] for shape in shapes}
    variant_fn = _variant_fn(backend)
    variants = distinct_variants(variant_fn, shapes, known=_shape_variants(variant_fn))
    # Split-KV follows the batch size: more than one variant per q_len.
    assert len({shape["q_len"] for shape in shapes}) < len(variants) < len(shapes)
    seconds = [variant.compile() for variant, _ in variants]
    record_property("variants", len(variants))
    record_property("compile_seconds", round(sum(seconds), 1))


@pytest.mark.parametrize("device", [B200, B300], ids=["B200", "B300"])
@pytest.mark.parametrize("page_size", [32, 64])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("backend, kv_dtype", SERVING_BACKENDS)
def test_every_eager_batch_size_is_a_variant_the_library_takes(backend, kv_dtype, num_heads, page_size, device) -> None:
    """Eager batches take any size up to max_batch_size: each size's variant is one the library's
    own checks accept, on a B200 and on a B300, at other head counts and page sizes too (captured
    here, ~0.01 s each). At the SERVING sizes their variants compile: above for sm_100a, and below
    for sm_103a where they are not the B200's but for the arch."""
    shapes = _unbounded_shapes(backend, kv_dtype, num_heads, page_size)
    variant_fn = functools.partial(_variant_fn(backend), device=device)
    variants = distinct_variants(variant_fn, shapes)  # KernelUnsupportedError: a size refused
    assert {(v.kwargs["num_heads"], v.kwargs["page_size"]) for v, _ in variants} == {(num_heads, page_size)}
    assert all(v.kwargs["seq_len_q"] == shape["q_len"] for v, asked in variants for shape in asked)


# ---------------------------------------------------------------------------------------------
# kv-bounded graph captures: each pass planned for bound + its extra kv rows
# ---------------------------------------------------------------------------------------------
# The graph runner captures a bucket's step once more per kv bound (SpecStep.kv_len_buckets, an
# argument of each capture), with every pass's AttnBatch.max_kv_len = bound + the pass's extra kv rows
# (SpecStep.pass_shapes), which the Blackwell backends hand the library as max_seq_len. The bounds
# come from the backends' kv_len_bounds: the Blackwell backends declare none, so a worker of one
# Blackwell family alone captures no bounded step (listed all the same, for when they do), but one
# where triton_mla serves another role does (bounds of ~1k, 2k and 4k tokens at batches up to 4 on
# a B200), and its Blackwell passes ask for fewer splits and other reducer capacities.


def _kv_bound_settings(backend: str) -> list[dict]:
    """The worker settings in which ``backend`` serves some roles: alone, and beside triton_mla."""
    return [
        dict(attention_backend=backend),
        dict(attention_backend=backend, decode_backend="triton_mla"),
        dict(attention_backend=backend, prefill_backend="triton_mla"),
        dict(attention_backend="triton_mla", decode_backend=backend),
    ]


@pytest.fixture
def planned_as_on_a_b200(monkeypatch) -> None:
    """Workers built on the CPU plan as on a B200: the backends' GPU checks lifted (nothing
    launches) and Triton's planner given the B200's SMs, not the interpreter's one. A B300 has as
    many, so its workers plan the same captures."""
    assert B300.multi_processor_count == B200.multi_processor_count
    from attn.kernels.triton_mla import kernel as triton_mla_kernel
    from attn.registry import backend_names, get_backend_class

    for name in backend_names():
        monkeypatch.setattr(get_backend_class(name), "required_sm", None)
    monkeypatch.setattr(triton_mla_kernel, "_num_sms", lambda device: B200.multi_processor_count)


def _serving_worker(models, settings: dict, kv_dtype: str):
    """An EagleWorker of the SERVING sizes; its pools hold one request at full context (the kv
    bounds follow the block tables' width, not the pool's size)."""
    from specdec.config import SpecConfig
    from specdec.worker import EagleWorker

    pages = SERVING["max_context_len"] // SERVING["page_size"] + 1  # + the padding page
    return EagleWorker(*models, SpecConfig(**SERVING, **settings, kv_dtype=kv_dtype, num_pages=pages))


def _kv_bounded_shapes(worker, backend: str, kv_dtype: str, buckets: list[int]) -> list[dict]:
    """The shapes ``backend``'s passes ask for in the worker's kv-bounded captures: per bucket and
    bound on N (SpecStep.kv_len_buckets), max_seq_len = bound + the pass's extra kv rows."""
    from attn.base import KV_DTYPES as POOL_DTYPES

    return [dict(num_heads=SERVING_HEADS, q_len=q_len, page_size=SERVING["page_size"], kv_dtype=POOL_DTYPES[kv_dtype],
                 batch_size=bs, max_seq_len=bound + extra)
            for bs in buckets for bound in worker.spec_step.kv_len_buckets(bs)
            for pass_backend, extra, q_len in worker.spec_step.pass_shapes() if pass_backend.name == backend]


def _every_kv_bounded_shape(backend: str, kv_dtype: str) -> list[dict]:
    """The shapes of the kv-bounded captures at the default buckets, of every worker the family
    serves in (_kv_bound_settings); under planned_as_on_a_b200."""
    from graphs.runner import default_buckets
    from spec_helpers import make_models

    models = make_models(num_attention_heads=SERVING_HEADS)
    buckets = default_buckets(SERVING["max_batch_size"])
    return [shape for settings in _kv_bound_settings(backend)
            for shape in _kv_bounded_shapes(_serving_worker(models, settings, kv_dtype), backend, kv_dtype, buckets)]


@pytest.mark.usefixtures("planned_as_on_a_b200")
@pytest.mark.parametrize("backend, kv_dtype", SERVING_BACKENDS)
def test_every_kv_bounded_variant_the_worker_captures_compiles(backend, kv_dtype, record_property) -> None:
    """The variants of the kv-bounded captures (_every_kv_bounded_shape) that neither SHAPES nor
    the longest context's passes at any batch size ask for (those compile above), compiled for
    sm_100a."""
    variant_fn = _variant_fn(backend)
    shapes = _every_kv_bounded_shape(backend, kv_dtype)
    assert shapes and all(shape["max_seq_len"] < SERVING["max_context_len"] for shape in shapes)
    compiled = _shape_variants(variant_fn) + [variant for variant, _ in
                                              distinct_variants(variant_fn, _unbounded_shapes(backend, kv_dtype))]
    variants = distinct_variants(variant_fn, shapes, known=compiled)
    assert variants  # a shorter max_seq_len asks for fewer splits: kernels no unbounded capture asks for
    seconds = [variant.compile() for variant, _ in variants]
    record_property("variants", len(variants))
    record_property("compile_seconds", round(sum(seconds), 1))


# ---------------------------------------------------------------------------------------------
# B300 (SM103): what differs from the B200, compiled for sm_103a
# ---------------------------------------------------------------------------------------------
# Both backends declare SM103 (required_sm). Both libraries compile for the device's own arch
# (tokenspeed: --gpu-arch from compute_capability; FlashInfer: arch="sm_103a") and take other
# code paths there (the arch branches of tokenspeed's mla_decode_fp8.py / mla_decode_fp16.py and
# of FlashInfer's monolithic kernels); with the B300's 148 SMs, the B200's count, their split-KV
# heuristics answer as on a B200. One choice changes: tokenspeed's FP8 M64 tile is SM100's only
# (mla_helpers.select_mla_decode_tilers), so on an SM103 an FP8 pass of num_heads * q_len <= 64
# rows (at 16 heads a rank: every draft, verify and draft-extend pass) takes the 2-CTA M128 tile,
# split by another heuristic. Those variants all compile here (on sm_103a's code paths), over
# SHAPES and every serving size (_every_shape: each batch size, prefill chunks, kv-bounded
# captures). The rest are B200 variants but for the arch, which the tests assert over the same
# shapes, and which compile above for sm_100a: of FlashInfer's, one per kernel source compiles
# again for sm_103a; tokenspeed's (its prefill chunks; the BF16 kernel, which the backend does not
# run) are not compiled again.


def _every_shape(backend: str, kv_dtype: str) -> list[dict]:
    """SHAPES and every serving size the family's passes ask for: the longest context's at every
    batch size with the prefill chunks (_unbounded_shapes), and the kv-bounded captures
    (_every_kv_bounded_shape; under planned_as_on_a_b200). All their B200 variants compile above."""
    return SHAPE_KWARGS + _unbounded_shapes(backend, kv_dtype) + _every_kv_bounded_shape(backend, kv_dtype)


def _tokenspeed_tiles(variant: KernelVariant) -> tuple:
    """The MMA tiles tokenspeed's compile function picks for ``variant``: ((qk M, N), (pv M, N))."""
    from tokenspeed_mla.mla_helpers import select_mla_decode_tilers

    kw = variant.kwargs
    return select_mla_decode_tilers(kw["num_heads"], kw["seq_len_q"], is_fp8=kw["torch_dtype"] == FP8,
                                    compute_capability=kw["compute_capability"])


def _b200_and_b300(variant_fn, shape: dict) -> tuple[KernelVariant, KernelVariant]:
    return variant_fn(**shape, device=B200), variant_fn(**shape, device=B300)


def _on_another_tile(b200: KernelVariant, b300: KernelVariant) -> bool:
    return _tokenspeed_tiles(b200) != _tokenspeed_tiles(b300)


@pytest.mark.usefixtures("planned_as_on_a_b200")
def test_b300_tokenspeed_takes_another_tile_only_for_fp8_passes_of_64_rows_or_fewer() -> None:
    """Over the shapes and every serving size (_every_shape): another tile exactly where an FP8 pass
    has num_heads * q_len <= 64; elsewhere the B300's variant is the B200's but for the capability."""
    _need_tokenspeed()
    shapes = _every_shape("tokenspeed_mla", "fp8_e4m3")
    other_tile = []
    for shape in shapes:
        b200, b300 = _b200_and_b300(tokenspeed_decode_variant, shape)
        if _on_another_tile(b200, b300):
            other_tile.append(shape)
        else:
            assert dict(b300.kwargs) == {**b200.kwargs, "compute_capability": (10, 3)}
    assert other_tile == [s for s in shapes if s["kv_dtype"] == FP8 and s["num_heads"] * s["q_len"] <= 64]


@pytest.mark.usefixtures("planned_as_on_a_b200")
def test_b300_cutedsl_variants_are_the_b200s_but_for_the_arch() -> None:
    """Over the shapes and every serving size (_every_shape): the tiles and split-KV follow the SM
    count, not the arch."""
    _need_flashinfer()
    for shape in _every_shape("cutedsl_mla", "bf16"):
        b200, b300 = _b200_and_b300(cutedsl_decode_variant, shape)
        assert dict(b300.kwargs) == {**b200.kwargs, "arch": "sm_103a"}


@pytest.mark.usefixtures("planned_as_on_a_b200")
def test_every_b300_tokenspeed_variant_on_another_tile_compiles(record_property) -> None:
    """The distinct variants of the shapes and every serving size (_every_shape) a B300 runs on the
    M128 tile where a B200 runs the M64 one, compiled for sm_103a."""
    _need_tokenspeed()
    shapes = [shape for shape in _every_shape("tokenspeed_mla", "fp8_e4m3")
              if _on_another_tile(*_b200_and_b300(tokenspeed_decode_variant, shape))]
    variants = distinct_variants(functools.partial(tokenspeed_decode_variant, device=B300), shapes)
    assert {(v.kwargs["compute_capability"], _tokenspeed_tiles(v)[0]) for v, _ in variants} == {((10, 3), (128, 128))}
    seconds = [variant.compile() for variant, _ in variants]
    record_property("variants", len(variants))
    record_property("compile_seconds", round(sum(seconds), 1))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda dt: str(dt).removeprefix("torch."))
def test_b300_cutedsl_decode_compiles(kv_dtype, record_property) -> None:
    """One split-KV variant per kernel source (monolithic mla_decode_fp16.py / mla_decode_fp8.py)
    for sm_103a: the serving verify pass, 16 heads x q_len 4, at batch 1."""
    _need_flashinfer()
    variant = cutedsl_decode_variant(SERVING_HEADS, 4, PAGE_SIZE, kv_dtype, device=B300)
    assert variant.kwargs["arch"] == "sm_103a" and not variant.kwargs["is_workspace_size_zero"]
    record_property("compile_seconds", round(variant.compile(), 2))


@pytest.mark.parametrize("backend", ["tokenspeed_mla", "cutedsl_mla"])
def test_a_device_outside_the_sm100_family_is_refused(backend) -> None:
    """The device reaches the libraries' own checks: an H100 (SM90) is refused by both."""
    h100 = dataclasses.replace(B200, name="NVIDIA H100", major=9, minor=0, multi_processor_count=132)
    with pytest.raises(KernelUnsupportedError, match="SM100"):
        _variant_fn(backend)(SERVING_HEADS, 4, PAGE_SIZE, FP8, device=h100)


@pytest.mark.parametrize("device, arch", [(B200, "sm_100a"), (B300, "sm_103a")], ids=["B200", "B300"])
def test_fake_b200_pins_the_cute_dsl_default_arch(device, arch) -> None:
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from cutlass.cutlass_dsl import BaseDSL

    dsl = BaseDSL._get_dsl()
    before = dsl.envar.arch
    with fake_b200(device):
        assert str(dsl.get_arch_enum()) == arch
        assert torch.cuda.get_device_capability() == (device.major, device.minor)
        assert torch.cuda.get_device_properties(0).multi_processor_count == 148
    assert dsl.envar.arch == before
