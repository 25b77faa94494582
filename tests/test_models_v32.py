"""DeepSeek-V3.2 (sparse attention) against transformers' DeepseekV32ForCausalLM, and its refusals.

Our model runs as tests/test_models.py runs V3's (run_paged: a batched paged prefill, then decode
steps) through torch_ref's sparse passes, over a pool holding the indexer's keys; every position's
logits are compared with transformers' over the whole sequence, for an index_topk above every
context (sparse == dense) and one that prunes. The MTP layer (which transformers does not
implement for V3.2) is compared with transformers' modules composed as the release defines it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from attn.backends.torch_ref import TorchRefBackend
from attn.base import AttnBatch, ForwardMode, LayerSpec
from specdec.kv import MLAKVPool
from specdec.models import (DeepseekV32Config, DeepseekV32ForCausalLM, DeepseekV32MTP, DeepseekV3Config,
                            DeepseekV3ForCausalLM, load_deepseek, load_mtp)
from tests.test_models import (PAGE, TINY, YARN, assert_matches_reference, causal_mask, hf_layer_state, randomize,
                               run_paged, sequences, target_logits)

# 16 indexer heads: a row scores exactly 0 (a tie) only where all 16 of its head scores are <= 0.
V32 = dict(q_lora_rank=48, index_n_heads=16, index_head_dim=96)
PRUNING_TOPK = 4  # below every prefill length: the indexer drops rows from the first step on


def dense_twin(model: DeepseekV32ForCausalLM) -> DeepseekV3ForCausalLM:
    """DeepSeek-V3 with ``model``'s weights, its indexers left out: attention over every row."""
    fields = {k: v for k, v in model.config.to_dict().items() if not k.startswith("index_")}
    twin = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict({**fields, "model_type": "deepseek_v3"})).eval()
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if ".indexer." not in k})
    return twin


@pytest.mark.parametrize("index_topk", [2048, PRUNING_TOPK], ids=["topk-above-context", "topk-prunes"])
@pytest.mark.parametrize("rope", [dict(rope_type="default", rope_theta=10000.0), dict(rope_theta=10000.0, **YARN)],
                         ids=["rope", "yarn"])
def test_logits_match_transformers(tmp_path, index_topk, rope):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.DeepseekV32Config(**{**TINY, **V32, "index_topk": index_topk, "rope_parameters": rope})
    ref = transformers.DeepseekV32ForCausalLM(hf_cfg).eval()
    randomize(ref, seed=0)
    ref.save_pretrained(tmp_path)

    ours = load_deepseek(str(tmp_path), torch.float32)
    assert isinstance(ours, DeepseekV32ForCausalLM) and ours.config.index_topk == index_topk
    seqs = sequences(TINY["vocab_size"])
    got = target_logits(ours, seqs)
    assert_matches_reference(ref, seqs, got)

    # Against attention over every row: equal while no context exceeds index_topk, else different
    # exactly from the first position that sees more rows than index_topk.
    dense = target_logits(dense_twin(ours), seqs)
    for out, full in zip(got, dense):
        torch.testing.assert_close(out[:index_topk], full[:index_topk], rtol=1e-5, atol=1e-5)
        if index_topk < out.shape[0]:
            assert not torch.allclose(out[index_topk:], full[index_topk:], rtol=1e-3, atol=1e-3)


def test_index_topk_selects_only_rows_a_tree_token_sees():
    """A verify pass with a tree mask: each token's selection is the best of its prefix and its
    ancestors (the mask's rows), never a sibling's row; -1 past what it sees."""
    pool = MLAKVPool(1, num_pages=8, page_size=PAGE, max_requests=1, max_context_len=16, dtype=torch.float32,
                     index_head_dim=8)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 9)
    backend = TorchRefBackend(pool.view(), LayerSpec(num_heads=2, sm_scale=0.1), max_batch_size=1, max_q_len=3, max_mask_len=3)
    g = torch.Generator().manual_seed(0)
    pool.index_buffers[0].copy_(torch.randn(pool.index_buffers[0].shape, generator=g))
    # Prefix of 6 rows, then 3 tree tokens: 0 the root, 1 and 2 its children (siblings).
    mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    batch = AttnBatch(ForwardMode.TARGET_VERIFY, torch.tensor([row]), torch.tensor([9], dtype=torch.int32),
                      pool.req_to_token[row, 6:9].long(), torch.tensor([0, 3], dtype=torch.int32), max_q_len=3,
                      uniform_q_len=True, custom_mask=mask)
    backend.init_forward_metadata(batch)
    q, k = torch.randn(3, 2, 8, generator=g), torch.randn(3, 8, generator=g)
    weights = torch.randn(3, 2, generator=g)
    slot = pool.req_to_token[row, :9].tolist()
    for topk in (20, 5):
        chosen = backend.index_topk(q, weights, k, 0, batch, topk)
        assert chosen.shape == (3, topk) and chosen.dtype == torch.int32
        for t, seen in enumerate(([0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 8])):
            picked = [s for s in chosen[t].tolist() if s >= 0]
            assert set(picked) <= {slot[p] for p in seen} and len(picked) == min(topk, len(seen))
            scores = {slot[p]: float((weights[t, :, None] * (q[t] @ pool.index_buffers[0].view(-1, 8)[slot[p]])
                                      .relu()[:, None]).sum()) for p in seen}
            assert [scores[s] for s in picked] == pytest.approx(sorted(scores.values(), reverse=True)[:len(picked)])


