"""benchmarks/scale.py's model: one TP8 rank's slice of DeepSeek-V3 (rank_slice_config, build_models)
and the bytes a pass over it must read (target_pass_bytes, mtp_pass_bytes, step_floor_bytes),
counted from the config alone, so the floor does not depend on how the model packs its weights."""


from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch
from torch import nn

from attn.base import KV_DIM
from specdec.models import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM
from specdec.parallel import SINGLE, Parallel

VARIANTS = ("dense", "moe")
INIT_STD = 0.02

# DeepSeek-V3's own rope scaling (its config.json), so the rotary work is the real model's.
V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
           "mscale": 1.0, "mscale_all_dim": 1.0}
# One TP8 rank of DeepSeek-V3: 128 / 8 heads, 18432 / 8 and 2048 / 8 intermediate, 129280 / 8 vocabulary.
RANK_SLICE = dict(vocab_size=16160, hidden_size=7168, intermediate_size=2304, num_attention_heads=16, q_lora_rank=1536,
                  kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                  max_position_embeddings=163840, rope_scaling=V3_YARN)
RANK_SLICE_MOE = dict(n_routed_experts=64, moe_intermediate_size=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                      n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=3)
# --smoke: the same structure at CPU size (latent 512 and rope 64 are fixed by the cache).
SMOKE = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_attention_heads=4, q_lora_rank=128,
             kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=4096,
             rope_scaling=V3_YARN)
SMOKE_MOE = dict(n_routed_experts=8, moe_intermediate_size=64, num_experts_per_tok=2, n_group=4, topk_group=2,
                 n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1)

