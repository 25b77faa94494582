"""specdec.models against transformers' DeepSeek-V3, HF-format I/O, and input/config validation.

Our models run through the torch_ref backend over a paged MLAKVPool: a batched prefill (EXTEND)
of two requests, then one-token DECODE steps; every position's output is compared with the
reference run over the whole sequence at once.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from attn.backends.torch_ref import TorchRefBackend
from attn.base import AttnBatch, ForwardMode
from specdec.kv import MLAKVPool
from specdec.models.loader import _holds
from specdec.parallel import SINGLE
from specdec.models import (
    CheckpointError, DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM, load_deepseek, load_mtp, save_deepseek,
    validate_token_ids,
)

TINY = dict(vocab_size=80, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
            v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
            first_k_dense_replace=1, max_position_embeddings=256)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
            mscale=0.8, mscale_all_dim=1.0)  # mscale != mscale_all_dim: cos/sin and softmax scale both change
PAGE = 4
PREFILL = [7, 5]  # two requests, prefilled together, then DECODE_STEPS tokens each
DECODE_STEPS = 3

# step(ids [T], positions [T], request index of each token [T], backend, batch) -> output [T, X]
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, TorchRefBackend, AttnBatch], torch.Tensor]


# ------------------------------------------------------------------------------------ helpers
def run_paged(step: Step, num_layers: int, spec, seqs: list[list[int]], **pool_options) -> list[torch.Tensor]:
    """Outputs ``[len(seq), X]`` per sequence: one EXTEND over PREFILL tokens of every sequence,
    then DECODE_STEPS batched one-token steps. pool_options: MLAKVPool's (index_head_dim)."""
    pool = MLAKVPool(num_layers, num_pages=16, page_size=PAGE, max_requests=4, max_context_len=32, dtype=torch.float32,
                     **pool_options)
    rows = [pool.alloc_request() for _ in seqs]
    backend = TorchRefBackend(pool.view(), spec, max_batch_size=8, max_q_len=8)
    for row, seq in zip(rows, seqs):
        pool.ensure_capacity(row, len(seq))
    pieces = [[(0, n)] + [(p, p + 1) for p in range(n, n + DECODE_STEPS)] for n in PREFILL]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for k in range(DECODE_STEPS + 1):
        spans = [p[k] for p in pieces]
        mode = ForwardMode.EXTEND if k == 0 else ForwardMode.DECODE
        batch = AttnBatch(
            mode, req_pool_indices=torch.tensor(rows),
            seq_lens=torch.tensor([end for _, end in spans], dtype=torch.int32),
            out_cache_loc=torch.cat([pool.req_to_token[r, s:e].long() for r, (s, e) in zip(rows, spans)]),
            cu_seqlens_q=torch.tensor([0] + [e - s for s, e in spans], dtype=torch.int32).cumsum(0, dtype=torch.int32),
            max_q_len=max(e - s for s, e in spans), uniform_q_len=k > 0,
        )
        backend.init_forward_metadata(batch)
        ids = torch.cat([torch.tensor(seq[s:e]) for seq, (s, e) in zip(seqs, spans)])
        positions = torch.cat([torch.arange(s, e) for s, e in spans])
        req = torch.cat([torch.full((e - s,), i) for i, (s, e) in enumerate(spans)])
        with torch.no_grad():
            out = step(ids, positions, req, backend, batch)
        for i, part in enumerate(out.split([e - s for s, e in spans])):
            outs[i].append(part)
    return [torch.cat(o) for o in outs]


def target_logits(model: DeepseekV3ForCausalLM, seqs: list[list[int]]) -> list[torch.Tensor]:
    """run_paged of the model's logits, over a pool with the indexer keys a sparse (V3.2) model needs."""
    return run_paged(lambda ids, pos, req, backend, batch: model.compute_logits(model(ids, pos, backend, batch)),
                     model.num_attention_layers, model.attn_spec(), seqs,
                     index_head_dim=model.attn_spec().index_head_dim)