def hf_mtp_parts(fields: dict, target: torch.nn.Module, seed: int) -> torch.nn.ModuleDict:
    """The MTP layer of a V3.2 checkpoint of transformers config ``fields`` as transformers'
    modules (it has no V3.2 MTP module): enorm, hnorm, eh_proj, the DeepseekV32DecoderLayer
    numbered num_hidden_layers (its indexer included), the shared head's norm, randomised; and, as
    the release stores them, copies of ``target``'s embedding and head."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    n = fields["num_hidden_layers"]
    layer_cfg = transformers.DeepseekV32Config(**{**fields, "num_hidden_layers": n + 1})  # mlp_layer_types[n]
    layer_cfg._attn_implementation = "eager"  # (None takes the path that leaves the indexer's mask to a kernel)
    d, eps = layer_cfg.hidden_size, layer_cfg.rms_norm_eps
    parts = torch.nn.ModuleDict(dict(
        enorm=hf.DeepseekV32RMSNorm(d, eps), hnorm=hf.DeepseekV32RMSNorm(d, eps),
        eh_proj=torch.nn.Linear(2 * d, d, bias=False), layer=hf.DeepseekV32DecoderLayer(layer_cfg, layer_idx=n),
        norm=hf.DeepseekV32RMSNorm(d, eps),
    ))
    randomize(parts, seed)
    parts.embed_tokens = torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().clone())
    parts.head = torch.nn.Linear(d, layer_cfg.vocab_size, bias=False)
    parts.head.weight.data.copy_(target.lm_head.weight)
    return parts.eval()


def save_v32_checkpoint(path: Path, fields: dict, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.ModuleDict]:
    """A V3.2 checkpoint of transformers config ``fields``: transformers' DeepseekV32ForCausalLM as
    it saves it, plus the MTP layer (hf_mtp_parts) in the release's layout, which transformers
    leaves out: ``model.layers.{num_hidden_layers}.*`` in mtp.safetensors, and
    num_nextn_predict_layers 1 in config.json. Returns (the transformers model, the MTP parts)."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**fields)).eval()
    randomize(ref, seed)
    ref.save_pretrained(path)
    parts = hf_mtp_parts(fields, ref, seed + 1)
    prefix = f"model.layers.{fields['num_hidden_layers']}."
    tensors = {prefix + k: v for k, v in hf_layer_state(parts.layer, ref.config.n_routed_experts).items()}
    tensors |= {f"{prefix}{k}.weight": getattr(parts, k).weight for k in ("embed_tokens", "enorm", "hnorm", "eh_proj")}
    tensors |= {prefix + "shared_head.norm.weight": parts.norm.weight, prefix + "shared_head.head.weight": parts.head.weight}
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, path / "mtp.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return ref, parts


