"""The flashmla_sparse backend's adapter on the CPU: FlashMLA's sparse decode and scheduler replaced by
their documented semantics (sgl-flash-mla's flash_mla_interface: the layout of q, the 656-byte fp8 rows
and the indices, 64 or 128 heads, the schedule of a pass), so that the worker runs DeepSeek-V3.2
through everything but the kernel; the indexer is torch_ref's. The V3.2 fp8 row format is checked
here too (attn.v32_fp8)."""

from __future__ import annotations

import sys

import pytest
import torch

from attn.backends.flashmla_sparse import FlashMLASparseBackend
from attn.backends.torch_ref import TorchRefBackend, sparse_mla_reference
from attn.base import AttnBatch, ForwardMode, LayerSpec
from attn.v32_fp8 import V32_FP8_BYTES, dequantize_v32, quantize_v32
from specdec.config import ConfigError, SpecConfig
from specdec.kv import MLAKVPool
from specdec.worker import EagleWorker
from spec_helpers import make_models, prompts, reference, run_to_completion
from test_flashmla_seam import DocumentedFlashMLA
from test_worker_v32 import INDEX_TOPK, v32_models


class DocumentedSparseFlashMLA(DocumentedFlashMLA):
    """``flash_mla``'s sparse entry points as its interface documents them. The scheduler's tile
    metadata is a fresh tensor a call, so a decode can check that its schedule is its own pass's:
    schedules holds (tiles, tokens, heads, topk) a call."""

    def get_mla_decoding_metadata(self, seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None, is_fp8_kvcache=False,
                                  topk=None, use_legacy=False):
        assert use_legacy and is_fp8_kvcache and h_k == 1 and h_q in (64, 128) and topk % 64 == 0
        assert num_q_tokens_per_head_k == h_q and seqlens_k.dtype == torch.int32 and (seqlens_k == topk).all()
        tiles = torch.zeros(8, dtype=torch.int32)
        self.schedules.append((tiles, seqlens_k.shape[0], h_q, topk))
        return tiles, torch.zeros(seqlens_k.shape[0] + 1, dtype=torch.int32)

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                               use_legacy=False, **unused):
        b, s_q, h_q, dim = q.shape
        assert use_legacy and is_fp8_kvcache and not causal and not unused and num_splits is None
        assert block_table is None and cache_seqlens is None and head_dim_v == 512
        assert dim == 576 and h_q in (64, 128) and q.dtype == torch.bfloat16 and q.is_contiguous()
        assert k_cache.dtype == torch.uint8 and tuple(k_cache.shape[1:]) == (64, 1, V32_FP8_BYTES)
        assert indices.dtype == torch.int32 and tuple(indices.shape[:2]) == (b, s_q) and indices.shape[2] % 64 == 0
        tiles = tile_scheduler_metadata.tile_scheduler_metadata
        schedule = next(i for i, (t, *_) in enumerate(self.schedules) if t is tiles)
        assert self.schedules[schedule][1:] == (b, h_q, indices.shape[2])  # made for this pass's shapes
        self.decodes.append(schedule)
        # Each query token attends to its own valid indices' rows, dequantised (all -1: output 0).
        slots = indices.flatten(0, 1).long()
        valid = (slots >= 0) & (slots < k_cache.shape[0] * 64)
        rows = dequantize_v32(k_cache.reshape(-1, V32_FP8_BYTES)[torch.where(valid, slots, 0)])
        scores = torch.einsum("thd,tkd->thk", q.flatten(0, 1).float(), rows) * softmax_scale
        probs = scores.masked_fill(~valid[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)
        out = torch.einsum("thk,tkd->thd", probs, rows[..., :512]).to(torch.bfloat16)
        return out.view(b, s_q, h_q, 512), torch.zeros(b, h_q, s_q)


@pytest.fixture
def library(monkeypatch):
    """The documented flash_mla in sys.modules, torch_ref's indexer, and no SM90 requirement on the CPU."""
    module = DocumentedSparseFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    monkeypatch.setattr(FlashMLASparseBackend, "required_sm", None)
    monkeypatch.setattr(FlashMLASparseBackend, "_run_index_kernel", TorchRefBackend._run_index_kernel)
    return module


@pytest.fixture(scope="module")
def sparse_models():
    return v32_models()


def sparse_config(**overrides) -> SpecConfig:
    settings = dict(num_steps=3, attention_backend="flashmla_sparse", kv_dtype="fp8_v32", page_size=64,
                    max_batch_size=4, max_context_len=256)
    return SpecConfig(**{**settings, **overrides})


@pytest.mark.parametrize("topk,ndt", [(1, None), (2, 6)])
def test_worker_lossless_through_the_seam(sparse_models, library, topk, ndt):
    """Every pass of the V3.2 target and its sparse MTP head (prefill, verify, the draft's steps,
    draft-extend; chains and trees) goes to the documented kernel with a schedule made once a pass
    from its shapes; outputs equal target-only decoding on torch_ref over the same fp8_v32 cache."""
    target, mtp = sparse_models
    worker = EagleWorker(target, mtp, sparse_config(topk=topk, num_draft_tokens=ndt))
    backends = [worker.verify_backend, worker.draft_extend_backend, worker.target_prefill_backend,
                *worker.draft_backend.steps]
    assert {b.name for b in backends} == {"flashmla_sparse"}
    groups = [(prompts(3, seed=21), 12), (prompts(1, seed=22), 8)]
    outputs, _ = run_to_completion(worker, groups)
    assert outputs == reference(target, groups, page_size=64, kv_dtype=torch.uint8)
    uses = [library.decodes.count(i) for i in range(len(library.schedules))]
    assert set(uses) == {1, target.config.num_hidden_layers}  # the target's passes: every layer; the MTP's: one
    assert {(heads, topk) for _, _, heads, topk in library.schedules} == {(64, 64)}  # 4 heads, index_topk 8


def test_sparse_call_matches_torch_ref_over_the_same_cache(library):
    """A verify pass of 16 heads over 2048 slots a token (some -1, one token with none): the adapter
    pads heads to 64 and slots to the kernel's multiple and returns torch_ref's attention over the
    same fp8_v32 rows; the token without rows gets 0."""
    g = torch.Generator().manual_seed(3)
    pool = MLAKVPool(1, 40, 64, 2, 2048, torch.uint8)
    pool.kv_buffers[0].copy_(quantize_v32(torch.randn(40, 64, 576, generator=g)))
    layer = LayerSpec(num_heads=16, sm_scale=0.1, index_topk=2000, index_head_dim=32)
    backend = FlashMLASparseBackend(pool.view(), layer, 2, 4)
    batch = AttnBatch(ForwardMode.TARGET_VERIFY, torch.tensor([1, 2]), torch.tensor([1500, 900], dtype=torch.int32),
                      torch.arange(8) + 70, torch.tensor([0, 4, 8], dtype=torch.int32), max_q_len=4, uniform_q_len=True)
    backend.init_forward_metadata(batch)
    slots = torch.randint(64, 33 * 64, (8, 2000), generator=g, dtype=torch.int32)
    slots[:, 1900:] = -1
    slots[5] = -1
    q = torch.randn(8, 16, 576, generator=g)
    out = backend._run_sparse_kernel(q, pool.kv_buffers[0], slots)
    expected = sparse_mla_reference(q.to(torch.bfloat16).float(), pool.kv_buffers[0], slots, 0.1)
    assert out.shape == (8, 16, 512) and out.dtype == q.dtype and (out[5] == 0).all()
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    assert library.schedules[-1][1:] == (8, 64, 2048)


def test_settings_it_cannot_take_are_refused(sparse_models, library, monkeypatch):
    """A dense model, another cache dtype, more than 128 heads and a missing wheel are refused when
    the worker (or the backend) is built, naming what to change."""
    target, mtp = sparse_models
    dense_target, dense_mtp = make_models()
    with pytest.raises(ConfigError, match=r"flashmla_sparse \(target\) runs sparse passes only.*attention_backend"):
        EagleWorker(dense_target, dense_mtp, sparse_config())
    with pytest.raises(ConfigError, match=r"flashmla_sparse \(target\) supports kv_dtype \('fp8_v32',\), not 'bf16'"):
        EagleWorker(target, mtp, sparse_config(kv_dtype="bf16"))
    with pytest.raises(ConfigError, match="kv_scale 0.5 scales an fp8_e4m3 cache only"):
        sparse_config(kv_scale=0.5).validate()
    pool = MLAKVPool(1, 4, 64, 1, 128, torch.uint8)
    with pytest.raises(ValueError, match="flashmla_sparse takes up to 128 query heads, not 256"):
        FlashMLASparseBackend(pool.view(), LayerSpec(256, 0.1, index_topk=INDEX_TOPK, index_head_dim=32), 1, 1)
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    with pytest.raises(ImportError, match="install the sgl-flash-mla wheel"):
        EagleWorker(target, mtp, sparse_config())


def test_v32_fp8_rows_hold_scaled_nope_tiles_then_bf16_rope():
    """A row's 4 NoPE tiles of 128 as e4m3 scaled by their maximum / 448 (the 4 fp32 scales next),
    then its RoPE values as bf16; dequantize_v32 gets the RoPE part back exactly and every NoPE
    value within e4m3's rounding of its tile's maximum; a pool of them is 656 bytes a row."""
    rows = torch.randn(3, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows[0, :128] = 2.0
    packed = quantize_v32(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (3, V32_FP8_BYTES)
    assert packed[0, 512:516].view(torch.float32).item() == torch.tensor(2.0 / 448).item()
    assert (packed[0, :128] == 0x7E).all()  # e4m3 448
    for r in range(3):
        tiles = rows[r, :512].float().view(4, 128)
        torch.testing.assert_close(packed[r, 512:528].view(torch.float32), tiles.abs().amax(-1) / 448)
    back = dequantize_v32(packed)
    assert torch.equal(back[:, 512:], rows[:, 512:].float())
    tile_max = rows[:, :512].float().view(3, 4, 128).abs().amax(-1, keepdim=True)
    error = (back[:, :512] - rows[:, :512].float()).view(3, 4, 128).abs()
    assert (error <= tile_max * 2**-4).all() and error.max() > 0
    pool = MLAKVPool(2, 3, 64, 1, 128, torch.uint8, index_head_dim=32)
    assert pool.kv_buffers[0].shape == (3, 64, V32_FP8_BYTES) and pool.index_buffers[0].dtype == torch.bfloat16
    assert MLAKVPool.bytes_for(2, 3, 64, 1, 128, torch.uint8, 32) == 2 * 3 * 64 * (656 + 64) + 2 * 128 * 4
