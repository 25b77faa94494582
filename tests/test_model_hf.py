"""Our DeepSeek-V3 model against transformers' reference implementation, and HF-format I/O."""

from __future__ import annotations

import json
import os

import pytest
import torch

from attn.torch_ref import TorchRefBackend
from specdec.batch import extend_batch
from specdec.kv import MLAKVPool
from specdec.models import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM, load_deepseek, load_mtp, save_deepseek
from spec_helpers import sequence_logits

HF_KW = dict(vocab_size=80, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
             max_position_embeddings=256)


@pytest.mark.parametrize("variant", [
    dict(q_lora_rank=None),
    dict(q_lora_rank=48),
    dict(q_lora_rank=48, rope_interleave=False),
    dict(q_lora_rank=None, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                                                beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
])
def test_logits_match_transformers(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_KW, **variant)).eval()
    with torch.no_grad():  # random routing bias and norms so grouped routing and every weight matter
        for name, buf in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.5)
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    ref.save_pretrained(tmp_path)
    ours = load_deepseek(str(tmp_path), torch.float32)
    ids = torch.randint(0, HF_KW["vocab_size"], (20,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(sequence_logits(ours, ids, decode_steps=3), expected, rtol=1e-4, atol=1e-4)


def test_mtp_matches_composition_of_reference_modules():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    torch.manual_seed(2)
    hf_cfg = transformers.DeepseekV3Config(**{**HF_KW, "num_hidden_layers": 1, "first_k_dense_replace": 0, "q_lora_rank": 48,
                                              "num_key_value_heads": HF_KW["num_attention_heads"]})
    layer = hf.DeepseekV3DecoderLayer(hf_cfg, 0).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    rotary = hf.DeepseekV3RotaryEmbedding(hf_cfg)
    cfg = DeepseekV3Config.from_dict(hf_cfg.to_dict())
    target = DeepseekV3ForCausalLM(cfg)
    mtp = DeepseekMTP(cfg, target=target).eval()
    state = dict(layer.state_dict())
    gate_up, down = state.pop("mlp.experts.gate_up_proj"), state.pop("mlp.experts.down_proj")  # fused in memory
    for e in range(cfg.n_routed_experts):
        gate, up = gate_up[e].chunk(2, dim=0)
        state.update({f"mlp.experts.{e}.gate_proj.weight": gate, f"mlp.experts.{e}.up_proj.weight": up,
                      f"mlp.experts.{e}.down_proj.weight": down[e]})
    mtp.layer.load_state_dict(state)
    n = 9
    ids, hidden = torch.randint(0, cfg.vocab_size, (n,)), torch.randn(n, cfg.hidden_size)
    with torch.no_grad():
        x = mtp.eh_proj(torch.cat([mtp.enorm(target.model.embed_tokens(ids)), mtp.hnorm(hidden)], -1))[None]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        expected = mtp.shared_head.norm(layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))[0])
        pool = MLAKVPool(1, 4, 16, 1, 32, torch.float32)
        row = pool.alloc_request()
        pool.ensure_capacity(row, n)
        backend = TorchRefBackend(pool.view(), mtp.attn_spec(), 1, 1)
        batch = extend_batch(pool.req_to_token, [row], [0], [n])
        backend.init_forward_metadata(batch)
        got = mtp(ids, torch.arange(n), hidden, backend, batch)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_round_trip_with_mtp(tmp_path):
    torch.manual_seed(3)
    cfg = DeepseekV3Config(**{k: v for k, v in HF_KW.items()}, q_lora_rank=32)
    model = DeepseekV3ForCausalLM(cfg).eval()
    mtp = DeepseekMTP(cfg, target=model).eval()
    save_deepseek(model, str(tmp_path), mtp=mtp)
    assert json.load(open(tmp_path / "config.json"))["num_nextn_predict_layers"] == 1
    loaded = load_deepseek(str(tmp_path), torch.float32)
    loaded_mtp = load_mtp(str(tmp_path), torch.float32, target=loaded)
    ids = list(range(12))
    assert torch.equal(sequence_logits(loaded, ids), sequence_logits(model, ids))
    for name, t in mtp.state_dict().items():
        assert torch.equal(loaded_mtp.state_dict()[name], t), name


def test_bad_checkpoints_and_configs(tmp_path):
    cfg = DeepseekV3Config(**HF_KW, q_lora_rank=None)
    model = DeepseekV3ForCausalLM(cfg)
    save_deepseek(model, str(tmp_path))
    with pytest.raises(ValueError, match="no MTP layer"):
        load_mtp(str(tmp_path), torch.float32, target=model)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing \\['model.layers.1.mlp.gate.e_score_correction_bias'\\]"):
        load_deepseek(str(tmp_path), torch.float32)
    for bad, field in [(dict(kv_lora_rank=256), "kv_lora_rank"), (dict(n_group=3), "n_group"), (dict(topk_group=9), "topk_group")]:
        with pytest.raises(ValueError, match=field):
            DeepseekV3Config(**{**HF_KW, **bad})
    assert os.path.exists(tmp_path / "config.json")