def assert_matches_reference(ref: torch.nn.Module, seqs: list[list[int]], got: list[torch.Tensor]) -> None:
    """Each sequence's logits ``got`` equal transformers' ``ref`` over the whole sequence at once."""
    for seq, logits in zip(seqs, got):
        with torch.no_grad():
            expected = ref(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def sequences(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n + DECODE_STEPS,), generator=g).tolist() for n in PREFILL]


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Unit-scale weights, norms away from 1, a routing bias that changes choices: so every weight,
    the rope and the grouped routing visibly affect the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # matrices (fused experts too): 1/sqrt(fan_in); the embedding: unit
                std = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))


def hf_layer_state(layer: torch.nn.Module, num_experts: int) -> dict[str, torch.Tensor]:
    """A transformers decoder layer's weights in the checkpoint layout: its in-memory fused
    experts (gate_up_proj [E, 2I, D], down_proj [E, D, I]) split per expert."""
    state = dict(layer.state_dict())
    if "mlp.experts.gate_up_proj" in state:
        gate_up, down = state.pop("mlp.experts.gate_up_proj"), state.pop("mlp.experts.down_proj")
        for e in range(num_experts):
            gate, up = gate_up[e].chunk(2, dim=0)
            state |= {f"mlp.experts.{e}.gate_proj.weight": gate, f"mlp.experts.{e}.up_proj.weight": up,
                      f"mlp.experts.{e}.down_proj.weight": down[e]}
    return state


