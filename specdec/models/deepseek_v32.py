"""DeepSeek-V3.2: DeepSeek-V3's architecture with DeepSeek Sparse Attention (DSA).

Each layer's lightning indexer scores every cached token for each query token, and the layer's MLA
attends only over the best ``index_topk`` of them: ``backend.index_topk`` (which caches the
indexer's keys and selects rows as cache slots), then ``backend.forward_sparse`` over those slots,
so the model stays backend-agnostic. The indexer's keys live in the KV pool beside the 576-wide
latent rows (``KVCacheView.index_buffers``, the same pages and slots; ``MLAKVPool(index_head_dim=)``),
which the models' ``attn_spec()`` asks for. Everything else is V3's (deepseek.py, mtp.py); names
follow transformers' DeepseekV32ForCausalLM, and the MTP layer's those of V3's release.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from attn.base import AttnBatch, LayerSpec
from attn.registry import sparse_backend_names
from specdec.models import gemv, ops
from specdec.models.config import DeepseekV32Config, DeepseekV3Config
from specdec.models.deepseek import DeepseekV3ForCausalLM, MLAttention, _factory
from specdec.models.mtp import DeepseekMTP
from specdec.parallel import SINGLE, Parallel

INDEX_NORM_EPS = 1e-6  # k_norm's, fixed in transformers' DeepseekV32Indexer and DeepSeek's inference code


class Indexer(nn.Module):
    """One layer's lightning indexer, as transformers' DeepseekV32Indexer computes it (the reference
    code's Hadamard rotation preserves dot products and its fp8 scoring is a precision choice, so
    neither is here).

    wq_b ``[Hi * Di, q_lora_rank]`` makes Hi queries from the normed q latent; wk ``[Di, D]`` then
    k_norm (a LayerNorm with bias) one key a token; weights_proj ``[Hi, D]`` the per-head weights of
    its score. The first qk_rope_head_dim dims of queries and key are rotated half-split (not as
    MLA's interleaved pairs). Every tensor-parallel rank holds all of it, so every rank selects the
    same rows.
    """

    def __init__(self, cfg: DeepseekV32Config, dtype: Optional[torch.dtype] = None, device: Any = None) -> None:
        super().__init__()
        fk = _factory(dtype, device)
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, **fk)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False, **fk)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEX_NORM_EPS, **fk)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False, **fk)

    def forward(self, x: torch.Tensor, q_a: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[T, D]``, q_a ``[T, q_lora_rank]`` (the normed q latent), rope (cos, sin) ``[T, 32]`` ->
        (queries ``[T, Hi, Di]``, weights ``[T, Hi]`` fp32, keys ``[T, Di]``). The weights carry
        1/sqrt(Hi) and the score's softmax scale 1/sqrt(Di): relu(s * a) = s * relu(a) for s > 0."""
        q = gemv.linear(q_a, self.wq_b.weight).view(-1, self.n_heads, self.head_dim)
        k = self.k_norm(gemv.linear(x, self.wk.weight))
        q, k = (torch.cat([ops.apply_rope(t[..., :self.rope_dim], *rope, False), t[..., self.rope_dim:]], dim=-1)
                for t in (q, k))
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * (self.n_heads * self.head_dim) ** -0.5
        return q, weights, k


class SparseMLAttention(MLAttention):
    """MLA (deepseek.MLAttention) whose query tokens attend only over their indexer's top
    ``index_topk`` rows."""

    writes_kv_rows = False  # the indexer's pass (index_topk) is checked after the latents: forward_sparse writes

    def __init__(self, cfg: DeepseekV32Config, kv_layer_id: int, parallel: Parallel = SINGLE,
                 dtype: Optional[torch.dtype] = None, device: Any = None) -> None:
        super().__init__(cfg, kv_layer_id, parallel, dtype, device)
        self.indexer = Indexer(cfg, dtype, device)

    def attend(self, query: torch.Tensor, kv_new: torch.Tensor, backend, batch: AttnBatch, x: torch.Tensor,
               q_a: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, weights, k = self.indexer(x, q_a, rope)
        slots = backend.index_topk(q, weights, k, self.kv_layer_id, batch, self.cfg.index_topk)  # [T, topk] int32
        return backend.forward_sparse(query, kv_new, self.kv_layer_id, batch, slots)


def sparse_spec(spec: LayerSpec, cfg: DeepseekV32Config) -> LayerSpec:
    """A V3 model's LayerSpec with V3.2's sparse fields: index_topk rows a query token, indexer keys
    index_head_dim wide (what the worker sizes the pool and checks the backends by)."""
    return dataclasses.replace(spec, index_topk=cfg.index_topk, index_head_dim=cfg.index_head_dim)


def check_sparse_backend(backend, cfg: DeepseekV32Config) -> None:
    """ValueError naming the setting, before a forward's first layer writes anything, unless
    ``backend`` runs sparse passes (supports_sparse) of cfg.index_topk rows over a pool holding
    indexer keys index_head_dim wide (its check_sparse)."""
    if not getattr(backend, "supports_sparse", False):
        name = getattr(backend, "name", type(backend).__name__)
        raise ValueError(f"{name} has no sparse attention (supports_sparse=False), which DeepSeek-V3.2 "
                         f"(index_topk={cfg.index_topk}) needs; pick a sparse attention backend: "
                         f"{sparse_backend_names()}")
    backend.check_sparse(cfg.index_topk, cfg.index_head_dim)


def _require_v32(config: DeepseekV3Config, cls: type) -> None:
    if not isinstance(config, DeepseekV32Config):
        raise TypeError(f"{cls.__name__} takes a DeepseekV32Config, got {type(config).__name__}")


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """The DeepSeek-V3.2 target model: DeepseekV3ForCausalLM's contract, over a backend with sparse
    passes (``supports_sparse``) and a KV pool holding ``index_head_dim`` indexer values a token a
    layer (attn_spec says both: sparse_spec); forward refuses others before any cache write."""

    attention = SparseMLAttention

    def __init__(self, config: DeepseekV32Config, dtype: Optional[torch.dtype] = None, device: Any = None,
                 parallel: Parallel = SINGLE) -> None:
        _require_v32(config, type(self))
        super().__init__(config, dtype, device, parallel)

    def attn_spec(self) -> LayerSpec:
        return sparse_spec(super().attn_spec(), self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend, batch: AttnBatch) -> torch.Tensor:
        check_sparse_backend(backend, self.config)
        return super().forward(input_ids, positions, backend, batch)


class DeepseekV32MTP(DeepseekMTP):
    """DeepSeek-V3.2's MTP layer as the EAGLE draft: DeepseekMTP whose decoder layer attends
    sparsely, with its own indexer (``model.layers.{num_hidden_layers}.self_attn.indexer.*``), over
    the draft's pool of indexer keys; the backend contract is DeepseekV32ForCausalLM's."""

    attention = SparseMLAttention

    def __init__(self, config: DeepseekV32Config, target: Optional[DeepseekV3ForCausalLM] = None,
                 dtype: Optional[torch.dtype] = None, device: Any = None, *, embed_tokens: Optional[nn.Module] = None,
                 head: Optional[nn.Linear] = None, parallel: Optional[Parallel] = None) -> None:
        _require_v32(config, type(self))
        super().__init__(config, target, dtype, device, embed_tokens=embed_tokens, head=head, parallel=parallel)

    def attn_spec(self) -> LayerSpec:
        return sparse_spec(super().attn_spec(), self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_in: torch.Tensor, backend,
                batch: AttnBatch) -> torch.Tensor:
        check_sparse_backend(backend, self.config)
        return super().forward(input_ids, positions, hidden_in, backend, batch)
