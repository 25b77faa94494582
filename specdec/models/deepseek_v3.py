"""A DeepSeek-V3-architecture decoder whose attention runs through an ``attn`` backend.

MLA in absorbed (latent) form: W_UK (from kv_b_proj) is folded into the query, so a query is
``[T, H, 512 + 64]`` against one shared 576-wide cache row per token, and W_UV is applied to the
backend's ``[T, H, 512]`` output. Parameter names and shapes follow the public DeepSeek-V3
checkpoint as transformers saves it (per-expert MoE weights), so state dicts load directly.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from attn.base import KV_LORA_RANK, QK_ROPE_DIM, AttnBatch, LayerSpec


@dataclass
class DeepseekV3Config:
    """The fields of an HF DeepSeek-V3 ``config.json`` this implementation reads.

    rope_scaling: None or a YaRN dict (``type``/``rope_type`` "yarn", factor,
    original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim).
    """

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: Optional[int] = 1536
    kv_lora_rank: int = KV_LORA_RANK
    qk_rope_head_dim: int = QK_ROPE_DIM
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # other config.json keys, kept on save

    def __post_init__(self) -> None:
        if self.kv_lora_rank != KV_LORA_RANK or self.qk_rope_head_dim != QK_ROPE_DIM:
            raise ValueError(
                f"kv_lora_rank must be {KV_LORA_RANK} and qk_rope_head_dim {QK_ROPE_DIM} (the backends share a "
                f"576-wide latent cache); got kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}"
            )
        if self.n_routed_experts and self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group ({self.n_group})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must not exceed n_group ({self.n_group})")
        if self.attention_bias:
            raise ValueError("attention_bias=True is not supported (DeepSeek-V3 has none)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekV3Config":
        d = dict(d)
        params = d.pop("rope_parameters", None)  # transformers >= 5 folds rope_theta + scaling in here
        if params:
            d.setdefault("rope_theta", params.get("rope_theta", 10000.0))
            if params.get("rope_type", "default") != "default":
                d.setdefault("rope_scaling", {k: v for k, v in params.items() if k != "rope_theta"})
        if d.get("rope_scaling") is None:
            d.pop("rope_scaling", None)
        names = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in names}, extra={k: v for k, v in d.items() if k not in names})

    @classmethod
    def from_json(cls, path: str) -> "DeepseekV3Config":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        return {**extra, **d, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn(self) -> Optional[dict[str, Any]]:
        rs = self.rope_scaling
        return rs if rs and rs.get("rope_type", rs.get("type")) == "yarn" else None


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: DeepseekV3Config) -> float:
    """1/sqrt(192), times mscale(factor, mscale_all_dim)^2 under YaRN (as the reference)."""
    scale = cfg.qk_head_dim**-0.5
    if cfg.yarn and cfg.yarn.get("mscale_all_dim"):
        scale *= _yarn_mscale(cfg.yarn["factor"], cfg.yarn["mscale_all_dim"]) ** 2
    return scale


class RotaryEmbedding(nn.Module):
    """RoPE over the 64 rope dims, with YaRN frequency blending and cos/sin attention factor."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        self.attention_factor = 1.0
        yarn = cfg.yarn
        if yarn:
            factor = yarn["factor"]
            orig = yarn.get("original_max_position_embeddings") or cfg.max_position_embeddings
            mscale, mscale_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
            self.attention_factor = yarn.get("attention_factor") or (
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all else _yarn_mscale(factor)
            )

            def correction_dim(rotations: float) -> float:
                return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(correction_dim(yarn.get("beta_fast") or 32)), 0)
            high = min(math.ceil(correction_dim(yarn.get("beta_slow") or 1)), dim - 1)
            ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / max(high - low, 1e-3)).clamp(0, 1)
            extrapolate = 1 - ramp
            inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = cfg.rope_interleave

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x ``[T, ..., 64]`` at positions ``[T]``; interleaved pairs come out de-interleaved
        (the same permutation for q and k, so their dot products are the reference's)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, 32]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[-1],)
        cos = (freqs.cos() * self.attention_factor).view(shape).to(x.dtype)
        sin = (freqs.sin() * self.attention_factor).view(shape).to(x.dtype)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention, absorbed. Weights as in the checkpoint; absorption per call."""

    def __init__(self, cfg: DeepseekV3Config, layer_id: int) -> None:
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        h, d = cfg.num_attention_heads, cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, backend, batch: AttnBatch) -> torch.Tensor:
        """x ``[T, D]`` -> ``[T, D]``; writes this layer's latent KV for the T tokens."""
        cfg = self.cfg
        h, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, h, cfg.qk_head_dim)
        q_nope, q_rope = q.split([nope, cfg.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv_new = torch.cat([self.kv_a_layernorm(latent), rope(k_rope, positions)], dim=-1)  # [T, 576]
        w_kv = self.kv_b_proj.weight.view(h, nope + cfg.v_head_dim, cfg.kv_lora_rank)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [H, 128, 512], [H, v, 512]
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        query = torch.cat([q_latent, rope(q_rope, positions)], dim=-1)  # [T, H, 576]
        out = backend.forward(query, kv_new, self.layer_id, batch)  # [T, H, 512]
        out = torch.einsum("thc,hvc->thv", out.to(x.dtype), w_uv)
        return self.o_proj(out.reshape(out.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid scores; the correction bias steers selection only; grouped top-k."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, D]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]``)."""
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        groups = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(cfg.topk_group, dim=-1).indices, 1.0)
        keep = keep.repeat_interleave(cfg.n_routed_experts // cfg.n_group, dim=1).bool()
        ids = choice.masked_fill(~keep, float("-inf")).topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


class MoE(nn.Module):
    """Routed experts (one MLP each, as in the checkpoint) plus shared experts."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts))
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.shared_experts(x)
        # Dense over experts (every expert sees every token, weighted 0 where not chosen): no
        # data-dependent shapes, so it runs inside CUDA graphs; clarity over speed for small models.
        for e, expert in enumerate(self.experts):
            w = (weights * (ids == e)).sum(-1, keepdim=True)
            out = out + expert(x) * w.to(x.dtype)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, layer_id: int, dense: bool) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_id)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if dense else MoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, backend, batch: AttnBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, backend, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dense=i < cfg.first_k_dense_replace or not cfg.n_routed_experts) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """The target model. ``forward(ids [T], positions [T], backend, batch) -> hidden [T, D]`` (final norm applied)."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(config)

    @property
    def num_attention_layers(self) -> int:
        return self.config.num_hidden_layers

    def attn_spec(self) -> LayerSpec:
        return LayerSpec(self.config.num_attention_heads, softmax_scale(self.config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend, batch: AttnBatch) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rope, backend, batch)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, D]`` -> ``[N, vocab]`` fp32."""
        return self.lm_head(hidden).float()


class DeepseekMTP(nn.Module):
    """DeepSeek's MTP / EAGLE draft layer: enorm(embed(t)) ++ hnorm(h) -> eh_proj -> one decoder
    layer -> shared_head.norm -> shared_head.head. Shares the target's embedding and head unless
    the checkpoint carries its own copies.

    forward(ids [T], positions [T], hidden_in [T, D], backend, batch) -> hidden [T, D] (after
    shared_head.norm: fed back as hidden_in of the next draft step).
    """

    num_attention_layers = 1

    def __init__(self, config: DeepseekV3Config, target: Optional[DeepseekV3ForCausalLM] = None) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = target.model.embed_tokens if target is not None else nn.Embedding(config.vocab_size, d)
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        # Layer id 0: the draft has a KV pool of its own. MoE unless the whole model is dense.
        self.layer = DecoderLayer(config, 0, dense=config.first_k_dense_replace >= config.num_hidden_layers or not config.n_routed_experts)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(d, config.rms_norm_eps)
        self.shared_head.head = target.lm_head if target is not None else nn.Linear(d, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config)

    def attn_spec(self) -> LayerSpec:
        return LayerSpec(self.config.num_attention_heads, softmax_scale(self.config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_in: torch.Tensor, backend, batch: AttnBatch) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(hidden_in)], dim=-1))
        return self.shared_head.norm(self.layer(x, positions, self.rope, backend, batch))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(hidden).float()
