"""The Blackwell backends' metadata path, end to end in the worker, on CPU.

Only the kernel call (``_run_decode_kernel``) is swapped for the torch reference with the same
contract; block tables, seq_lens, q_len, workspaces, scales and the fallbacks are the real ones.
"""

from __future__ import annotations

import pytest
import torch

from attn.backends.blackwell.cutedsl_mla import CuteDslMLABackend
from attn.backends.blackwell.tokenspeed_mla import TokenspeedMLABackend, tokenspeed_workspace_bytes
from attn.backends.blackwell.trtllm_mla import TrtllmMLABackend
from attn.backends.torch_ref import TorchRefBackend
from attn.base import KV_DTYPES, AttnBatch, ForwardMode, LayerSpec
from attn.paged import PagedMLABackend, RaggedKernelBackend
from specdec.baseline import greedy_generate
from specdec.config import ConfigError, SpecConfig
from specdec.kv import MLAKVPool
from specdec.worker import EagleWorker
from spec_helpers import documented_decode, make_models, prompts, reference, run_to_completion

BLACKWELL = (TrtllmMLABackend, CuteDslMLABackend, TokenspeedMLABackend)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Replace each Blackwell kernel call by the reference; record (backend, q_len) per call."""
    calls: list[tuple[str, int]] = []

    def reference_kernel(self: PagedMLABackend, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask):
        bs, q_len, heads, dim = query.shape
        assert dim == 576 and heads == self.layer.num_heads and custom_mask is None
        assert kv_cache.shape[1:] == (self.page_size, 576) and self.page_size in (32, 64)
        assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
        assert block_tables.shape == (bs, self.max_pages) and seq_lens.shape == (bs,)
        assert max_seq_len == self.max_pages * self.page_size
        if self.name == "cutedsl_mla":  # FlashInfer's cute-dsl path: tables of whole 128-token blocks
            assert block_tables.shape[1] % (128 // self.page_size) == 0
        calls.append((self.name, q_len))
        return RaggedKernelBackend._run_decode_kernel(self, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask)

    for cls in BLACKWELL:
        monkeypatch.setattr(cls, "_run_decode_kernel", reference_kernel)
        monkeypatch.setattr(cls, "_run_ragged_kernel", TorchRefBackend._run_ragged_kernel, raising=False)
        monkeypatch.setattr(cls, "required_sm", None)
    return calls


@pytest.mark.parametrize(
    "backend,kv_dtype,expected",
    [
        ("trtllm_mla", "bf16", {"verify": "trtllm_mla", "draft": "trtllm_mla", "extend": "trtllm_mla"}),
        ("cutedsl_mla", "bf16", {"verify": "cutedsl_mla", "draft": "cutedsl_mla", "extend": "trtllm_mla"}),
        ("cutedsl_mla", "fp8_e4m3", {"verify": "cutedsl_mla", "draft": "cutedsl_mla", "extend": "trtllm_mla"}),
        ("tokenspeed_mla", "fp8_e4m3", {"verify": "tokenspeed_mla", "draft": "tokenspeed_mla", "extend": "tokenspeed_mla"}),
    ],
)
def test_worker_lossless_through_the_seam(target, mtp, kernel_calls, backend, kv_dtype, expected):
    """Every pass goes through the expected family's kernel seam, at every batch size the run
    passes through, and the outputs equal target-only decoding on torch_ref; no backend plans on
    the host before a replay."""
    num_steps = 3
    cfg = SpecConfig(num_steps=num_steps, attention_backend=backend, kv_dtype=kv_dtype, page_size=64, max_batch_size=4, max_context_len=256)
    worker = EagleWorker(target, mtp, cfg)
    assert not any(b.needs_cpu_seq_lens for b in (worker.verify_backend, worker.draft_extend_backend,
                                                    *worker.draft_backend.steps))
    groups = [(prompts(3, seed=21), 9), (prompts(1, seed=22), 6)]
    outputs, _ = run_to_completion(worker, groups)
    assert outputs == reference(target, groups, page_size=64, kv_dtype=KV_DTYPES[kv_dtype])
    # Which family served which pass: q_len 1 = draft steps, num_steps + 1 = verify and draft-extend.
    by_q = {}
    for name, q_len in kernel_calls:
        by_q.setdefault(q_len, set()).add(name)
    assert by_q[1] == {expected["draft"]}
    assert by_q[num_steps + 1] == {expected["verify"], expected["extend"]}
    assert worker.draft_backend.steps and all(b.name == expected["draft"] for b in worker.draft_backend.steps)
    assert worker.draft_extend_backend.name == expected["extend"]


def test_workspaces_are_isolated_and_trtllm_gen_is_zeroed(target, mtp, kernel_calls):
    cfg = SpecConfig(num_steps=2, attention_backend="cutedsl_mla", kv_dtype="bf16", page_size=64, max_batch_size=2, max_context_len=128)
    worker = EagleWorker(target, mtp, cfg)
    cute = worker.verify_backend.workspace
    trt = worker.draft_extend_backend.workspace
    assert worker.verify_backend.kernel_family == "cute_dsl" and worker.draft_extend_backend.kernel_family == "trtllm_gen"
    assert cute.data_ptr() != trt.data_ptr()
    assert cute.data_ptr() + cute.numel() <= trt.data_ptr() or trt.data_ptr() + trt.numel() <= cute.data_ptr()
    assert not trt.any()
    # every trtllm-gen user shares the one zeroed buffer
    assert worker.target_prefill_backend.workspace.data_ptr() == trt.data_ptr()
    assert all(b.workspace.data_ptr() == cute.data_ptr() for b in worker.draft_backend.steps)


def test_worker_build_refuses_what_the_kernels_would(mtp, kernel_calls):
    """Settings the library would refuse at the first pass are refused when the worker is built,
    naming the setting: an fp32 model's kv_dtype='auto', trtllm-gen's head counts 65-127 (which
    cute-dsl takes) and more than 128 heads."""
    fp32_target, _ = make_models()
    with pytest.raises(ConfigError, match="kv_dtype='auto' is the model's dtype, fp32"):
        EagleWorker(fp32_target, mtp, SpecConfig(attention_backend="cutedsl_mla", page_size=64, max_context_len=128))
    target96, mtp96 = make_models(num_attention_heads=96)
    with pytest.raises(ConfigError, match="trtllm_mla takes up to 128 query heads, except 65-127, not 96"):
        EagleWorker(target96, mtp96, SpecConfig(attention_backend="trtllm_mla", kv_dtype="bf16", page_size=64,
                                                max_context_len=128))
    EagleWorker(target96, mtp96, SpecConfig(attention_backend="cutedsl_mla", prefill_backend="torch_ref",
                                            kv_dtype="bf16", page_size=64, max_context_len=128))
    target192, mtp192 = make_models(num_attention_heads=192)
    for backend, kv_dtype in (("cutedsl_mla", "bf16"), ("tokenspeed_mla", "fp8_e4m3")):
        with pytest.raises(ConfigError, match=f"{backend} takes up to 128 query heads, not 192"):
            EagleWorker(target192, mtp192, SpecConfig(attention_backend=backend, prefill_backend="torch_ref",
                                                      kv_dtype=kv_dtype, page_size=64, max_context_len=128))


def test_tokenspeed_workspace_sized_from_sms_and_heads(target, mtp, kernel_calls):
    cfg = SpecConfig(num_steps=2, attention_backend="tokenspeed_mla", kv_dtype="fp8_e4m3", page_size=64, max_batch_size=2, max_context_len=128)
    worker = EagleWorker(target, mtp, cfg)
    heads = target.attn_spec().num_heads
    assert worker.verify_backend.workspace.numel() >= tokenspeed_workspace_bytes(148, heads) == 148 * heads * 8 * 513 * 4


def test_fp8_scales(target, kernel_calls):
    pool = MLAKVPool(1, 4, 64, 1, 128, torch.float8_e4m3fn, kv_scale=0.5)
    backend = TrtllmMLABackend(pool.view(), LayerSpec(num_heads=4, sm_scale=0.125), 1, 4)
    assert backend.bmm1_scale() == 0.5 * 0.125 and backend.bmm2_scale() == 0.5
    bf16 = MLAKVPool(1, 4, 64, 1, 128, torch.bfloat16, kv_scale=0.5)
    assert TrtllmMLABackend(bf16.view(), LayerSpec(4, 0.125), 1, 4).bmm1_scale() == 0.125


@pytest.mark.parametrize("cls", [TrtllmMLABackend, CuteDslMLABackend])
def test_flashinfer_call_binds_to_the_installed_signature(monkeypatch, cls):
    """The real _run_decode_kernel against FlashInfer's own signature (the kernel swapped for a
    stub that binds the arguments): trtllm-gen gets its zeroed multi-CTA counter buffer, sized by
    FlashInfer's rule and the same every call; cute-dsl, which takes none, gets None."""
    import inspect

    pytest.importorskip("flashinfer")
    import flashinfer.mla
    from flashinfer.utils import get_trtllm_gen_multi_ctas_kv_counter_bytes

    real = flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla
    calls = []

    def stub(*args, **kwargs):
        calls.append(inspect.signature(real).bind(*args, **kwargs).arguments)
        query = kwargs["query"]
        return torch.zeros(*query.shape[:3], 512, dtype=torch.bfloat16)

    monkeypatch.setattr(flashinfer.mla, "trtllm_batch_decode_with_kv_cache_mla", stub)
    pool = MLAKVPool(1, 9, 64, 2, 256, torch.bfloat16)
    backend = cls(pool.view(), LayerSpec(num_heads=16, sm_scale=0.1), 2, 4)
    args = (torch.zeros(2, 4, 16, 576, dtype=torch.bfloat16), pool.kv_buffers[0], torch.ones(2, 4, dtype=torch.int32),
            torch.full((2,), 70, dtype=torch.int32), 256, None)
    for _ in range(2):
        assert backend._run_decode_kernel(*args).shape == (2, 4, 16, 512)
    counters = [call.get("multi_ctas_kv_counter_buffer") for call in calls]
    if cls.multi_cta_counters:
        assert counters[0] is counters[1] and not counters[0].any()
        assert counters[0].numel() == get_trtllm_gen_multi_ctas_kv_counter_bytes(2, 16, 148)
    else:
        assert counters == [None, None]


