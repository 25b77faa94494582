"""DeepseekV3Config / DeepseekV32Config: the fields of an HF DeepSeek-V3 / V3.2 ``config.json``,
validated up front."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from attn.base import KV_LORA_RANK, QK_ROPE_DIM
from attn.values import is_finite_real, is_int, is_positive_finite

_YARN_REQUIRED = ("factor", "original_max_position_embeddings")
_YARN_OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


@dataclass
class DeepseekV3Config:
    """Model shape and routing settings; defaults are those of the public DeepSeek-V3 release.

    q_lora_rank: None means a plain ``q_proj`` (no low-rank query).
    n_routed_experts: 0 or None makes every layer dense (SwiGLU MLP of intermediate_size).
    rope_scaling: None or a YaRN dict (``type`` or ``rope_type`` "yarn", factor,
        original_max_position_embeddings, and optionally beta_fast, beta_slow, mscale,
        mscale_all_dim, attention_factor, truncate).
    rope_interleave: the rope dims of q_b_proj / kv_a_proj_with_mqa are stored as interleaved
        pairs (the public checkpoint's layout; transformers' default).
    num_nextn_predict_layers: MTP layers stored after the decoder layers (0 or 1 here).
    quantization_config: must be None; FP8 block-quantised checkpoints need dequantising first.
    """

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: Optional[int] = None  # unused by MLA (kept for transformers); None: num_attention_heads
    q_lora_rank: Optional[int] = 1536
    kv_lora_rank: int = KV_LORA_RANK
    qk_rope_head_dim: int = QK_ROPE_DIM
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_routed_experts: Optional[int] = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    quantization_config: Optional[dict[str, Any]] = None

    _model_types = ("deepseek_v3", "kimi_k2")  # config.json model_types read (not fields: no annotation)
    _architecture = "DeepseekV3ForCausalLM"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        """Width of the un-absorbed query/key head (nope + rope); the softmax scale uses it."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn(self) -> Optional[dict[str, Any]]:
        """The YaRN rope_scaling dict, or None without scaling."""
        return self.rope_scaling

    @property
    def has_moe(self) -> bool:
        return bool(self.n_routed_experts)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` (the MTP layer is ``num_hidden_layers``) is MoE."""
        return self.has_moe and layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ValueError naming the first field this implementation cannot run."""
        self._validate_types()
        if self.kv_lora_rank != KV_LORA_RANK or self.qk_rope_head_dim != QK_ROPE_DIM:
            raise ValueError(
                f"kv_lora_rank must be {KV_LORA_RANK} and qk_rope_head_dim {QK_ROPE_DIM}: the attention backends use a "
                f"{KV_LORA_RANK + QK_ROPE_DIM}-wide latent cache; got kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "qk_nope_head_dim", "v_head_dim", "max_position_embeddings"):
            _check(getattr(self, name) > 0, name, "must be positive", getattr(self, name))
        _check(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", "must be positive or None", self.q_lora_rank)
        _check(self.hidden_act == "silu", "hidden_act", "must be 'silu'", self.hidden_act)
        _check(not self.attention_bias, "attention_bias", "must be False (DeepSeek-V3 has no attention biases)", self.attention_bias)
        _check(self.quantization_config is None, "quantization_config",
               "must be absent: the loader takes 16/32-bit weights; dequantise an FP8 checkpoint to bf16 (e.g. "
               "DeepSeek's fp8_cast_bf16.py) and delete quantization_config from its config.json", self.quantization_config)
        _check(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive", self.rms_norm_eps)
        _check(self.rope_theta > 0, "rope_theta", "must be positive", self.rope_theta)
        _check(self.num_nextn_predict_layers in (0, 1), "num_nextn_predict_layers", "must be 0 or 1", self.num_nextn_predict_layers)
        if self.has_moe:
            self._validate_moe()
        if self.rope_scaling is not None:
            self._validate_yarn()

    def _validate_types(self) -> None:
        """Each field of the type its annotation names (a JSON null, a string or a float where an int
        belongs failed later, in torch or in math, naming no field); ints pass for floats."""
        checks = {"int": is_int, "float": is_finite_real,
                  "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
                  "dict": lambda v: isinstance(v, dict)}
        for f in fields(self):
            kind, value = str(f.type), getattr(self, f.name)
            optional = kind.startswith("Optional[")
            base = (kind[len("Optional["):-1] if optional else kind).split("[")[0]
            if not (optional and value is None):
                article = "an" if base == "int" else "a"
                _check(checks[base](value), f.name, f"must be {'None or ' if optional else ''}{article} {base}", value)

    def _validate_moe(self) -> None:
        e = self.n_routed_experts
        _check(self.scoring_func == "sigmoid", "scoring_func", "must be 'sigmoid'", self.scoring_func)
        _check(self.topk_method == "noaux_tc", "topk_method", "must be 'noaux_tc'", self.topk_method)
        _check(self.n_group > 0 and e % self.n_group == 0, "n_group", f"must divide n_routed_experts ({e})", self.n_group)
        # Group scores are the sum of each group's two best experts.
        _check(e // self.n_group >= 2, "n_group", f"must leave at least 2 experts per group (n_routed_experts={e})", self.n_group)
        _check(0 < self.topk_group <= self.n_group, "topk_group", f"must be in [1, n_group={self.n_group}]", self.topk_group)
        selectable = self.topk_group * e // self.n_group
        _check(0 < self.num_experts_per_tok <= selectable, "num_experts_per_tok",
               f"must be in [1, topk_group * experts per group = {selectable}]", self.num_experts_per_tok)
        # Scales the routed experts' weights; a negative or zero factor flips or drops their output.
        _check(self.routed_scaling_factor > 0, "routed_scaling_factor", "must be positive", self.routed_scaling_factor)
        _check(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive", self.moe_intermediate_size)
        _check(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0", self.n_shared_experts)
        _check(self.first_k_dense_replace >= 0, "first_k_dense_replace", "must be >= 0", self.first_k_dense_replace)
        _check(self.moe_layer_freq >= 1, "moe_layer_freq", "must be >= 1", self.moe_layer_freq)

    def _validate_yarn(self) -> None:
        rs = self.rope_scaling
        kind = rs.get("rope_type", rs.get("type"))
        _check(kind == "yarn", "rope_scaling", "must be None or a YaRN dict (type 'yarn')", rs)
        missing = [k for k in _YARN_REQUIRED if k not in rs]
        _check(not missing, "rope_scaling", f"needs {missing}", rs)
        factor, original = rs["factor"], rs["original_max_position_embeddings"]
        _check(is_positive_finite(factor), "rope_scaling", "needs a positive factor", rs)
        _check(is_int(original) and original > 0, "rope_scaling",
               "needs a positive int original_max_position_embeddings", rs)
        # Optional. A null or 0 beta takes transformers' default (beta_fast 32, beta_slow 1); a null or
        # 0 mscale the plain YaRN factor, and mscale_all_dim no softmax scaling; an attention_factor
        # multiplies cos and sin as given. A negative beta failed in math.log when the model was
        # built, a string in arithmetic.
        for key in _YARN_OPTIONAL:
            value, positive = rs.get(key), key == "attention_factor"
            _check(value is None or (is_finite_real(value) and (value > 0 if positive else value >= 0)), "rope_scaling",
                   f"needs {key} {'a positive' if positive else 'a non-negative'} number or null", rs)
        _check(rs.get("truncate") is None or isinstance(rs["truncate"], bool), "rope_scaling",
               "needs truncate a bool or null", rs)

    # ---------------------------------------------------------------------- I/O
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekV3Config":
        """From a config.json dict; unknown keys are ignored. Reads both the public release's
        ``rope_theta`` + ``rope_scaling`` and transformers 5's ``rope_parameters``. A model_type
        other than DeepSeek-V3's or Kimi K2's is refused: missing fields would take V3's defaults."""
        if not isinstance(d, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
        kind = d.get("model_type")
        if kind is not None and kind not in cls._model_types:
            raise ValueError(f"config.json: model_type {kind!r} is not one {cls.__name__} reads {cls._model_types} "
                             f"({cls._architecture}'s architecture)")
        d = dict(d)
        params = d.pop("rope_parameters", None)
        if params:
            d.setdefault("rope_theta", params.get("rope_theta", cls.rope_theta))
            d.setdefault("rope_scaling", {k: v for k, v in params.items() if k != "rope_theta"})
        scaling = d.get("rope_scaling")
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
            d["rope_scaling"] = None
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, path: str) -> "DeepseekV3Config":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """A config.json dict in the public release's form (transformers reads it too)."""
        d = asdict(self)
        d.pop("quantization_config")  # always None here
        return {"architectures": [self._architecture], "model_type": self._model_types[0], **d}


@dataclass
class DeepseekV32Config(DeepseekV3Config):
    """DeepSeek-V3.2 (DeepSeek Sparse Attention): V3's fields and its lightning indexer's, named as in
    transformers' DeepseekV32Config; defaults are the public release's.

    index_n_heads: indexer query heads. index_head_dim: the width of its queries and cached keys,
        the first qk_rope_head_dim dims rotated (half-split rope). index_topk: the cache rows each
        query token attends to, the indexer's best (all it sees when it sees fewer).
    The indexer's queries project the q LoRA latent, so q_lora_rank must be set.
    """

    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048

    _model_types = ("deepseek_v32",)
    _architecture = "DeepseekV32ForCausalLM"

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        _check(self.q_lora_rank is not None, "q_lora_rank", "must be set: the indexer's queries project the q LoRA "
               "latent (wq_b)", self.q_lora_rank, name)
        _check(self.index_n_heads > 0, "index_n_heads", "must be positive", self.index_n_heads, name)
        _check(self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim",
               f"must be >= qk_rope_head_dim ({self.qk_rope_head_dim}, the dims it rotates)", self.index_head_dim, name)
        _check(self.index_topk > 0, "index_topk", "must be positive", self.index_topk, name)


def _check(ok: bool, name: str, rule: str, value: Any, owner: str = "DeepseekV3Config") -> None:
    if not ok:
        raise ValueError(f"{owner}.{name} {rule}; got {value!r}")