def causal_mask(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


# --------------------------------------------------------------------- equivalence with HF
@pytest.mark.parametrize("variant", [
    dict(q_lora_rank=48, rope_parameters=dict(rope_theta=10000.0, **YARN)),
    dict(q_lora_rank=None, qk_nope_head_dim=128, v_head_dim=128, rope_interleave=False, num_attention_heads=2),
    dict(q_lora_rank=32, n_group=2, topk_group=1, num_hidden_layers=2, rope_parameters=dict(rope_type="default", rope_theta=500.0)),
    dict(q_lora_rank=48, rms_norm_eps=1e-2),  # the latent norms keep eps 1e-6 whatever rms_norm_eps is, as transformers' do
], ids=["qlora-yarn", "qproj-nope128-halfsplit", "sharded-2groups", "rms-eps-1e-2"])
def test_logits_match_transformers(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.DeepseekV3Config(**{**TINY, **variant})
    hf_cfg.num_key_value_heads = hf_cfg.num_attention_heads
    ref = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    randomize(ref, seed=0)
    ref.save_pretrained(tmp_path, **({"max_shard_size": "100KB"} if "n_group" in variant else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == ("n_group" in variant)

    ours = load_deepseek(str(tmp_path), torch.float32)
    routed_inputs = []
    ours.model.layers[1].mlp.gate.register_forward_hook(lambda mod, args, out: routed_inputs.append(args[0]))
    seqs = sequences(TINY["vocab_size"])
    assert_matches_reference(ref, seqs, target_logits(ours, seqs))

    # The grouped top-k (with the correction bias) chose differently from a plain top-k somewhere.
    gate = ours.model.layers[1].mlp.gate
    x = torch.cat(routed_inputs)
    _, grouped = gate(x)
    plain = (torch.sigmoid(x @ gate.weight.T) + gate.e_score_correction_bias).topk(hf_cfg.num_experts_per_tok).indices
    assert (grouped.sort(-1).values != plain.sort(-1).values).any()


def test_mtp_matches_composition_of_transformers_modules(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    hf_cfg = transformers.DeepseekV3Config(**{**TINY, "num_hidden_layers": 1, "q_lora_rank": 48,
                                              "rope_parameters": dict(rope_theta=10000.0, **YARN)})
    n, d, vocab = hf_cfg.num_hidden_layers, hf_cfg.hidden_size, hf_cfg.vocab_size
    parts = torch.nn.ModuleDict(dict(
        embed_tokens=torch.nn.Embedding(vocab, d), enorm=hf.DeepseekV3RMSNorm(d, hf_cfg.rms_norm_eps),
        hnorm=hf.DeepseekV3RMSNorm(d, hf_cfg.rms_norm_eps), eh_proj=torch.nn.Linear(2 * d, d, bias=False),
        layer=hf.DeepseekV3DecoderLayer(hf_cfg, layer_idx=n), norm=hf.DeepseekV3RMSNorm(d, hf_cfg.rms_norm_eps),
        head=torch.nn.Linear(d, vocab, bias=False),
    )).eval()
    randomize(parts, seed=2)
    rotary = hf.DeepseekV3RotaryEmbedding(hf_cfg)

    def reference(ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids_t, pos = torch.tensor(ids), torch.arange(len(ids))[None]
        x = parts.eh_proj(torch.cat([parts.enorm(parts.embed_tokens(ids_t)), parts.hnorm(hidden)], -1))[None]
        y = parts.norm(parts.layer(x, attention_mask=causal_mask(len(ids)), position_ids=pos, position_embeddings=rotary(x, pos))[0])
        return y, parts.head(y)

    prefix = f"model.layers.{n}."
    tensors = {prefix + k: v for k, v in hf_layer_state(parts.layer, hf_cfg.n_routed_experts).items()}
    tensors |= {f"{prefix}{k}.weight": getattr(parts, k).weight for k in ("embed_tokens", "enorm", "hnorm", "eh_proj")}
    tensors |= {prefix + "shared_head.norm.weight": parts.norm.weight, prefix + "shared_head.head.weight": parts.head.weight}
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
    cfg = DeepseekV3Config.from_dict({**hf_cfg.to_dict(), "num_nextn_predict_layers": 1})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))

    mtp = load_mtp(str(tmp_path), torch.float32)
    assert mtp.num_attention_layers == 1
    seqs = sequences(vocab, seed=3)
    hidden_in = [torch.randn(len(s), d, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(seqs)]
    flat_hidden = torch.cat(hidden_in)
    starts = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)

    def step(ids, pos, req, backend, batch):
        h = mtp(ids, pos, flat_hidden[starts[req] + pos], backend, batch)
        return torch.cat([h, mtp.compute_logits(h)], dim=-1)

    for cached in (False, True):  # then with eh_proj's embedding half from the per-token table
        if cached:
            held = mtp.cache_token_projection(chunk=7)  # chunks that do not divide the vocabulary
            assert held == (vocab * d + d * d) * 4 and mtp.token_table.shape == (vocab, d)
        for seq, hid, out in zip(seqs, hidden_in, run_paged(step, 1, mtp.attn_spec(), seqs)):
            with torch.no_grad():
                want_hidden, want_logits = reference(seq, hid)
            torch.testing.assert_close(out[:, :d], want_hidden, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out[:, d:], want_logits, rtol=1e-4, atol=1e-4)

    # Without its own embedding and head, the layer shares the target's (and needs target=).
    for key in ("embed_tokens.weight", "shared_head.head.weight"):
        del tensors[prefix + key]
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="target="):
        load_mtp(str(tmp_path), torch.float32)
    target = DeepseekV3ForCausalLM(cfg)
    shared = load_mtp(str(tmp_path), torch.float32, target=target)
    assert shared.embed_tokens is target.embed_tokens and shared.shared_head.head is target.lm_head
    # A target in another dtype is refused (the draft would mix both dtypes at its first forward).
    with pytest.raises(CheckpointError, match="shares the target's .*torch.float32.*asked for torch.bfloat16"):
        load_mtp(str(tmp_path), torch.bfloat16, target=target)


# --------------------------------------------------------------------------- HF round trip
@pytest.mark.parametrize("variant", [dict(q_lora_rank=32, rope_scaling=YARN), dict(q_lora_rank=None, tie_word_embeddings=True)])
def test_round_trip_with_mtp(tmp_path, variant):
    cfg = DeepseekV3Config(**{**TINY, **variant})
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    mtp = DeepseekMTP(cfg, target=model).eval()  # shares embedding and head: saved as copies
    randomize(model, seed=4)
    randomize(mtp.layer, seed=5)
    save_deepseek(model, str(tmp_path), mtp=mtp)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert ("lm_head.weight" in load_file(tmp_path / "model.safetensors")) != cfg.tie_word_embeddings

    if cfg.tie_word_embeddings:  # a tied checkpoint that also stores the head (an equal copy) loads
        tensors = load_file(tmp_path / "model.safetensors")
        save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, tmp_path / "model.safetensors")
        # A head of its own (not the embedding) under a tied config is refused, not dropped.
        own_head = tmp_path / "own_head"
        own_head.mkdir()
        (own_head / "config.json").write_text((tmp_path / "config.json").read_text())
        save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1}, own_head / "model.safetensors")
        with pytest.raises(CheckpointError, match="tie_word_embeddings=true.*lm_head.weight is not"), \
                pytest.MonkeyPatch.context() as patch:  # refused before the model is built and loaded
            patch.setattr("specdec.models.loader._copy_weights", lambda *a: pytest.fail("loaded before refusing"))
            load_deepseek(str(own_head), torch.float32)
    loaded = load_deepseek(str(tmp_path), torch.float32)
    loaded_mtp = load_mtp(str(tmp_path), torch.float32, target=loaded)
    seqs = sequences(cfg.vocab_size)
    for a, b in zip(target_logits(model, seqs), target_logits(loaded, seqs)):
        assert torch.equal(a, b)
    # With its copies of the embedding and head (the tied target's were written once), the MTP
    # loads without target= too.
    alone = load_mtp(str(tmp_path), torch.float32)
    for got in (loaded_mtp, alone):
        assert got.state_dict().keys() == mtp.state_dict().keys()
        for name, t in mtp.state_dict().items():
            assert torch.equal(got.state_dict()[name], t), name

    # transformers reads what we write and computes the same logits.
    transformers = pytest.importorskip("transformers")
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([seqs[0]])).logits[0]
    torch.testing.assert_close(target_logits(loaded, seqs)[0], expected, rtol=1e-4, atol=1e-4)


