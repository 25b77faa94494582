"""Hopper backends against the torch reference, and the full worker on them (GPU only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attn.base import ForwardMode, LayerSpec
from attn.registry import get_backend_class
from specdec.baseline import greedy_generate
from specdec.batch import extend_batch, uniform_batch
from specdec.config import ConfigError, SpecConfig
from specdec.kv import MLAKVPool
from specdec.worker import EagleWorker
from spec_helpers import VOCAB, kernel_errors, make_models, needs_library, prompts, reference, run_to_completion

pytestmark = pytest.mark.gpu
ATOL = 2e-2  # bf16 cache and queries, fp32 accumulation


def filled_pool(page_size=64, lens=(37, 300, 1000), dtype=torch.bfloat16, kv_scale=1.0, spread=0.5):
    """A pool of ``dtype`` (dequantised by kv_scale) holding requests of ``lens`` tokens, its pages
    filled with normal values times ``spread``."""
    context = page_size * (max(lens) // page_size + 2)
    pool = MLAKVPool(1, sum(n // page_size + 1 for n in lens) + 2, page_size, len(lens), context, dtype, "cuda",
                     kv_scale=kv_scale)
    rows = [pool.alloc_request() for _ in lens]
    for row, n in zip(rows, lens):
        pool.ensure_capacity(row, n)
    pool.kv_buffers[0].copy_((torch.randn(pool.kv_buffers[0].shape, device="cuda") * spread).to(dtype))
    return pool, rows, list(lens)


def compare(backend_name, batch_fn, heads=16, page_size=64, dtype=torch.bfloat16, kv_scale=1.0, spread=0.5,
            atol=ATOL, rtol=0.0, q_dtype=torch.bfloat16):
    """One forward of ``backend_name`` against torch_ref's over the same pool and inputs (the new
    tokens' kv at the pool's scale; queries of values ``q_dtype`` holds, in bf16)."""
    needs_library(backend_name)
    pool, rows, lens = filled_pool(page_size, dtype=dtype, kv_scale=kv_scale, spread=spread)
    spec = LayerSpec(num_heads=heads, sm_scale=192**-0.5)
    batch = batch_fn(pool, rows, lens)
    q = torch.randn(batch.num_tokens, heads, 576, device="cuda").to(q_dtype).to(torch.bfloat16)
    kv_new = torch.randn(batch.num_tokens, 576, device="cuda", dtype=torch.bfloat16) * kv_scale
    outs = []
    for name in ("torch_ref", backend_name):
        backend = get_backend_class(name)(pool.view(), spec, 4, 8)
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q, kv_new, 0, batch).float())
    torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=rtol)


def _uniform(mode, q_len):
    def make(pool, rows, lens):
        rows_t = torch.tensor(rows, device="cuda")
        start = torch.tensor(lens, device="cuda") - q_len
        return uniform_batch(mode, pool.req_to_token, rows_t, start, q_len)[0]
    return make


def _extend(pool, rows, lens):
    q_lens = [5, 40, 1]
    return extend_batch(pool.req_to_token, rows, [n - q for n, q in zip(lens, q_lens)], q_lens)


@pytest.mark.parametrize("backend", ["flashinfer_mla", "triton_mla", "flashmla"])
@pytest.mark.parametrize("mode,batch_fn", [
    ("decode", _uniform(ForwardMode.DECODE, 1)),
    ("verify", _uniform(ForwardMode.TARGET_VERIFY, 4)),
    ("draft_extend", _uniform(ForwardMode.DRAFT_EXTEND, 4)),
    ("prefill", _extend),
])
def test_matches_torch_ref(backend, mode, batch_fn):
    if backend == "flashmla" and mode == "prefill":
        pytest.skip("flashmla has no prefill kernel (triton_mla serves it)")
    compare(backend, batch_fn)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("q_len", [1, 2, 4])
def test_flashmla_matches_torch_ref_at_head_counts(heads, q_len):
    """FlashMLA's dense decode at a TP8 rank's 16 heads and DeepSeek's 128, decode and verify chains."""
    compare("flashmla", _uniform(ForwardMode.TARGET_VERIFY, q_len), heads=heads)


def _strided_metadata(pool, rows, lens):
    """A verify pass whose seq_lens and cu_seqlens_q are strided views (columns of wider tables)."""
    batch = _uniform(ForwardMode.TARGET_VERIFY, 4)(pool, rows, lens)
    seq_lens = torch.stack([batch.seq_lens, batch.seq_lens], dim=1)[:, 0]
    cu_seqlens_q = torch.stack([batch.cu_seqlens_q, batch.cu_seqlens_q], dim=1)[:, 1]
    return dataclasses.replace(batch, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q)