@pytest.mark.parametrize("cls,kv_dtype", [(TrtllmMLABackend, torch.bfloat16), (TrtllmMLABackend, torch.float8_e4m3fn),
                                          (CuteDslMLABackend, torch.float8_e4m3fn),
                                          (TokenspeedMLABackend, torch.float8_e4m3fn)])
def test_library_call_attends_as_the_library_documents(monkeypatch, cls, kv_dtype):
    """The real _run_decode_kernel with the library's entry point replaced by its documented
    semantics (arguments bound by name to the installed signature): a swapped, dropped or wrong
    scale, dtype, layout or length shows as a wrong attention. Expected: plain attention over the
    dequantised cache (kv_scale 0.5 for fp8) with the layer's softmax scale, for the query in the
    cache's dtype (what the kernels take, q_scale 1), causal within the verify block."""
    import inspect

    if cls is TokenspeedMLABackend:
        module = pytest.importorskip("tokenspeed_mla")
        entry, scales = "tokenspeed_mla_decode", ("softmax_scale", "output_scale")
    else:
        pytest.importorskip("flashinfer")
        import flashinfer.mla as module
        entry, scales = "trtllm_batch_decode_with_kv_cache_mla", ("bmm1_scale", "bmm2_scale")
    signature = inspect.signature(getattr(module, entry))

    def library(*args, **kwargs):
        arg = signature.bind(*args, **kwargs).arguments
        return documented_decode(arg["query"], arg["kv_cache"], arg["block_tables"], arg["seq_lens"],
                                 arg[scales[0]], arg.get(scales[1], 1.0))

    monkeypatch.setattr(module, entry, library)
    g = torch.Generator().manual_seed(5)
    kv_scale = 0.5 if kv_dtype == torch.float8_e4m3fn else 1.0
    pool = MLAKVPool(1, 9, 64, 2, 256, kv_dtype, kv_scale=kv_scale)
    pool.kv_buffers[0].copy_(torch.randn(pool.kv_buffers[0].shape, generator=g).to(kv_dtype))
    backend = cls(pool.view(), LayerSpec(num_heads=16, sm_scale=0.1), 2, 4)
    tables = torch.tensor([[3, 1, 7, 0], [5, 2, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([200, 70], dtype=torch.int32)
    query = torch.randn(2, 4, 16, 576, generator=g, dtype=torch.bfloat16)
    out = backend._run_decode_kernel(query, pool.kv_buffers[0], tables, seq_lens, 256, None)

    expected = documented_decode(query.to(kv_dtype).float(), pool.kv_buffers[0].float() * kv_scale, tables, seq_lens,
                                 0.1, 1.0)
    assert out.dtype == query.dtype and out.shape == (2, 4, 16, 512)
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("cls,dtype", [(TrtllmMLABackend, torch.bfloat16), (TokenspeedMLABackend, torch.float8_e4m3fn)])
def test_uniform_prefill_longer_than_the_decode_kernel_takes_goes_in_chunks(kernel_calls, cls, dtype):
    """A prefill (EXTEND) pass of uniform query lengths (one request's prompt is one) longer than the
    decode kernel's max_decode_q_len runs the paged prefill's chunks, as a ragged one does, and
    attends as the reference does; a verify pass of that length is refused before the cache write."""

    pool = MLAKVPool(1, 4, 32, 2, 64, dtype)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 20)
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(20, 16, 576, generator=g), torch.randn(20, 576, generator=g)
    loc = pool.req_to_token[row, :20].long()
    outs = []
    for backend_cls, uniform in ((TorchRefBackend, False), (cls, True)):
        batch = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([20], dtype=torch.int32), loc,
                          torch.tensor([0, 20], dtype=torch.int32), 20, uniform)
        backend = backend_cls(pool.view(), LayerSpec(16, 0.1), 2, 4)
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q, kv, 0, batch))
    assert {n for _, n in kernel_calls} == {cls.max_decode_q_len} and len(kernel_calls) == 3
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    verify = AttnBatch(ForwardMode.TARGET_VERIFY, torch.tensor([row]), torch.tensor([20], dtype=torch.int32), loc,
                       torch.tensor([0, 20], dtype=torch.int32), 20, True)
    backend.init_forward_metadata(verify)
    cache = pool.kv_buffers[0].clone()
    with pytest.raises(ValueError, match=f"takes at most {cls.max_decode_q_len} query tokens a request, this "
                                         "target_verify pass has 20"):
        backend.forward(q, kv * 2, 0, verify)
    assert torch.equal(pool.kv_buffers[0].view(torch.uint8), cache.view(torch.uint8))