def test_checkpoint_errors_name_the_weights(tmp_path):
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY, q_lora_rank=None))
    save_deepseek(model, str(tmp_path))
    with pytest.raises(ValueError, match="no MTP layer"):
        load_mtp(str(tmp_path), torch.float32, target=model)
    good = load_file(tmp_path / "model.safetensors")
    renamed = dict(good)
    renamed["model.layers.1.mlp.gate.bias"] = renamed.pop("model.layers.1.mlp.gate.e_score_correction_bias")
    save_file(renamed, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing \['model.layers.1.mlp.gate.e_score_correction_bias'\], "
                                              r"unexpected \['model.layers.1.mlp.gate.bias'\]"):
        load_deepseek(str(tmp_path), torch.float32)

    save_file(good, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(CheckpointError, match=r"has shape \(80, 64\), config.json implies \(80, 32\)"):
        load_deepseek(str(tmp_path), torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({**config, "kv_lora_rank": 256}))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        load_deepseek(str(tmp_path), torch.float32)

    # An FP8 weight whose scale was lost (no quantization_config left to refuse): its e4m3 codes
    # would load as values.
    (tmp_path / "config.json").write_text(json.dumps(config))
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    save_file({**good, name: good[name].to(torch.float8_e4m3fn)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{name} is F8_E4M3.*dequantise"):
        load_deepseek(str(tmp_path), torch.float32)

    # Without an index json, a weight in two files is refused, naming both (neither copy is taken).
    save_file(good, tmp_path / "model.safetensors")
    save_file({"model.norm.weight": torch.zeros_like(good["model.norm.weight"])}, tmp_path / "zz-extra.safetensors")
    with pytest.raises(CheckpointError, match="model.norm.weight is in both .*model.safetensors and .*zz-extra"):
        load_deepseek(str(tmp_path), torch.float32)


def test_loader_refuses_checkpoints_it_would_load_wrong(tmp_path):
    """Checkpoints that would load as something other than they hold (or fail without saying why)
    are refused with an error naming the weight, field or file at fault."""
    cfg = DeepseekV3Config(**TINY, q_lora_rank=None)
    model = DeepseekV3ForCausalLM(cfg)
    save_deepseek(model, str(tmp_path))
    good = load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())

    # The release's block-FP8 layout (scales beside e4m3 weights), its quantization_config deleted.
    name = "model.layers.0.self_attn.kv_b_proj"
    save_file({**good, f"{name}.weight_scale_inv": torch.ones(1, 1)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"FP8 block-quantised .*{name}.weight_scale_inv.*dequantise"):
        load_deepseek(str(tmp_path), torch.float32)
    # A layer past the decoder's with no MTP layer announced is unexpected (not dropped: a truncated model).
    save_file({**good, "model.layers.3.input_layernorm.weight": good["model.norm.weight"].clone()}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected \['model.layers.3.input_layernorm.weight'\]"):
        load_deepseek(str(tmp_path), torch.float32)
    save_file(good, tmp_path / "model.safetensors")
    # Another architecture's config.json is refused (its missing fields would take V3's defaults); kimi_k2 loads.
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        load_deepseek(str(tmp_path), torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    load_deepseek(str(tmp_path), torch.float32)

    # Shards: a bad index (no weight_map, a missing shard, a shard without the weight) is refused, naming itself.
    index = tmp_path / "model.safetensors.index.json"
    for weight_map, message in (({}, None), ({"model.norm.weight": "gone.safetensors"}, r"not in .*\['gone.safetensors'\]")):
        index.write_text(json.dumps({"metadata": {}} if message is None else {"weight_map": weight_map}))
        with pytest.raises(CheckpointError, match=message or "has no weight_map"):
            load_deepseek(str(tmp_path), torch.float32)
    save_file({"model.norm.weight": good["model.norm.weight"]}, tmp_path / "shard.safetensors")
    index.write_text(json.dumps({"weight_map": {n: "shard.safetensors" for n in good}}))
    with pytest.raises(CheckpointError, match="maps .* to shard.safetensors, which does not hold it"):
        load_deepseek(str(tmp_path), torch.float32)
    # Saving over a sharded checkpoint is refused: its index would still be read, and the old weights loaded.
    with pytest.raises(ValueError, match=r"holds \['model.safetensors.index.json', 'shard.safetensors'\]"):
        save_deepseek(model, str(tmp_path))


def test_mtp_shares_the_targets_embedding_and_head(tmp_path):
    """With target=, the MTP layer shares the target's embedding and head modules where the
    checkpoint's copies equal them (a second copy would cost ~3.7 GB on V3 and train beside a
    frozen target); a copy that differs (a draft trained with its own head) is loaded; a target
    of another checkpoint is refused."""
    cfg = DeepseekV3Config(**TINY, q_lora_rank=None)
    model = DeepseekV3ForCausalLM(cfg)
    mtp = DeepseekMTP(cfg, target=model)
    save_deepseek(model, str(tmp_path), mtp=mtp)
    target = load_deepseek(str(tmp_path), torch.float32)
    shared = load_mtp(str(tmp_path), torch.float32, target=target)
    assert shared.embed_tokens is target.embed_tokens and shared.shared_head.head is target.lm_head

    tensors = load_file(tmp_path / "model.safetensors")
    head = f"model.layers.{cfg.num_hidden_layers}.shared_head.head.weight"
    tensors[head] = tensors[head].clone()
    tensors[head][-1, -1] += 1
    save_file(tensors, tmp_path / "model.safetensors")
    file, embed = str(tmp_path / "model.safetensors"), f"model.layers.{cfg.num_hidden_layers}.embed_tokens.weight"
    for rows in (1, 3, 80):  # blocks of rows, the last one short: the difference is in the last row
        chunk = rows * cfg.hidden_size * 4
        assert (_holds(file, embed, target.embed_tokens.weight, SINGLE, chunk)
                and not _holds(file, head, target.lm_head.weight, SINGLE, chunk))
    own_head = load_mtp(str(tmp_path), torch.float32, target=target)
    assert own_head.embed_tokens is target.embed_tokens and own_head.shared_head.head is not target.lm_head
    assert torch.equal(own_head.shared_head.head.weight, tensors[head])

    other = DeepseekV3ForCausalLM(DeepseekV3Config(**{**TINY, "vocab_size": 50}, q_lora_rank=None))
    with pytest.raises(CheckpointError, match=r"the target's embed_tokens.weight is \(50, 64\), its config.json implies \(80, 64\)"):
        load_mtp(str(tmp_path), torch.float32, target=other)


@pytest.mark.parametrize("field, value", [
    ("kv_lora_rank", 256), ("qk_rope_head_dim", 32), ("n_group", 3), ("topk_group", 5), ("num_experts_per_tok", 5),
    ("rope_scaling", {"type": "linear", "factor": 2.0}), ("quantization_config", {"quant_method": "fp8"}),
    ("hidden_act", "gelu"), ("q_lora_rank", 0),
    # Of the wrong type, each refused naming the field (not a TypeError naming none, or a failure later):
    ("n_shared_experts", None), ("routed_scaling_factor", None), ("hidden_size", 64.0), ("rope_scaling", "yarn"),
    ("rope_interleave", "false"), ("rope_scaling", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}),
    # Out of range (a negative beta would fail in math.log when the model is built; a negative
    # factor flips the routed experts' output):
    ("routed_scaling_factor", -2.5), ("routed_scaling_factor", 0),
    *(("rope_scaling", {**YARN, key: value}) for key, value in (("beta_fast", -32), ("beta_slow", "1"), ("mscale", -1.0),
                                                               ("attention_factor", 0), ("truncate", "no"))),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DeepseekV3Config(**{**TINY, field: value})


def test_yarn_truncate_null_is_taken_as_false_as_transformers_does():
    truncated = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY, q_lora_rank=None, rope_scaling={**YARN, "truncate": True}))
    null = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY, q_lora_rank=None, rope_scaling={**YARN, "truncate": None}))
    false = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY, q_lora_rank=None, rope_scaling={**YARN, "truncate": False}))
    assert torch.equal(null.rotary.inv_freq_bits, false.rotary.inv_freq_bits)
    assert not torch.equal(null.rotary.inv_freq_bits, truncated.rotary.inv_freq_bits)