@pytest.mark.parametrize("backend", ["flashinfer_mla", "triton_mla"])
def test_strided_metadata_is_taken(backend):
    """Strided seq_lens and cu_seqlens_q (columns of wider tables) attend as torch_ref does: the
    metadata takes contiguous copies, which the kernels' checks require."""
    compare(backend, _strided_metadata)


@pytest.mark.parametrize("backend", ["flashinfer_mla", "triton_mla"])
@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_pages_smaller_than_the_verify_block(backend, page_size):
    """A verify of 4 tokens over pages of fewer rows (q_len > page_size: a verify block spans
    pages) attends as torch_ref does."""
    compare(backend, _uniform(ForwardMode.TARGET_VERIFY, 4), page_size=page_size)


def test_flashinfer_schedule_compiles_once_per_power_of_two_of_requests(monkeypatch):
    """Eager passes change batch size as requests finish: the device schedule's kernel compiles at
    most once for batch sizes 9-16 (the batch size is no compile-time constant)."""
    from triton import knobs

    compiled = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda fn, **kw: compiled.append(fn.name) and None)
    pool, rows, lens = filled_pool(lens=(300,) * 16)
    backend = get_backend_class("flashinfer_mla")(pool.view(), LayerSpec(num_heads=16, sm_scale=192**-0.5), 16, 1)
    for bs in range(9, 17):  # one power of two of lanes, 16 among them (Triton specialises multiples of 16)
        backend.init_forward_metadata(_uniform(ForwardMode.DECODE, 1)(pool, rows[:bs], lens[:bs]))
    assert compiled.count("_schedule_kernel") <= 1


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("lens", [(37, 300, 1000), (16000, 5), tuple(range(70, 64 * 330, 330))])
def test_flashinfer_device_schedule_equals_its_host_plan(heads, q_len, lens):
    """The schedule built on the device (attn.kernels.fa3_plan) gives FlashInfer's kernel the same
    result, bitwise, as FlashInfer's own host plan: short, split (16k) and 64-request batches."""
    from flashinfer.mla import MLAPlanMetadata

    pool, rows, lens = filled_pool(lens=lens)
    backend = get_backend_class("flashinfer_mla")(pool.view(), LayerSpec(num_heads=heads, sm_scale=192**-0.5), len(lens), q_len)
    batch = _uniform(ForwardMode.TARGET_VERIFY, q_len)(pool, rows, lens)
    q = torch.randn(batch.num_tokens, heads, 576, device="cuda", dtype=torch.bfloat16)
    cache = pool.kv_buffers[0]
    backend.init_forward_metadata(batch)
    device_planned = backend._run(q, cache)
    md = backend.metadata
    backend._plan(backend.wrapper, MLAPlanMetadata.dense(md.cu_seqlens_q, md.block_tables, md.seq_lens, q_len))
    host_planned = backend.wrapper.run(query=q, kv_cache=cache)
    assert torch.equal(device_planned, host_planned)


@pytest.mark.parametrize("backend,topk,ndt", [("flashinfer_mla", 1, None), ("triton_mla", 1, None), ("triton_mla", 2, 6),
                                             ("triton_mla", 3, 8), ("flashmla", 1, None)])
