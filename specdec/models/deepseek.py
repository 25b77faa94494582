"""A DeepSeek-V3-architecture decoder whose attention runs through an ``attn`` backend.

MLA runs in absorbed (latent) form: W_UK (the key half of kv_b_proj) is folded into the query,
so each head's query is ``[512 latent + 64 rope]`` against one shared 576-wide cache row per
token; the backend returns the attention-weighted latent ``[T, H, 512]`` and W_UV (the value
half of kv_b_proj) maps it to ``[T, H, v_head_dim]`` before o_proj. Module and parameter names
follow the public DeepSeek-V3 checkpoint as transformers saves it (per-expert MoE weights), so
``state_dict()`` names are checkpoint names.

Token ids: ``forward`` checks them when they are a CPU tensor (no device sync); an engine that
keeps ids on an accelerator checks its host copy with :func:`validate_token_ids` first.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from attn.base import AttnBatch, LayerSpec
from specdec.models.config import DeepseekV3Config
from specdec.models.mlp import MLP
from specdec.models.moe import MoE
from specdec.models.packing import CheckpointViews, row_views
from specdec.models import gemv, ops
from specdec.parallel import SINGLE, Parallel


def validate_token_ids(ids: Union[torch.Tensor, Sequence[int]], vocab_size: int, name: str = "token ids") -> None:
    """Raise ValueError unless every id lies in ``[0, vocab_size)``, naming the ids ``name``. Reads
    the values: call it on host data (it would synchronise with a device tensor)."""
    try:
        ids = torch.as_tensor(ids)
    except (OverflowError, ValueError):  # ids beyond int64
        bad = sorted({int(t) for t in ids if not 0 <= t < vocab_size})[:8]
    else:
        if not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < vocab_size):
            return
        bad = ids[(ids < 0) | (ids >= vocab_size)].unique()[:8].tolist()
    raise ValueError(f"{name} must lie in [0, vocab_size={vocab_size}); got {bad}")


_INDEX_DTYPES = (torch.int64, torch.int32)
# The eps of the latent norms (q_a_layernorm, kv_a_layernorm): fixed, not config.rms_norm_eps, in
# DeepSeek's inference/model.py and transformers' DeepseekV3Attention alike (V3/R1 set 1e-6 anyway).
LATENT_NORM_EPS = 1e-6


def check_inputs(input_ids: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> None:
    """Shape and dtype checks always; value checks only for CPU tensors (free there, a sync
    elsewhere). Float positions were rotated at fractional angles, float ids failed in the
    embedding naming no argument."""
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(f"input_ids and positions must both be [T]; got {tuple(input_ids.shape)} and {tuple(positions.shape)}")
    if input_ids.dtype not in _INDEX_DTYPES or positions.dtype not in _INDEX_DTYPES:
        raise ValueError(f"input_ids and positions must be int64 or int32; got {input_ids.dtype} and {positions.dtype}")
    if input_ids.device.type == "cpu":
        validate_token_ids(input_ids, vocab_size)
    if positions.device.type == "cpu" and positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0; got {int(positions.min())}")


def softmax_scale(cfg: DeepseekV3Config) -> float:
    """1/sqrt(nope + rope), times mscale(factor, mscale_all_dim)^2 under YaRN, as transformers
    computes it. The backend applies it; the model never scales q."""
    scale = cfg.qk_head_dim**-0.5
    if cfg.yarn and cfg.yarn.get("mscale_all_dim"):
        scale *= _yarn_mscale(cfg.yarn["factor"], cfg.yarn["mscale_all_dim"]) ** 2
    return scale


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _factory(dtype: Optional[torch.dtype], device: Any) -> dict[str, Any]:
    return {"dtype": dtype, "device": device}


def local_heads(cfg: DeepseekV3Config, parallel: Parallel) -> int:
    """The attention heads this rank computes: num_attention_heads / tp."""
    return parallel.shard(cfg.num_attention_heads, "num_attention_heads")[1]


# ---------------------------------------------------------------------------- building blocks
class VocabEmbedding(nn.Module):
    """The embedding table's vocabulary slice ``[vocab / tp, D]`` of this rank (the whole table in
    one process): other ranks' tokens look up zeros here, and an all-reduce adds each token's one row.
    """

    def __init__(self, vocab: int, dim: int, parallel: Parallel = SINGLE, dtype: Optional[torch.dtype] = None,
                 device: Any = None) -> None:
        super().__init__()
        self.parallel, self.num_embeddings = parallel, vocab
        self.start, local = parallel.shard(vocab, "vocab_size")
        self.weight = nn.Parameter(torch.empty(local, dim, **_factory(dtype, device)))
        nn.init.normal_(self.weight)  # as nn.Embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids ``[T]`` -> ``[T, D]``."""
        if self.parallel.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(mine, local, 0), self.weight).masked_fill(~mine[:, None], 0)
        return self.parallel.all_reduce(rows)


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, scaled by the weight in the input dtype (as transformers)."""

    def __init__(self, dim: int, eps: float, dtype: Optional[torch.dtype] = None, device: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **_factory(dtype, device)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)[0]

    def residual(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm (None: x alone)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)

    def after(self, residual: Optional[torch.Tensor]) -> ops.AddNorm:
        """This norm of ``residual`` + a sublayer's output, for the sublayer to compute in its own
        last kernel where it can (ops.AddNorm): ``after(r)(x) == residual(x, r)``."""
        return ops.AddNorm(residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin of the 64 rope dims at given positions, with YaRN frequency blending."""

    def __init__(self, cfg: DeepseekV3Config, device: Any = None) -> None:
        super().__init__()
        inv_freq, self.attention_factor = _rope_frequencies(cfg)
        # Kept as the int32 bit pattern of the fp32 frequencies: Module.to(bfloat16) casts float
        # buffers, and bf16 frequencies put positions in the hundreds off by whole radians.
        self.register_buffer("inv_freq_bits", inv_freq.view(torch.int32).to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` int64 -> (cos, sin), each ``[T, 32]`` fp32 (ops.rope_cos_sin)."""
        return ops.rope_cos_sin(positions, self.inv_freq_bits.view(torch.float32), self.attention_factor)


def _rope_frequencies(cfg: DeepseekV3Config) -> tuple[torch.Tensor, float]:
    """(inv_freq ``[32]`` fp32, cos/sin attention factor), following transformers' YaRN."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    yarn = cfg.yarn
    if not yarn:
        return inv_freq, 1.0
    factor = yarn["factor"]
    mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    elif attention_factor is None:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.get("beta_fast") or 32), correction_dim(yarn.get("beta_slow") or 1)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency (high-frequency dims), 0: interpolate
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attention_factor)


class MLAttention(CheckpointViews, nn.Module):
    """Multi-head latent attention in absorbed form, laid out for decode.

    ``qkv_a`` ``[q_lora + 576, D]`` packs q_a_proj (or, without a q LoRA, q_proj) with
    kv_a_proj_with_mqa: one GEMM (with a q LoRA, as partial sums over parts of D where that fills the
    SMs: gemv.linear_parts), then one kernel (ops.mla_latents, which adds the parts) for both latent
    norms and the rope of the cache row, which that kernel writes into the cache where the backend's
    kv_rows says (its forward then takes kv_new None). W_UK / W_UV are views of kv_b_proj's weight
    ``[H, nope + v, 512]``, multiplied per head where the query is assembled (ops.mla_query) and
    by ops.mla_value, which writes o_proj's input (no per-call copy of the weight). Under tensor
    parallelism a rank holds num_attention_heads / tp heads (q_b_proj, kv_b_proj, o_proj sliced by
    head); the one shared latent KV head (qkv_a, the latent norms) is every rank's.
    """

    _packed = ("qkv_a",)
    writes_kv_rows = True  # the latents kernel writes the pass's cache rows where the backend's kv_rows says

    def __init__(self, cfg: DeepseekV3Config, kv_layer_id: int, parallel: Parallel = SINGLE,
                 dtype: Optional[torch.dtype] = None, device: Any = None) -> None:
        super().__init__()
        self.cfg, self.kv_layer_id = cfg, kv_layer_id
        fk = _factory(dtype, device)
        self.num_heads = h = local_heads(cfg, parallel)
        d = cfg.hidden_size
        q_name, self.q_rank = ("q_proj", h * cfg.qk_head_dim) if cfg.q_lora_rank is None else ("q_a_proj", cfg.q_lora_rank)
        self._sections = {f"{q_name}.weight": self.q_rank,
                          "kv_a_proj_with_mqa.weight": cfg.kv_lora_rank + cfg.qk_rope_head_dim}
        self.qkv_a = nn.Parameter(torch.empty(sum(self._sections.values()), d, **fk))
        for w in row_views(self.qkv_a.data, self._sections).values():  # as separate nn.Linear would
            nn.init.kaiming_uniform_(w, a=5 ** 0.5)
        if cfg.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, **fk)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False, **fk)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, **fk)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, **fk)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=False, **fk)

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        return row_views(self.qkv_a, self._sections)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend, batch: AttnBatch) -> torch.Tensor:
        """x ``[T, D]`` -> ``[T, D]``, this rank's heads' part of the output (the layer sums the
        ranks'); this layer's latent KV rows ``[T, 576]`` go to the cache (the latents kernel where
        the backend's kv_rows says, else the backend)."""
        cfg = self.cfg
        h, nope, rank = self.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q_norm = None if cfg.q_lora_rank is None else self.q_a_layernorm.weight
        qkv = gemv.linear(x, self.qkv_a) if q_norm is None else gemv.linear_parts(x, self.qkv_a)
        kv_rows = getattr(backend, "kv_rows", None) if self.writes_kv_rows else None
        cache = kv_rows(self.kv_layer_id, batch, x.dtype, x.shape[0], h) if kv_rows is not None else None
        q_a, kv_new = ops.mla_latents(qkv, self.q_rank, q_norm, self.kv_a_layernorm.weight, LATENT_NORM_EPS, *rope,
                                      cfg.rope_interleave, cache)  # kv_new None: the rows are in the cache
        q = q_a if cfg.q_lora_rank is None else gemv.linear(q_a, self.q_b_proj.weight)
        q = q.view(-1, h, cfg.qk_head_dim)  # [T, H, nope + 64]
        w_uk, w_uv = self.kv_b_proj.weight.view(h, nope + cfg.v_head_dim, rank).split([nope, cfg.v_head_dim], dim=1)
        query = ops.mla_query(q, w_uk, *rope, cfg.rope_interleave)  # [T, H, 576]
        out = self.attend(query, kv_new, backend, batch, x, q_a, rope)  # [T, H, 512]
        return gemv.linear(ops.mla_value(out.to(x.dtype), w_uv), self.o_proj.weight)  # [T, H * v] @ o_proj

    def attend(self, query: torch.Tensor, kv_new: Optional[torch.Tensor], backend, batch: AttnBatch, x: torch.Tensor,
               q_a: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The backend call: query ``[T, H, 576]`` over every row it sees -> ``[T, H, 512]``. The
        extension point of sparse attention (deepseek_v32), which also reads the layer input x
        ``[T, D]`` and the normed q latent q_a ``[T, q_lora_rank]``."""
        return backend.forward(query, kv_new, self.kv_layer_id, batch)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); the MLP is MoE per config.is_moe_layer.
    Under tensor parallelism each of the two sums its ranks' parts in one all-reduce. The norm after
    the layer is the next one's input norm (or the model's final norm), which the MLP computes in
    its own last kernel where it can (ops.AddNorm): its input norm is the layer before's.

    layer_idx: position in the checkpoint (decides dense vs MoE); kv_layer_id: the KV pool layer
    its attention reads and writes (the MTP layer uses 0 of the draft's own pool); attention: its
    class (MLAttention or a subclass: V3.2's sparse one).
    """

    def __init__(self, cfg: DeepseekV3Config, layer_idx: int, kv_layer_id: int, parallel: Parallel = SINGLE,
                 dtype: Optional[torch.dtype] = None, device: Any = None, attention: type = MLAttention) -> None:
        super().__init__()
        fk = _factory(dtype, device)
        self.parallel = parallel
        self.self_attn = attention(cfg, kv_layer_id, parallel, **fk)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, parallel, **fk)
        else:
            self.mlp = MLP(cfg.hidden_size, parallel.shard(cfg.intermediate_size, "intermediate_size")[1], **fk)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **fk)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **fk)

    def forward(self, h: torch.Tensor, residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend,
                batch: AttnBatch, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) ``[T, D]`` each: the stream (residual) and its input norm (h =
        input_layernorm(residual)) -> the same after this layer, h by ``next_norm``."""
        attn = self.parallel.all_reduce(self.self_attn(h, rope, backend, batch))
        h, residual = self.post_attention_layernorm.residual(attn, residual)
        if self.parallel.size == 1:
            return self.mlp(h, then=next_norm.after(residual))
        return next_norm.residual(self.parallel.all_reduce(self.mlp(h)), residual)


def logits_and_picks(model: nn.Module, hidden: torch.Tensor, head: torch.Tensor):
    """A model's compute_logits_argmax, for one whose compute_logits is its parallel's all_gather of
    linear(hidden, head) in fp32: (the logits, gemv.HeadPick from the head's GEMV), or
    (model.compute_logits(hidden), None) where another kernel computes the logits or the
    vocabulary is sharded."""
    if model.parallel.size > 1 or not gemv.streams(hidden, head):
        return model.compute_logits(hidden), None
    return gemv.triton_linear_argmax(hidden, head)


# ------------------------------------------------------------------------------------- models
class DeepseekV3Model(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's ``model.*``)."""

    def __init__(self, cfg: DeepseekV3Config, parallel: Parallel = SINGLE, dtype: Optional[torch.dtype] = None,
                 device: Any = None, attention: type = MLAttention) -> None:
        super().__init__()
        fk = _factory(dtype, device)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, parallel, **fk)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, i, parallel, **fk, attention=attention)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **fk)


class DeepseekV3ForCausalLM(nn.Module):
    """The target model, built at any size from the config (randomly initialised; see loader).

    forward(input_ids ``[T]`` int64, positions ``[T]`` int64, backend, batch) -> hidden ``[T, D]``
    after the final norm, in the model dtype. Tokens of all requests are packed along T as the
    batch describes; KV layer i of the backend's pool is decoder layer i.

    parallel: this process's tensor-parallel slice (specdec.parallel); every rank returns the same
    hidden states and the same full-vocabulary logits.
    """

    attention: type = MLAttention  # every decoder layer's attention class (V3.2: its sparse subclass)

    def __init__(self, config: DeepseekV3Config, dtype: Optional[torch.dtype] = None, device: Any = None,
                 parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.config, self.parallel = config, parallel
        self.model = DeepseekV3Model(config, parallel, dtype, device, self.attention)
        vocab = parallel.shard(config.vocab_size, "vocab_size")[1]
        self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, device)

    @property
    def embed_tokens(self) -> "VocabEmbedding":
        return self.model.embed_tokens

    @property
    def num_attention_layers(self) -> int:
        """KV layers the pool needs."""
        return self.config.num_hidden_layers

    def attn_spec(self) -> LayerSpec:
        """This rank's heads (all of them in one process) and the softmax scale."""
        return LayerSpec(local_heads(self.config, self.parallel), softmax_scale(self.config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend, batch: AttnBatch) -> torch.Tensor:
        check_inputs(input_ids, positions, self.config.vocab_size)
        rope = self.rotary(positions)
        layers = self.model.layers
        first = layers[0].input_layernorm
        if self.parallel.size == 1:  # the lookup and the first norm in one kernel
            h, residual = ops.embed_norm(input_ids, self.embed_tokens.weight, first.weight, first.eps)
        else:
            h, residual = first.residual(self.embed_tokens(input_ids), None)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, residual = layer(h, residual, rope, backend, batch, next_norm)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, D]`` -> logits ``[N, vocab]`` fp32 (every rank's vocabulary slice, gathered)."""
        return self.parallel.all_gather(gemv.linear(hidden, self.lm_head.weight, torch.float32))

    def compute_logits_argmax(self, hidden: torch.Tensor):
        """(compute_logits(hidden), the rows' greedy picks or None): logits_and_picks."""
        return logits_and_picks(self, hidden, self.lm_head.weight)