def test_config_reads_public_and_transformers_forms():
    public = DeepseekV3Config.from_dict({**TINY, "rope_theta": 500.0, "rope_scaling": {"type": "yarn", **YARN}, "seq_aux": True})
    v5 = DeepseekV3Config.from_dict({**TINY, "rope_parameters": {"rope_theta": 500.0, **YARN}})
    assert public.rope_theta == v5.rope_theta == 500.0 and public.rope_scaling["factor"] == v5.rope_scaling["factor"] == 4.0
    assert DeepseekV3Config.from_dict(public.to_dict()) == public
    assert DeepseekV3Config.from_dict({**TINY, "rope_parameters": {"rope_type": "default", "rope_theta": 1.5}}).rope_scaling is None


# ------------------------------------------------------------------------ input validation
def test_the_latents_write_the_cache_rows_where_the_backend_says():
    """MLA layers take kv_rows' target: every backend.forward gets kv_new None and the cache holds
    what a forward given kv_new would have written; a backend of another head count refuses the
    pass in kv_rows, before any row is written."""
    cfg = DeepseekV3Config(**TINY)
    model = DeepseekV3ForCausalLM(cfg)
    randomize(model, 5)

    def run(spec):
        pool = MLAKVPool(cfg.num_hidden_layers, num_pages=4, page_size=PAGE, max_requests=1, max_context_len=8,
                         dtype=torch.float32)
        row = pool.alloc_request()
        pool.ensure_capacity(row, 3)
        batch = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([3], dtype=torch.int32),
                          pool.req_to_token[row, :3].long(), torch.tensor([0, 3], dtype=torch.int32), 3, False)
        backend = TorchRefBackend(pool.view(), spec, max_batch_size=1, max_q_len=3)
        backend.init_forward_metadata(batch)
        return pool, backend, batch

    pool, backend, batch = run(model.attn_spec())
    given = []
    forward = backend.forward
    backend.forward = lambda q, kv_new, layer, b: given.append(kv_new) or forward(q, kv_new, layer, b)
    hidden = model(torch.tensor([5, 9, 2]), torch.arange(3), backend, batch)
    assert len(given) == cfg.num_hidden_layers and all(kv is None for kv in given)
    ref_pool, ref_backend, ref_batch = run(model.attn_spec())
    ref_backend.kv_rows = None  # the backend writes kv_new itself, as a backend without kv_rows does
    torch.testing.assert_close(model(torch.tensor([5, 9, 2]), torch.arange(3), ref_backend, ref_batch), hidden,
                               atol=0, rtol=0)
    for ours, ref in zip(pool.kv_buffers, ref_pool.kv_buffers):
        assert torch.equal(ours, ref)

    wrong = dataclasses.replace(model.attn_spec(), num_heads=cfg.num_attention_heads + 1)
    pool, backend, batch = run(wrong)
    before = [b.clone() for b in pool.kv_buffers]
    with pytest.raises(ValueError, match="heads"):
        model(torch.tensor([5, 9, 2]), torch.arange(3), backend, batch)
    assert all(torch.equal(a, b) for a, b in zip(pool.kv_buffers, before))