def test_worker_lossless(backend, topk, ndt):
    needs_library(backend)
    target, mtp = make_models("cuda", torch.float32)
    page_size = 64 if backend == "flashmla" else 16
    cfg = SpecConfig(num_steps=3, topk=topk, num_draft_tokens=ndt, attention_backend=backend, kv_dtype="bf16",
                     page_size=page_size, max_batch_size=5, max_context_len=256)
    worker = EagleWorker(target, mtp, cfg)
    backends = [worker.verify_backend, worker.draft_extend_backend, worker.target_prefill_backend,
                *worker.draft_backend.steps]
    if backend == "flashinfer_mla":  # one float workspace for all (passes run in stream order)
        assert len({b.workspace.data_ptr() for b in backends}) == 1
    groups = [(prompts(3, seed=4), 24), (prompts(2, seed=5), 16)]
    outputs, _ = run_to_completion(worker, groups)
    assert outputs == reference(target, groups, backend=backend, kv_dtype=torch.bfloat16, page_size=page_size)


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("kv_scale", [0.25, 4.0])
@pytest.mark.parametrize("backend", ["triton_mla", "flashmla"])
def test_over_a_scaled_fp8_pool_matches_torch_ref(backend, q_len, kv_scale):
    """Verify passes over an fp8_e4m3 pool with a kv_scale against torch_ref. flashmla's dense fp8
    kernel takes fp8 queries (here they hold fp8 values, so its cast loses nothing) and, its wgmma
    taking fp8 on both sides, rounds the softmax weights to fp8 for the second product: 6e-2, not
    triton_mla's 2e-2 relative (which widens the cache to 16 bits), and 0.25 x kv_scale absolute, 1%
    of the largest output (~25 x kv_scale)."""
    fp8_q = backend == "flashmla"
    atol, rtol = (2.5e-1, 6e-2) if fp8_q else (2e-2, 2e-2)
    compare(backend, _uniform(ForwardMode.TARGET_VERIFY, q_len), dtype=torch.float8_e4m3fn, kv_scale=kv_scale,
            spread=2.0, atol=atol * max(kv_scale, 1.0), rtol=rtol,
            q_dtype=torch.float8_e4m3fn if fp8_q else torch.bfloat16)


@pytest.mark.parametrize("kv_scale", [1.0, 0.25])
@pytest.mark.parametrize("backend", ["triton_mla", "flashmla"])
def test_worker_lossless_over_an_fp8_cache(backend, kv_scale):
    """Over an fp8_e4m3 cache with a per-tensor scale the greedy outputs are the target-only ones
    over the same cache and backend."""
    needs_library(backend)
    target, mtp = make_models("cuda", torch.float32)
    page_size = 64 if backend == "flashmla" else 16
    cfg = SpecConfig(num_steps=3, attention_backend=backend, kv_dtype="fp8_e4m3", kv_scale=kv_scale,
                     page_size=page_size, max_batch_size=5, max_context_len=256)
    groups = [(prompts(3, seed=4), 24), (prompts(2, seed=5), 16)]
    outputs, _ = run_to_completion(EagleWorker(target, mtp, cfg), groups)
    assert outputs == reference(target, groups, backend=backend, kv_dtype=torch.float8_e4m3fn, kv_scale=kv_scale,
                                page_size=page_size)


@pytest.mark.parametrize("backend", ["trtllm_mla", "cutedsl_mla", "tokenspeed_mla"])
def test_blackwell_backends_refused_on_hopper(backend):
    if torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("this is a Blackwell GPU")
    target, mtp = make_models("cuda", torch.bfloat16)
    cfg = SpecConfig(attention_backend=backend, kv_dtype="fp8_e4m3", page_size=64)
    with pytest.raises(ConfigError, match=f"{backend} .*needs a SM10\\S* GPU.*set attention_backend to one that runs here: \\['flashinfer_mla', 'flashmla', 'flashmla_sparse', 'torch_ref', 'triton_mla'\\]"):
        EagleWorker(target, mtp, cfg)


def test_flashinfer_prefills_a_prompt_past_its_plan_capacity(monkeypatch):
    """FlashInfer's prefill plan holds 16384 work items: at 128 heads a query tile per token, and
    split kv adds more. A 16385-token prompt and 127 of 129 tokens prefill in passes of
    max_prefill_tokens (the second holds the long prompt's last token after its 16k cached ones,
    which FlashInfer splits) and decode losslessly, in the worker and target-only alike; every
    kernel call's last 16 rows a request, which see all of its kv, within 2% of the plain-torch
    attention (both sides could otherwise share a kernel's error)."""
    errors = kernel_errors(monkeypatch, "flashinfer_mla", tail_rows=16)
    target, mtp = make_models("cuda", torch.float32, num_attention_heads=128, max_position_embeddings=32768)
    g = torch.Generator().manual_seed(6)
    group = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in [16385] + [129] * 127]
    cfg = SpecConfig(num_steps=3, attention_backend="flashinfer_mla", kv_dtype="bf16", page_size=64,
                     max_batch_size=128, max_context_len=16448, num_pages=1024)
    worker = EagleWorker(target, mtp, cfg)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    assert worker.target_prefill_backend.max_prefill_tokens == 16384 - 128 - sm
    outputs, _ = run_to_completion(worker, [(group, 4)])
    assert outputs == greedy_generate(target, group, 4, backend="flashinfer_mla", page_size=64, kv_dtype=torch.bfloat16)
    assert errors and max(errors) < 0.02, (len(errors), max(errors, default=None))