def test_cutedsl_refuses_prefill_naming_its_fallback(kernel_calls):
    pool = MLAKVPool(1, 4, 64, 2, 128, torch.bfloat16)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 4)
    backend = CuteDslMLABackend(pool.view(), LayerSpec(16, 0.1), 2, 4)
    for uniform in (False, True):
        batch = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([4], dtype=torch.int32),
                          pool.req_to_token[row, :4].long(), torch.tensor([0, 4], dtype=torch.int32), 4, uniform)
        backend.init_forward_metadata(batch)
        with pytest.raises(ValueError, match="cutedsl_mla runs no extend pass; trtllm_mla serves it"):
            backend.forward(torch.randn(4, 16, 576), torch.randn(4, 576), 0, batch)
    assert kernel_calls == [] and not pool.kv_buffers[0].any()


@pytest.mark.parametrize("backend", ["cutedsl_mla", "trtllm_mla", "tokenspeed_mla"])
def test_target_only_decoding_through_the_seam(target, kernel_calls, backend):
    """The baseline decoder sizes its block tables as each backend needs and decodes what torch_ref
    does: with pages of 64 and prompts that fit one page, cutedsl_mla still gets tables of whole
    128-token blocks, which FlashInfer's cute-dsl path requires."""
    kv_dtype = KV_DTYPES["fp8_e4m3" if backend == "tokenspeed_mla" else "bf16"]
    group = prompts(2, seed=31)
    assert max(map(len, group)) + 8 < 64
    out = greedy_generate(target, group, 8, backend=backend, page_size=64, kv_dtype=kv_dtype)
    assert out == greedy_generate(target, group, 8, page_size=64, kv_dtype=kv_dtype)
    assert backend in {name for name, _ in kernel_calls}  # (cutedsl_mla's prefill: trtllm_mla)