def test_mtp_layer_matches_transformers_modules(tmp_path):
    """load_mtp of a V3.2 checkpoint: a DeepseekV32MTP whose sparse layer (its own indexer,
    pruning to PRUNING_TOPK rows) computes what transformers' modules composed as the MTP layer
    compute, over the paged prefill + decode steps; it shares the target's embedding and head
    (the checkpoint's copies equal them), and loads alone from its copies."""
    fields = {**TINY, **V32, "index_topk": PRUNING_TOPK, "rope_parameters": dict(rope_theta=10000.0, **YARN)}
    _, parts = save_v32_checkpoint(tmp_path, fields)
    target = load_deepseek(str(tmp_path), torch.float32)
    mtp = load_mtp(str(tmp_path), torch.float32, target=target)
    assert isinstance(mtp, DeepseekV32MTP) and mtp.embed_tokens is target.embed_tokens
    assert mtp.shared_head.head is target.lm_head
    assert (mtp.attn_spec().index_topk, mtp.attn_spec().index_head_dim) == (PRUNING_TOPK, V32["index_head_dim"])
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RotaryEmbedding

    rotary = DeepseekV32RotaryEmbedding(transformers.DeepseekV32Config(**fields))

    def reference(ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids_t, pos = torch.tensor(ids), torch.arange(len(ids))[None]
        x = parts.eh_proj(torch.cat([parts.enorm(parts.embed_tokens(ids_t)), parts.hnorm(hidden)], -1))[None]
        y = parts.norm(parts.layer(x, attention_mask=causal_mask(len(ids)), position_ids=pos,
                                   position_embeddings=rotary(x, pos))[0])
        return y, parts.head(y)

    seqs = sequences(TINY["vocab_size"], seed=3)
    assert min(map(len, seqs)) > PRUNING_TOPK  # the indexer prunes
    hidden_in = [torch.randn(len(s), TINY["hidden_size"], generator=torch.Generator().manual_seed(i))
                 for i, s in enumerate(seqs)]
    flat_hidden, starts = torch.cat(hidden_in), torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    alone = load_mtp(str(tmp_path), torch.float32)
    for draft in (mtp, alone):
        def step(ids, pos, req, backend, batch):
            h = draft(ids, pos, flat_hidden[starts[req] + pos], backend, batch)
            return torch.cat([h, draft.compute_logits(h)], dim=-1)

        outs = run_paged(step, 1, draft.attn_spec(), seqs, index_head_dim=draft.attn_spec().index_head_dim)
        for seq, hid, out in zip(seqs, hidden_in, outs):
            with torch.no_grad():
                want_hidden, want_logits = reference(seq, hid)
            torch.testing.assert_close(out[:, :TINY["hidden_size"]], want_hidden, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out[:, TINY["hidden_size"]:], want_logits, rtol=1e-4, atol=1e-4)


class NoSparse(TorchRefBackend):
    name = "dense_only"
    supports_sparse = False


class SmallTopk(TorchRefBackend):
    name = "small_topk"
    max_index_topk = 2


def model_and_batch(index_head_dim: int = V32["index_head_dim"]):
    cfg = DeepseekV32Config(**{**TINY, **V32, "index_topk": PRUNING_TOPK})
    model = DeepseekV32ForCausalLM(cfg).eval()
    pool = MLAKVPool(cfg.num_hidden_layers, num_pages=4, page_size=PAGE, max_requests=1, max_context_len=8,
                     dtype=torch.float32, index_head_dim=index_head_dim)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 2)
    batch = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([2], dtype=torch.int32),
                      pool.req_to_token[row, :2].long(), torch.tensor([0, 2], dtype=torch.int32), max_q_len=2,
                      uniform_q_len=False)
    return model, pool, batch


@pytest.mark.parametrize("backend_class, index_head_dim, message", [
    (NoSparse, V32["index_head_dim"], r"dense_only has no sparse attention \(supports_sparse=False\).*index_topk=4"),
    (SmallTopk, V32["index_head_dim"], r"small_topk: index_topk must be in \[1, 2\]"),
    (TorchRefBackend, 0, r"holds no indexer keys of index_head_dim=96.*MLAKVPool"),
    (TorchRefBackend, 32, r"holds no indexer keys of index_head_dim=96"),
], ids=["backend-without-sparse", "topk-past-the-kernel", "pool-without-index-keys", "pool-index-keys-too-narrow"])
def test_bad_settings_refused_before_any_cache_write(backend_class, index_head_dim, message):
    model, pool, batch = model_and_batch(index_head_dim)
    backend = backend_class(pool.view(), model.attn_spec(), max_batch_size=1, max_q_len=2)
    backend.init_forward_metadata(batch)
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model(torch.tensor([3, 4]), torch.arange(2), backend, batch)
    assert not any(buf.any() for buf in (*pool.kv_buffers, *pool.index_buffers))


@pytest.mark.parametrize("field, value", [("q_lora_rank", None), ("index_head_dim", 32), ("index_topk", 0),
                                          ("index_n_heads", 0)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"DeepseekV32Config.{field}"):
        DeepseekV32Config(**{**TINY, **V32, field: value})


def test_config_round_trip_and_model_types():
    cfg = DeepseekV32Config(**{**TINY, **V32})
    d = cfg.to_dict()
    assert d["model_type"] == "deepseek_v32" and d["architectures"] == ["DeepseekV32ForCausalLM"]
    assert DeepseekV32Config.from_dict(d) == cfg
    with pytest.raises(ValueError, match="model_type 'deepseek_v32'"):  # V3 would drop the indexers' weights
        DeepseekV3Config.from_dict(d)
    with pytest.raises(TypeError, match="DeepseekV32Config"):
        DeepseekV32ForCausalLM(DeepseekV3Config(**TINY))
