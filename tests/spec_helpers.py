"""Shared test helpers: a tiny DeepSeek-V3-architecture model, prompts, and run loops."""

from __future__ import annotations

import pytest
import torch

from attn.backends.torch_ref import paged_mla_reference
from attn.registry import get_backend_class
from specdec.baseline import greedy_generate
from specdec.models import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM
from specdec.worker import EagleWorker

VOCAB = 96


def tiny_config(**overrides) -> DeepseekV3Config:
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
        v_head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=512,
    )
    base.update(overrides)
    return DeepseekV3Config(**base)


def make_models(device="cpu", dtype=torch.float32, **overrides) -> tuple[DeepseekV3ForCausalLM, DeepseekMTP]:
    """A seeded random target and MTP draft head."""
    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(tiny_config(**overrides)).to(device=device, dtype=dtype).eval()
    torch.manual_seed(1)
    mtp = DeepseekMTP(target.config, target=target).to(device=device, dtype=dtype).eval()
    return target, mtp


def prompts(n: int, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def run_to_completion(worker: EagleWorker, groups: list[tuple[list[list[int]], int]], join_every: int = 2):
    """Add the request groups one at a time, ``join_every`` steps apart, and step until all finish.

    Returns the outputs in request order and every step's accept lengths."""
    reqs, accept, pending, steps = [], [], list(groups), 0
    while pending or worker.requests:
        if pending and steps % join_every == 0:
            group, max_new = pending.pop(0)
            reqs += worker.add_requests(group, max_new)
        if worker.requests:
            accept += worker.step().accept_lens
        steps += 1
    return [r.output for r in reqs], accept


def free_pages(worker) -> tuple[int, int]:
    """Free pages of the target and the draft pool."""
    return worker.target_pool.num_free_pages, worker.draft_pool.num_free_pages


def drain(worker) -> None:
    """Step until every request has finished."""
    while worker.requests:
        worker.step()


def needs_library(backend: str) -> None:
    """Skip unless ``backend``'s kernel library imports: flash_mla (the sgl-flash-mla wheel) is
    outside CI's install."""
    if backend == "flashmla":
        pytest.importorskip("flash_mla", reason="flashmla needs the sgl-flash-mla wheel")


def reference(target, groups, **kwargs) -> list[list[int]]:
    """Target-only greedy outputs of every group, in order."""
    out = []
    for group, max_new in groups:
        out += greedy_generate(target, group, max_new, **kwargs)
    return out


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s stream is capturing a CUDA graph: reading device values would sync."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def query_dtype(kv_cache: torch.Tensor) -> torch.dtype:
    """The dtype the kernels take queries in: the cache's, bf16 over an fp8 cache."""
    return torch.bfloat16 if kv_cache.dtype == torch.float8_e4m3fn else kv_cache.dtype


def kernel_errors(monkeypatch, backend: str, tail_rows: int | None = None) -> list[float]:
    """Wraps ``backend``'s two kernel calls: each eager call's largest error against the plain-torch
    reference on the same inputs (its query rounded to query_dtype, as the kernels take it),
    relative to the reference's largest value. For backends whose kernel calls each run a whole
    pass (triton_mla, flashinfer_mla; not the chunked prefill's pieces). tail_rows: compare only
    each request's last tail_rows query rows, which see all of its kv (for passes whose reference
    over every row would not fit in memory)."""
    errors: list[float] = []
    cls = get_backend_class(backend)
    decode, prefill = cls._run_decode_kernel, cls._run_prefill_kernel

    def record(self, out, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, custom_mask=None):
        pieces = [(out, query, block_tables, seq_lens, cu_seqlens_q, max_q_len, custom_mask)]
        if tail_rows is not None:  # a request at a time: the reference gathers [rows, table width, 576]
            bounds, pieces = cu_seqlens_q.tolist(), []
            for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
                n = min(tail_rows, end - start)
                if n:
                    cu = torch.tensor([0, n], dtype=torch.int32, device=query.device)
                    mask = None if custom_mask is None else custom_mask[b:b + 1, end - start - n:end - start]
                    pieces.append((out[end - n:end], query[end - n:end], block_tables[b:b + 1], seq_lens[b:b + 1],
                                   cu, n, mask))
        for out, query, block_tables, seq_lens, cu_seqlens_q, max_q_len, custom_mask in pieces:
            ref = paged_mla_reference(query.to(query_dtype(kv_cache)).float(), kv_cache, block_tables, seq_lens,
                                      cu_seqlens_q, max_q_len, self.layer.sm_scale,
                                      custom_mask=None if custom_mask is None else custom_mask.bool(),
                                      kv_scale=self.bmm2_scale())
            errors.append(((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item())

    def checked_decode(self, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask):
        out = decode(self, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask)
        if capturing(query):
            return out
        bs, q_len = query.shape[:2]
        cu = torch.arange(bs + 1, device=query.device, dtype=torch.int32) * q_len
        record(self, out.flatten(0, 1), query.flatten(0, 1), kv_cache, block_tables, seq_lens, cu, q_len, custom_mask)
        return out

    def checked_prefill(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, max_seq_len):
        out = prefill(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, max_seq_len)
        if not capturing(query):
            record(self, out, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len)
        return out

    monkeypatch.setattr(cls, "_run_decode_kernel", checked_decode)
    monkeypatch.setattr(cls, "_run_prefill_kernel", checked_prefill)
    return errors


def documented_decode(query, kv_cache, block_tables, seq_lens, qk_scale, out_scale):
    """What the MLA decode libraries (FlashInfer's trtllm-gen, tokenspeed-mla, FlashMLA) document: query ``[B, q_len, H, 576]`` and kv
    ``[pages, (1,) page_size, 576]`` in one dtype, read as stored; row i of a request of kv length
    L sees kv positions < L - q_len + i + 1; out = out_scale * softmax(qk_scale * q.k) . v, with v
    the first 512 columns; ``[B, q_len, H, 512]`` bf16."""
    assert query.dtype == kv_cache.dtype
    pages = kv_cache.reshape(kv_cache.shape[0], -1, 576).float()
    bs, q_len = query.shape[:2]
    out = torch.empty(*query.shape[:3], 512)
    for b in range(bs):
        length = int(seq_lens[b])
        kv = pages[block_tables[b].long()].reshape(-1, 576)[:length]
        for i in range(q_len):
            seen = kv[: length - q_len + i + 1]
            weights = torch.softmax(qk_scale * query[b, i].float() @ seen.T, dim=-1)
            out[b, i] = out_scale * weights @ seen[:, :512]
    return out.to(torch.bfloat16)