def test_a_table_width_the_kernel_refuses_is_refused_at_construction():
    pool = MLAKVPool(1, num_pages=4, page_size=64, max_requests=1, max_context_len=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cutedsl_mla needs block tables spanning a multiple of 128 tokens, not 64.*"
                                         "raise max_context_len to 128"):
        CuteDslMLABackend(pool.view(), LayerSpec(num_heads=16, sm_scale=0.1), max_batch_size=1, max_q_len=1)


@pytest.mark.parametrize("cls", BLACKWELL)
def test_built_directly_a_backend_refuses_pages_its_kernel_refuses(cls):
    """The registry swaps in pages of 64 with a warning; built directly, a backend refuses a page size
    its kernel does not take at construction, naming the sizes it takes, so no pass writes the cache
    first."""
    pool = MLAKVPool(1, 16, 16, 1, 128, torch.bfloat16)
    with pytest.raises(ValueError, match=rf"{cls.name} takes pages of \[32, 64\] tokens, not 16"):
        cls(pool.view(), LayerSpec(num_heads=16, sm_scale=0.1), max_batch_size=2, max_q_len=1)


def documented_sparse_decode(query, kv_cache, block_tables, seq_lens, qk_scale, out_scale):
    """FlashInfer's sparse trtllm-gen MLA decode as documented: query ``[T, 1, H, 576]``, kv
    ``[pages, 1, page_size, 576]`` in one dtype, block_tables ``[T, 1, K]`` cache slots, token t
    attending to its first seq_lens[t] slots; ``[T, 1, H, 512]`` bf16."""
    assert query.dtype == kv_cache.dtype and query.shape[1] == 1 and block_tables.shape[1] == 1
    rows = kv_cache.reshape(-1, 576).float()
    out = torch.empty(*query.shape[:3], 512)
    for t in range(query.shape[0]):
        seen = rows[block_tables[t, 0, :int(seq_lens[t])].long()]
        weights = torch.softmax(qk_scale * query[t, 0].float() @ seen.T, dim=-1)
        out[t, 0] = out_scale * weights @ seen[:, :512]
    return out.to(torch.bfloat16)


