"""The flashmla backend's adapter on the CPU: FlashMLA's entry points replaced by their documented
semantics (sgl-flash-mla's flash_mla_interface: the scheduler's outputs, the dense decode's layout,
causality, dtypes and descales), so everything but the kernels runs for real, in the worker too."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from attn.backends.flashmla import FlashMLABackend
from attn.backends.torch_ref import TorchRefBackend
from attn.backends.triton_mla import TritonMLABackend
from attn.base import KV_DTYPES, LayerSpec
from specdec.config import ConfigError, SpecConfig
from specdec.kv import MLAKVPool
from specdec.worker import EagleWorker
from spec_helpers import documented_decode, prompts, reference, run_to_completion


class DocumentedFlashMLA(types.ModuleType):
    """``flash_mla`` as its interface documents it. The scheduler's tile metadata is the lengths it
    was given, so a decode call can check that its schedule was made for its own pass."""

    def __init__(self) -> None:
        super().__init__("flash_mla")
        self.schedules: list[tuple[torch.Tensor, int, bool]] = []  # (tiles, query rows a request, fp8) a call
        self.decodes: list[int] = []  # per decode call: the index of its schedule

    @staticmethod
    def has_legacy() -> bool:
        return True

    @staticmethod
    def get_mla_metadata(*args, **kwargs):
        return types.SimpleNamespace(tile_scheduler_metadata=None, num_splits=None), None

    def get_mla_decoding_metadata(self, seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None, is_fp8_kvcache=False,
                                  topk=None, use_legacy=False):
        assert use_legacy and h_k == 1 and topk is None and seqlens_k.dtype == torch.int32
        tiles = seqlens_k.clone()
        self.schedules.append((tiles, num_q_tokens_per_head_k, is_fp8_kvcache))
        return tiles, torch.full((seqlens_k.shape[0] + 1,), num_q_tokens_per_head_k, dtype=torch.int32)

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                               use_legacy=False, descale_q=None, descale_k=None, **unused):
        bs, q_len, heads, dim = q.shape
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        assert use_legacy and indices is None and num_splits is None and not unused and head_dim_v == 512
        assert dim == 576 and tuple(k_cache.shape[1:]) == (64, 1, 576) and q.dtype == k_cache.dtype
        assert q.dtype in (torch.bfloat16, torch.float8_e4m3fn) and is_fp8_kvcache == fp8
        assert block_table.dtype == cache_seqlens.dtype == torch.int32 and block_table.shape[0] == bs
        assert causal == (q_len > 1)
        assert torch.equal(tile_scheduler_metadata.tile_scheduler_metadata, cache_seqlens)  # this pass's schedule
        assert int(tile_scheduler_metadata.num_splits[0]) == q_len * heads
        assert (descale_q is not None) == fp8 == (descale_k is not None)
        q_scale, k_scale = (float(descale_q), float(descale_k)) if fp8 else (1.0, 1.0)
        self.decodes.append(next(i for i, (t, _, _) in enumerate(self.schedules)
                                 if t is tile_scheduler_metadata.tile_scheduler_metadata))
        out = documented_decode(q.float(), k_cache.float(), block_table, cache_seqlens, softmax_scale * q_scale * k_scale,
                                k_scale)
        return out, torch.zeros(bs, heads, q_len)


@pytest.fixture
def library(monkeypatch):
    """The documented flash_mla in sys.modules; triton_mla's prefill (flashmla's fallback) runs the
    torch reference, and the SM90 requirement is lifted on the CPU."""
    module = DocumentedFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    monkeypatch.setattr(FlashMLABackend, "required_sm", None)
    monkeypatch.setattr(TritonMLABackend, "required_sm", None)
    monkeypatch.setattr(TritonMLABackend, "_run_ragged_kernel", TorchRefBackend._run_ragged_kernel)
    return module


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_worker_lossless_through_the_seam(target, mtp, library, kv_dtype):
    """Decode passes go to FlashMLA with a schedule made once a pass (not once a layer) from that
    pass's lengths; prefill goes to triton_mla; outputs equal target-only decoding on torch_ref
    over the same cache dtype."""
    num_steps = 3
    cfg = SpecConfig(num_steps=num_steps, attention_backend="flashmla", kv_dtype=kv_dtype, page_size=64,
                     max_batch_size=4, max_context_len=256)
    worker = EagleWorker(target, mtp, cfg)
    assert worker.target_prefill_backend.name == "triton_mla" and worker.draft_extend_backend.name == "flashmla"
    groups = [(prompts(3, seed=21), 9), (prompts(1, seed=22), 6)]
    outputs, _ = run_to_completion(worker, groups)
    assert outputs == reference(target, groups, page_size=64, kv_dtype=KV_DTYPES[kv_dtype])
    # Every schedule serves its pass's layers: the target's verify both of its layers, the MTP's passes one.
    uses = [library.decodes.count(i) for i in range(len(library.schedules))]
    assert set(uses) == {1, target.config.num_hidden_layers}
    heads = target.attn_spec().num_heads
    assert {rows for _, rows, _ in library.schedules} == {heads, (num_steps + 1) * heads}
    assert {fp8 for _, _, fp8 in library.schedules} == {kv_dtype == "fp8_e4m3"}


@pytest.mark.parametrize("kv_dtype,kv_scale", [(torch.bfloat16, 1.0), (torch.float8_e4m3fn, 0.5)])
def test_decode_call_attends_as_flashmla_documents(library, kv_dtype, kv_scale):
    """A verify chain of 4 over two requests: what the documented call returns for the adapter's
    arguments is plain causal attention over the dequantised cache with the layer's softmax scale,
    for the query in the cache's dtype (fp8 at scale 1)."""
    g = torch.Generator().manual_seed(5)
    pool = MLAKVPool(1, 9, 64, 2, 256, kv_dtype, kv_scale=kv_scale)
    pool.kv_buffers[0].copy_(torch.randn(pool.kv_buffers[0].shape, generator=g).to(kv_dtype))
    backend = FlashMLABackend(pool.view(), LayerSpec(num_heads=16, sm_scale=0.1), 2, 4)
    tables = torch.tensor([[3, 1, 7, 0], [5, 2, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([200, 70], dtype=torch.int32)
    backend._schedule, _ = library.get_mla_metadata()
    backend._schedule.tile_scheduler_metadata, backend._schedule.num_splits = library.get_mla_decoding_metadata(
        seq_lens, 64, 1, 16, is_fp8_kvcache=kv_dtype == torch.float8_e4m3fn, use_legacy=True)
    query = torch.randn(2, 4, 16, 576, generator=g)
    out = backend._run_decode_kernel(query, pool.kv_buffers[0], tables, seq_lens, 256, None)
    expected = documented_decode(query.to(kv_dtype).float(), pool.kv_buffers[0].float() * kv_scale, tables, seq_lens,
                                 0.1, 1.0)
    assert out.dtype == query.dtype and out.shape == (2, 4, 16, 512)
    torch.testing.assert_close(out, expected.float(), rtol=1e-2, atol=1e-2)


def test_trees_pages_and_a_missing_library_are_refused(target, mtp, library, monkeypatch):
    """topk > 1 is refused naming the tree backends; pages of another size than 64 become 64 with a
    warning (built directly: refused); without flash_mla the build fails naming the wheel."""
    with pytest.raises(ConfigError, match=r"flashmla \(target\) cannot attend with a tree mask.*'triton_mla'"):
        EagleWorker(target, mtp, SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, attention_backend="flashmla",
                                            kv_dtype="bf16", page_size=64, max_context_len=256))
    with pytest.warns(UserWarning, match=r"flashmla \(target\) supports page_size \(64,\), not 16"):
        worker = EagleWorker(target, mtp, SpecConfig(attention_backend="flashmla", kv_dtype="bf16", page_size=16,
                                                     max_context_len=256))
    assert worker.verify_backend.page_size == 64
    pool = MLAKVPool(1, 16, 16, 1, 128, torch.bfloat16)
    with pytest.raises(ValueError, match=r"flashmla takes pages of \[64\] tokens, not 16"):
        FlashMLABackend(pool.view(), LayerSpec(num_heads=16, sm_scale=0.1), 2, 1)
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    with pytest.raises(ImportError, match="install the sgl-flash-mla wheel"):
        EagleWorker(target, mtp, SpecConfig(attention_backend="flashmla", kv_dtype="bf16", page_size=64,
                                            max_context_len=256))