# ----------------------------------------------------------------------------------------- the models
def rank_slice_config(variant: str, layers: int = 61, smoke: bool = False) -> DeepseekV3Config:
    """The ``dense`` or ``moe`` rank slice (RANK_SLICE, RANK_SLICE_MOE) with ``layers`` decoder
    layers; ``smoke``: the same structure at CPU size (SMOKE, SMOKE_MOE)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    dims, moe = (SMOKE, SMOKE_MOE) if smoke else (RANK_SLICE, RANK_SLICE_MOE)
    routing = dict(moe, first_k_dense_replace=min(moe["first_k_dense_replace"], layers)) if variant == "moe" \
        else dict(n_routed_experts=0)
    return DeepseekV3Config(num_hidden_layers=layers, **dims, **routing)


@torch.no_grad()
def init_random_(params: Sequence[nn.Parameter], std: float = INIT_STD) -> None:
    """In place, on the parameters' own device: matrices (and stacked experts) normal(0, std),
    vectors (the RMS norms' weights) ones. Routers get normal weights too: with unit-RMS inputs their
    logits spread over about +-std * sqrt(hidden), so tokens choose varied experts."""
    for p in params:
        if p.dim() >= 2:
            p.normal_(0.0, std)
        else:
            p.fill_(1.0)


def rank_config(cfg: DeepseekV3Config, tp: int) -> DeepseekV3Config:
    """What one of ``tp`` tensor-parallel ranks of ``cfg`` holds, as a config: 1/tp of the heads,
    of every MLP's and expert's intermediate and of the vocabulary (the latent projections, norms,
    routers and the KV rows stay whole), so the floor's accounting counts a rank's bytes. E.g. the
    rank slice at tp 2: 8 heads, intermediate 1152, experts of 128, vocabulary 8080."""
    if tp == 1:
        return cfg
    return replace(cfg, num_attention_heads=cfg.num_attention_heads // tp, intermediate_size=cfg.intermediate_size // tp,
                   moe_intermediate_size=cfg.moe_intermediate_size // tp, vocab_size=cfg.vocab_size // tp)


def build_models(cfg: DeepseekV3Config, dtype: torch.dtype, device: str,
                 parallel: Parallel = SINGLE) -> tuple[DeepseekV3ForCausalLM, DeepseekMTP]:
    """The target and its MTP draft (embedding and head shared with the target), random weights
    initialised where they live (init_random_), in eval mode; ``parallel``: this rank's shard.
    Every rank draws the same numbers (equal shards, one seed), so replicated weights agree."""
    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(cfg, dtype=dtype, device=device, parallel=parallel).eval()
    init_random_(list(target.parameters()))
    draft = DeepseekMTP(cfg, target=target, dtype=dtype, device=device, parallel=parallel).eval()
    init_random_(own_parameters(draft, target))
    return target, draft


def own_parameters(draft: nn.Module, target: nn.Module) -> list[nn.Parameter]:
    """The draft's parameters that are not the target's (an MTP head shares embedding and head)."""
    shared = {id(p) for p in target.parameters()}
    return [p for p in draft.parameters() if id(p) not in shared]


def param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def moe_blocks(target: DeepseekV3ForCausalLM, draft: DeepseekMTP) -> tuple[list[nn.Module], list[nn.Module]]:
    """The MoE blocks (``layer.mlp``) of the target's MoE layers, in layer order, and the draft's
    (its layer is layer num_hidden_layers of the config)."""
    cfg = target.config
    layers = target.model.layers
    targets = [layers[i].mlp for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    drafts = [draft.layer.mlp] if cfg.is_moe_layer(cfg.num_hidden_layers) else []
    return targets, drafts


# ------------------------------------------------------------------------------- the floor's bytes
# Parameter counts from the config alone, so the floor does not depend on how the model packs
# its weights; check_param_counts holds them to the built model.
def attention_params(cfg: DeepseekV3Config) -> int:
    """One MLA layer: query (low-rank with its norm, or plain), kv_a with its latent norm, kv_b, o_proj."""
    h, d = cfg.num_attention_heads, cfg.hidden_size
    if cfg.q_lora_rank is None:
        q = d * h * cfg.qk_head_dim
    else:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    return q + kv + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d


def expert_params(cfg: DeepseekV3Config) -> int:
    """One routed expert: gate, up and down, moe_intermediate_size wide."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def layer_params(cfg: DeepseekV3Config, layer_idx: int, routed_experts: Optional[int] = None) -> int:
    """Decoder layer ``layer_idx``'s parameters: attention, its two norms, the MLP; of a MoE layer
    the router, the shared experts and ``routed_experts`` routed experts (None: all of them)."""
    d = cfg.hidden_size
    n = attention_params(cfg) + 2 * d
    if not cfg.is_moe_layer(layer_idx):
        return n + 3 * d * cfg.intermediate_size
    routed = cfg.n_routed_experts if routed_experts is None else routed_experts
    shared = 3 * d * cfg.moe_intermediate_size * cfg.n_shared_experts
    return n + cfg.n_routed_experts * d + shared + routed * expert_params(cfg)


def target_params(cfg: DeepseekV3Config) -> int:
    """The whole target: embedding, layers, final norm, LM head (once if tied)."""
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (cfg.vocab_size * cfg.hidden_size + sum(layer_params(cfg, i) for i in range(cfg.num_hidden_layers))
            + cfg.hidden_size + head)


def mtp_params(cfg: DeepseekV3Config) -> int:
    """The MTP layer's own parameters (its embedding and head are the target's): enorm, hnorm,
    eh_proj, its decoder layer, shared_head.norm."""
    d = cfg.hidden_size
    return 3 * d + 2 * d * d + layer_params(cfg, cfg.num_hidden_layers)


def check_param_counts(target: nn.Module, draft: nn.Module, tp: int = 1) -> Optional[str]:
    """None where the built models (one of ``tp`` ranks' shards) hold the parameters the floor
    counts, else what differs."""
    cfg = rank_config(target.config, tp)
    got = (sum(p.numel() for p in target.parameters()), sum(p.numel() for p in own_parameters(draft, target)))
    want = (target_params(cfg), mtp_params(cfg))
    if got == want:
        return None
    return f"the models hold {got} (target, MTP) parameters, the floor's accounting {want}"


def router_bias_bytes(cfg: DeepseekV3Config) -> int:
    """e_score_correction_bias: a buffer, fp32, read by each MoE layer's router."""
    return 4 * cfg.n_routed_experts if cfg.has_moe else 0


def moe_layer_ids(cfg: DeepseekV3Config) -> list[int]:
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


def target_pass_bytes(cfg: DeepseekV3Config, tokens: int, experts: Sequence[int], kv_rows: int,
                      weight_bytes: int = 2, kv_bytes: int = 2) -> int:
    """Bytes one target forward over ``tokens`` tokens must read: every weight but the routed
    experts, the ``experts[m]`` distinct experts its tokens chose in MoE layer m (in layer order),
    the embedding rows, and ``kv_rows`` KV rows (summed over requests) in every layer.

    E.g. dense, 1 token at N = 1023: all weights but vocab - 1 embedding rows, and 1024 KV rows
    of 576 a layer."""
    moe = moe_layer_ids(cfg)
    if len(experts) != len(moe):
        raise ValueError(f"experts holds {len(experts)} counts; the config has {len(moe)} MoE layers")
    chosen = dict(zip(moe, experts))
    layers = sum(layer_params(cfg, i, chosen.get(i)) for i in range(cfg.num_hidden_layers))
    head = cfg.vocab_size * cfg.hidden_size
    weights = (tokens * cfg.hidden_size + layers + cfg.hidden_size + head) * weight_bytes
    return weights + len(moe) * router_bias_bytes(cfg) + kv_rows * KV_DIM * kv_bytes * cfg.num_hidden_layers


def mtp_pass_bytes(cfg: DeepseekV3Config, tokens: int, experts: Optional[int], kv_rows: int,
                   weight_bytes: int = 2, kv_bytes: int = 2) -> int:
    """Bytes one MTP-layer forward over ``tokens`` tokens and its logits must read: its own
    weights (``experts`` distinct routed experts when its layer is MoE), the embedding rows, the
    shared LM head, and ``kv_rows`` rows of its one KV layer."""
    moe = cfg.is_moe_layer(cfg.num_hidden_layers)
    if moe and experts is None:
        raise ValueError("the MTP layer is MoE: give the distinct experts its tokens chose")
    d = cfg.hidden_size
    own = 3 * d + 2 * d * d + layer_params(cfg, cfg.num_hidden_layers, experts if moe else None)
    weights = (tokens * d + own + cfg.vocab_size * d) * weight_bytes
    return weights + (router_bias_bytes(cfg) if moe else 0) + kv_rows * KV_DIM * kv_bytes


@dataclass
class Pass:
    """One forward of a step as the taps saw it: ``model`` "target" or "mtp", its tokens, and the
    distinct routed experts chosen in each of its MoE layers (layer order; empty if dense)."""

    model: str
    tokens: int
    experts: list[int] = field(default_factory=list)


def step_floor_bytes(cfg: DeepseekV3Config, passes: Sequence[Pass], batch: int, kv_len: float,
                     weight_bytes: int = 2, kv_bytes: int = 2) -> int:
    """Bytes a step of these passes must read, each request at KV length ``kv_len`` (N): a pass
    of T tokens reads batch * N + T KV rows a layer (the prefix and its own rows)."""
    total = 0
    for p in passes:
        rows = round(batch * kv_len) + p.tokens
        if p.model == "target":
            total += target_pass_bytes(cfg, p.tokens, p.experts, rows, weight_bytes, kv_bytes)
        elif p.model == "mtp":
            total += mtp_pass_bytes(cfg, p.tokens, p.experts[0] if p.experts else None, rows, weight_bytes, kv_bytes)
        else:
            raise ValueError(f"a pass's model is 'target' or 'mtp', got {p.model!r}")
    return total


def floor_us(num_bytes: float, bandwidth: float) -> float:
    """The time to read ``num_bytes`` at ``bandwidth`` bytes/s, in us."""
    return num_bytes / bandwidth * 1e6