@pytest.fixture
def sparse_library(monkeypatch):
    """FlashInfer's trtllm-gen entry point replaced by its documented sparse semantics (arguments
    bound by name to the installed signature); every call's (K, heads) recorded."""
    import inspect

    pytest.importorskip("flashinfer")
    import flashinfer.mla

    signature = inspect.signature(flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla)
    calls = []

    def library(*args, **kwargs):
        arg = signature.bind(*args, **kwargs).arguments
        table = arg["block_tables"]
        assert arg["sparse_mla_top_k"] == table.shape[-1] == arg["max_seq_len"] and table.shape[-1] % 4 == 0
        assert table.dtype == arg["seq_lens"].dtype == torch.int32 and (arg["seq_lens"] >= 1).all()
        assert (table[:, 0, :][torch.arange(table.shape[-1]) < arg["seq_lens"][:, None]] >= 0).all()
        if arg["kv_cache"].dtype == torch.float8_e4m3fn:
            assert arg["query"].shape[2] in (64, 128)
        calls.append((table.shape[-1], arg["query"].shape[2]))
        return documented_sparse_decode(arg["query"], arg["kv_cache"], table, arg["seq_lens"], arg["bmm1_scale"],
                                        arg.get("bmm2_scale", 1.0))

    monkeypatch.setattr(flashinfer.mla, "trtllm_batch_decode_with_kv_cache_mla", library)
    monkeypatch.setattr(TrtllmMLABackend, "required_sm", None)
    monkeypatch.setattr(TrtllmMLABackend, "_run_index_kernel", TorchRefBackend._run_index_kernel)
    return calls