def test_token_ids_out_of_range_raise_before_any_kv_write():
    cfg = DeepseekV3Config(**TINY, q_lora_rank=None)
    model = DeepseekV3ForCausalLM(cfg)
    mtp = DeepseekMTP(cfg, target=model)
    pool = MLAKVPool(cfg.num_hidden_layers, num_pages=4, page_size=PAGE, max_requests=1, max_context_len=8, dtype=torch.float32)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 2)
    batch = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([2], dtype=torch.int32), pool.req_to_token[row, :2].long(),
                      torch.tensor([0, 2], dtype=torch.int32), max_q_len=2, uniform_q_len=False)
    backend = TorchRefBackend(pool.view(), model.attn_spec(), max_batch_size=1, max_q_len=2)
    backend.init_forward_metadata(batch)
    for bad in ([3, cfg.vocab_size], [-1, 3]):
        with pytest.raises(ValueError, match="vocab_size=80"):
            model(torch.tensor(bad), torch.arange(2), backend, batch)
        with pytest.raises(ValueError, match="vocab_size=80"):
            mtp(torch.tensor(bad), torch.arange(2), torch.zeros(2, cfg.hidden_size), backend, batch)
        with pytest.raises(ValueError, match="vocab_size=80"):
            validate_token_ids(bad, cfg.vocab_size)
    # Float ids or positions, and negative positions, are refused (float positions would be rotated as given).
    for ids, pos, message in ((torch.tensor([3.0, 4.0]), torch.arange(2), "int64 or int32"),
                              (torch.tensor([3, 4]), torch.arange(2.0), "int64 or int32"),
                              (torch.tensor([3, 4]), torch.tensor([-1, 0]), "positions must be >= 0")):
        with pytest.raises(ValueError, match=message):
            model(ids, pos, backend, batch)
        with pytest.raises(ValueError, match=message):
            mtp(ids, pos, torch.zeros(2, cfg.hidden_size), backend, batch)
    assert all(not buf.any() for buf in pool.kv_buffers)
    validate_token_ids([0, cfg.vocab_size - 1], cfg.vocab_size)


def test_bf16_keeps_rope_frequencies_and_routing_bias_fp32():
    cfg = DeepseekV3Config(**TINY, q_lora_rank=None, rope_scaling=YARN)
    model = DeepseekV3ForCausalLM(cfg)
    inv_freq = model.rotary.inv_freq_bits.view(torch.float32).clone()
    cos = model.rotary(torch.tensor([1000]))[0]
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    bias.copy_(torch.arange(bias.numel()) * 1e-4)  # steps far below bf16 resolution near 1
    model.to(torch.bfloat16)
    assert torch.equal(model.rotary(torch.tensor([1000]))[0], cos)
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, torch.arange(bias.numel()) * 1e-4)
    built = DeepseekV3ForCausalLM(cfg, dtype=torch.bfloat16)
    assert torch.equal(built.rotary.inv_freq_bits.view(torch.float32), inv_freq)
    assert built.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert built.lm_head.weight.dtype == torch.bfloat16
    empty = DeepseekV3ForCausalLM(cfg, dtype=torch.bfloat16, device="meta").to_empty(device="cpu")
    assert empty.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