@pytest.mark.parametrize("kv_dtype,kv_scale", [(torch.bfloat16, 1.0), (torch.float8_e4m3fn, 0.5)])
def test_sparse_call_attends_as_the_library_documents(sparse_library, kv_dtype, kv_scale):
    """The real _run_sparse_kernel against the documented call: each token attends to exactly its
    selected rows (6 slots padded to 8, some -1, one token with none, which gets 0) as
    sparse_mla_reference does; an fp8 cache's 16 heads go to the kernel padded to 64."""
    from attn.backends.torch_ref import sparse_mla_reference

    g = torch.Generator().manual_seed(7)
    pool = MLAKVPool(1, 9, 64, 2, 256, kv_dtype, kv_scale=kv_scale)
    pool.kv_buffers[0].copy_(torch.randn(pool.kv_buffers[0].shape, generator=g).to(kv_dtype))
    backend = TrtllmMLABackend(pool.view(), LayerSpec(num_heads=16, sm_scale=0.1), 2, 4)
    slots = torch.randint(0, 9 * 64, (5, 6), generator=g, dtype=torch.int32)
    slots[1, 4:] = -1
    slots[3] = -1
    query = torch.randn(5, 16, 576, generator=g).to(kv_dtype).to(torch.bfloat16)  # values the cast keeps
    out = backend._run_sparse_kernel(query, pool.kv_buffers[0], slots)
    expected = sparse_mla_reference(query, pool.kv_buffers[0], slots, 0.1, backend.bmm2_scale())
    assert out.shape == (5, 16, 512) and out.dtype == query.dtype and not out[3].any()
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)
    assert sparse_library == [(8, 64 if kv_dtype == torch.float8_e4m3fn else 16)]


def test_v32_worker_lossless_through_the_sparse_seam(sparse_library):
    """DeepSeek-V3.2 on trtllm_mla over a bf16 cache (topk 1 chains, its draft-extend and prefill
    too): every sparse pass goes through the library call, and the outputs are target-only greedy
    decoding's on torch_ref over the same cache."""
    from test_worker_v32 import INDEX_TOPK, v32_models

    target, mtp = v32_models()
    cfg = SpecConfig(num_steps=3, attention_backend="trtllm_mla", kv_dtype="bf16", page_size=64, max_batch_size=4,
                     max_context_len=256)
    groups = [(prompts(3, seed=1), 10), (prompts(1, seed=2), 6)]
    outputs, _ = run_to_completion(EagleWorker(target, mtp, cfg), groups)
    assert outputs == reference(target, groups, page_size=64, kv_dtype=torch.bfloat16)
    assert {k for k, _ in sparse_library} == {-(-INDEX_TOPK // 4) * 4}


def test_cutedsl_has_no_sparse_pass():
    assert TrtllmMLABackend.supports_sparse and not CuteDslMLABackend.supports_sparse
