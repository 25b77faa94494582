"""The EAGLE worker over DeepSeek-V3.2 (sparse attention) on CPU: fp32, torch_ref.

The reference is target-only greedy decoding (specdec.baseline) of the same V3.2 model; the
contexts run from shorter than INDEX_TOPK (every row selected: sparse == dense) to several times
longer (the indexer prunes). Also: a tree token's selected rows are its prefix and ancestors'
(never a sibling branch's), the pools hold and move the indexer keys with the latent rows, and a
backend that cannot run the sparse passes is refused when the worker is built.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from attn import registry
from attn.backends.torch_ref import TorchRefBackend
from attn.base import KV_DTYPES, LayerSpec
from specdec.config import ConfigError, SpecConfig
from specdec.draft import StandaloneDraft
from specdec.kv import MLAKVPool
from specdec.models import DeepseekMTP, DeepseekV32Config, DeepseekV32ForCausalLM, DeepseekV32MTP
from specdec.worker import EagleWorker
from spec_helpers import drain, free_pages, prompts, reference, run_to_completion, tiny_config
from test_models_v32 import dense_twin
from test_worker import longest_matching_path

INDEX_TOPK = 8  # rows a query token attends to: prompts here run from 3 tokens to 19, outputs up to 14 more
# 16 indexer heads: a row's score is exactly 0 (a tie the two decodings might break apart) only where
# all 16 of its head scores are <= 0.
V32 = dict(q_lora_rank=32, index_n_heads=16, index_head_dim=96, index_topk=INDEX_TOPK)
TREES = [(1, 3, 4), (2, 3, 6), (4, 2, 8)]  # (topk, num_steps, num_draft_tokens)


def v32_models() -> tuple[DeepseekV32ForCausalLM, DeepseekV32MTP]:
    """A seeded random V3.2 target of tests' tiny shape and its sparse MTP draft head (sharing the
    target's embedding and head)."""
    config = DeepseekV32Config(**{**dataclasses.asdict(tiny_config()), **V32})
    torch.manual_seed(0)
    target = DeepseekV32ForCausalLM(config).eval()
    torch.manual_seed(1)
    return target, DeepseekV32MTP(config, target=target).eval()


@pytest.fixture(scope="module")
def sparse_models():
    return v32_models()


@pytest.fixture(scope="module")
def sparse_target(sparse_models):
    return sparse_models[0]


def test_contexts_span_index_topk_and_pruning_changes_the_output(sparse_target):
    """The setting every lossless test here runs in: prompts shorter and longer than INDEX_TOPK,
    and a target whose greedy output differs from the same weights attending to every row."""
    group = prompts(5, seed=1)
    assert min(map(len, group)) < INDEX_TOPK < max(map(len, group))
    assert reference(sparse_target, [(group, 14)]) != reference(dense_twin(sparse_target), [(group, 14)])


@pytest.mark.parametrize("topk,num_steps,ndt", TREES)
def test_eagle_lossless_with_joins_finishes_and_aborts(sparse_models, topk, num_steps, ndt):
    """Requests join mid-run, finish at their max_new_tokens (14, 9) and one is aborted: every
    other output is the target's own greedy output, the aborted one a prefix of it, and every page
    comes back."""
    target, mtp = sparse_models
    first, second = (prompts(3, seed=1), 14), (prompts(2, seed=2), 9)
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=ndt,
                                                 max_batch_size=6, max_context_len=128))
    free = free_pages(worker)
    reqs = worker.add_requests(*first)
    worker.step()
    worker.step()
    reqs += worker.add_requests(*second)
    worker.step()
    aborted = reqs[1]
    worker.abort([aborted])
    drain(worker)
    expected = reference(target, [first, second])
    assert [r.output for r in reqs if r is not aborted] == [e for e, r in zip(expected, reqs) if r is not aborted]
    assert len(aborted.output) < first[1] and aborted.output == expected[1][:len(aborted.output)]
    assert free_pages(worker) == free


@pytest.mark.parametrize("topk,num_steps,ndt", [(1, 4, 5), (2, 3, 7), (3, 2, 8)])
def test_target_as_its_own_draft_accepts_the_best_path(sparse_target, topk, num_steps, ndt):
    """The V3.2 target drafting for itself (standalone: its draft steps, tree-masked for topk > 1,
    and draft-extend are sparse passes over the draft's own pool of indexer keys): a chain accepts
    every drafted token and a tree the deepest path the target's greedy continuation follows, so
    the draft's selections agree with the verify's. After a tree step's accepted path is moved
    into place (its indexer keys with its rows), the next steps still accept alike."""
    group, max_new = prompts(3, seed=7), 16
    expected = reference(sparse_target, [(group, max_new)])
    cfg = SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=ndt, draft_mode="standalone",
                     max_batch_size=3, max_context_len=128)
    worker = EagleWorker(sparse_target, StandaloneDraft(sparse_target), cfg)
    reqs = worker.add_requests(group, max_new)
    moved = False  # a step accepted a path of other tree nodes than 0, 1, 2, ..: commit_kv moved its rows
    while worker.requests:
        running, done = list(worker.requests), [len(r.output) for r in worker.requests]
        result = worker.launch_step()
        stats = worker.finish_step(result)
        tree = worker.last_tree
        for i, req in enumerate(running):
            continuation = (expected[reqs.index(req)] + [-1] * 16)[done[i] - 1:]
            best = longest_matching_path(tree.tokens[i].tolist(), tree.parents[i].tolist(), continuation)
            assert stats.accept_lens[i] == best and (topk > 1 or best == num_steps)
            moved |= result.path[i, :best + 1].tolist() != list(range(best + 1))
    assert [r.output for r in reqs] == expected
    assert moved == (topk > 1)


def recorded_selections(monkeypatch, backend) -> list[tuple]:
    """Wrap ``backend``'s index_topk: each call's (seq_lens ``[B]``, tree mask or None, req_to_token
    rows of its requests ``[B, max_context_len]``, selected slots ``[T, topk]``), copies."""
    calls, original = [], backend.index_topk

    def recording(q, weights, k_new, layer_id, batch, topk):
        slots = original(q, weights, k_new, layer_id, batch, topk)
        mask = None if batch.custom_mask is None else batch.custom_mask.clone()
        calls.append((batch.seq_lens.clone(), mask, backend.kv.req_to_token[batch.req_pool_indices].clone(),
                      slots.clone()))
        return slots

    monkeypatch.setattr(backend, "index_topk", recording)
    return calls


def check_selection(selected: list[int], visible: set[int], topk: int) -> bool:
    """Assert one token's selected slots lie in its visible ones, min(topk, visible) of them,
    distinct; returns whether it pruned (saw more rows than topk)."""
    assert set(selected) <= visible and len(set(selected)) == len(selected) == min(topk, len(visible))
    return len(visible) > topk


@pytest.mark.parametrize("topk,num_steps,ndt", TREES[1:])
def test_tree_tokens_select_only_their_prefix_and_ancestors(monkeypatch, sparse_models, topk, num_steps, ndt):
    """Every verify token's selected rows (each layer's index_topk) are slots of the request's
    prefix or of its own tree ancestors (from the tree's parents, not its mask) and itself, never
    a sibling branch's; min(index_topk, visible) of them, so the indexer prunes where it sees more.
    Each draft step's frontier token likewise selects only among the prefix and the drafted rows
    its tree mask shows it (its ancestors)."""
    target, mtp = sparse_models
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=ndt,
                                                 max_batch_size=4, max_context_len=128))
    verify = recorded_selections(monkeypatch, worker.verify_backend)
    drafts = [recorded_selections(monkeypatch, backend) for backend in worker.draft_backend.steps]
    worker.add_requests(prompts(4, seed=5), 14)
    pruned = excluded = 0  # tokens whose selection pruned; of those, ones with a sibling's rows in the window
    while worker.requests:
        verify.clear()
        for calls in drafts:
            calls.clear()
        worker.step()
        tree = worker.last_tree
        assert len(verify) == target.num_attention_layers
        for seq_lens, _, slot_of, slots in verify:
            n = seq_lens.long() - ndt  # [B] each request's prefix
            for b in range(n.shape[0]):
                for i in range(ndt):
                    lineage, node = {i}, i
                    while node:
                        node = tree.parents[b, node].item()
                        lineage.add(node)
                    visible = {slot_of[b, p].item() for p in [*range(n[b]), *(n[b] + a for a in lineage)]}
                    chosen = [s for s in slots[b * ndt + i].tolist() if s >= 0]
                    if check_selection(chosen, visible, INDEX_TOPK):
                        pruned += 1
                        excluded += len(lineage) < i + 1
        for j, calls in enumerate(drafts, start=1):
            for seq_lens, mask, slot_of, slots in calls:  # mask: [B, topk, j * topk] over the drafted rows
                for b in range(seq_lens.shape[0]):
                    start = seq_lens[b].item() - j * topk
                    for f in range(topk):
                        seen = [*range(start), *(start + m for m in range(j * topk) if mask[b, f, m])]
                        chosen = [s for s in slots[b * topk + f].tolist() if s >= 0]
                        check_selection(chosen, {slot_of[b, p].item() for p in seen}, INDEX_TOPK)
    assert pruned and excluded


def test_sparse_models_say_so_in_their_layer_spec(sparse_models):
    """attn_spec() carries what the worker sizes pools and checks backends by; a LayerSpec with half
    of it is refused."""
    for model in sparse_models:
        spec = model.attn_spec()
        assert spec.sparse and (spec.index_topk, spec.index_head_dim) == (INDEX_TOPK, 96)
    assert not DeepseekMTP(tiny_config()).attn_spec().sparse
    for half in (dict(index_topk=8), dict(index_head_dim=96), dict(index_topk=0, index_head_dim=96)):
        with pytest.raises(ValueError, match="LayerSpec: index_"):
            LayerSpec(4, 0.1, **half)


def test_pools_hold_the_indexer_keys_of_the_sparse_models_only(sparse_models):
    """A sparse target's pool holds index_head_dim keys a slot a layer, a sparse draft's too; a
    dense draft's (a V3 MTP head over the sparse target) none. bytes_for counts what a pool
    allocates, its indexer keys included (bf16 beside an fp8 cache)."""
    target, mtp = sparse_models
    dense_mtp = DeepseekMTP(tiny_config(), target=target).eval()
    cfg = SpecConfig(num_steps=2, max_batch_size=2, max_context_len=64)
    for draft, draft_keys in ((mtp, 1), (dense_mtp, 0)):
        worker = EagleWorker(target, draft, cfg)
        for pool, layers, keys in ((worker.target_pool, target.num_attention_layers, 1), (worker.draft_pool, 1, draft_keys)):
            assert [tuple(b.shape) for b in pool.index_buffers] == [(cfg.pool_pages, cfg.page_size, 96)] * layers * keys
    for dtype, index_dtype in ((torch.float32, torch.float32), (torch.float8_e4m3fn, torch.bfloat16)):
        pool = MLAKVPool(2, 5, 4, 2, 16, dtype, index_head_dim=96)
        assert all(b.dtype == index_dtype for b in pool.index_buffers)
        held = sum(t.numel() * t.element_size() for t in (*pool.kv_buffers, *pool.index_buffers, pool.req_to_token))
        assert MLAKVPool.bytes_for(2, 5, 4, 2, 16, dtype, index_head_dim=96) == held


def test_the_memory_check_counts_the_indexer_keys(monkeypatch, sparse_models):
    """Pools that fit only without their indexer keys are refused, naming them."""
    target, mtp = sparse_models
    cfg = SpecConfig(num_steps=2, max_batch_size=2, max_context_len=64)
    dense = sum(MLAKVPool.bytes_for(layers, cfg.pool_pages, cfg.page_size, 2, 64, torch.float32) for layers in (2, 1))
    monkeypatch.setattr("specdec.kv.available_memory", lambda device: dense)
    with pytest.raises(ConfigError, match=r"plus indexer keys of 2 layers x 96 \+ 1 layers x 96 values a token"):
        EagleWorker(target, mtp, cfg)


def test_copy_slots_moves_the_indexer_keys_with_the_latent_rows():
    """What a tree's commit does to the target pool: every layer's latent row and indexer key at
    each source slot lands at its destination (sources read first), nothing else changes."""
    pool = MLAKVPool(2, 4, 4, 1, 8, torch.float32, index_head_dim=8)
    g = torch.Generator().manual_seed(0)
    for buf in (*pool.kv_buffers, *pool.index_buffers):
        buf.copy_(torch.randn(buf.shape, generator=g))
    before = [buf.clone().flatten(0, 1) for buf in (*pool.kv_buffers, *pool.index_buffers)]
    src, dst = torch.tensor([6, 9, 5]), torch.tensor([5, 6, 7])  # 5 -> 7 after 5 was overwritten by 6
    pool.copy_slots(src, dst)
    for old, buf in zip(before, (*pool.kv_buffers, *pool.index_buffers)):
        expected = old.clone()
        expected[dst] = old[src]
        assert torch.equal(buf.flatten(0, 1), expected)


class DenseOnly(TorchRefBackend):
    name = "dense_only"
    supports_sparse = False


class NarrowTopk(TorchRefBackend):
    name = "narrow_topk"
    max_index_topk = INDEX_TOPK - 1


class Bf16Sparse(TorchRefBackend):
    name = "bf16_sparse"
    sparse_kv_dtypes = ("bf16",)


@pytest.fixture
def test_backends(monkeypatch):
    """The three backends above in the registry, for this test."""
    for cls in (DenseOnly, NarrowTopk, Bf16Sparse):
        monkeypatch.setitem(registry._BACKENDS, cls.name, f"{__name__}:{cls.__name__}")


REFUSALS = [
    (dict(attention_backend="dense_only"), "mtp",
     r"dense_only \(target\) has no sparse attention \(supports_sparse=False\), and the target \(sparse attention, "
     r"index_topk=8\) runs its target passes on it; set attention_backend to one of \[.*'torch_ref'"),
    (dict(prefill_backend="dense_only"), "mtp", r"dense_only \(prefill\) has no sparse attention .* the target .*; "
                                                r"set prefill_backend to one of"),
    (dict(decode_backend="dense_only"), "mtp", r"dense_only \(draft\) has no sparse attention .* the draft "
                                               r"\(sparse attention, index_topk=8\) .*; set decode_backend to one of"),
    (dict(decode_backend="dense_only"), "standalone", r"dense_only \(draft\) .* the draft .* set decode_backend"),
    (dict(attention_backend="narrow_topk"), "mtp",
     r"narrow_topk \(target\) selects at most 7 rows a query token \(max_index_topk\), and the target \(sparse "
     r"attention, index_topk=8\) runs its target passes on it; set attention_backend to one of \[.*'torch_ref'"),
    (dict(decode_backend="narrow_topk"), "mtp", r"narrow_topk \(draft\) selects at most 7 rows .*set decode_backend"),
    (dict(attention_backend="bf16_sparse"), "mtp",
     r"bf16_sparse \(target\) runs sparse passes over kv caches of \['bf16'\], not torch.float32, and the target "
     r".*; change kv_dtype or set attention_backend"),
]


@pytest.mark.parametrize("settings, draft, message", REFUSALS,
                         ids=["dense-target", "dense-prefill", "dense-draft", "dense-standalone-draft",
                              "topk-past-target-kernel", "topk-past-draft-kernel", "kv-dtype"])
def test_backends_without_the_sparse_passes_are_refused_when_the_worker_is_built(
        monkeypatch, test_backends, sparse_models, settings, draft, message):
    """A role that runs a sparse model's passes on a backend that cannot is refused, naming the
    backend, its role, the model and the setting to change, before any pool or backend is built:
    the caller's config and the models are as they were, and a worker on torch_ref then decodes
    as the target alone."""
    target, mtp = sparse_models
    drafter = mtp if draft == "mtp" else StandaloneDraft(target)
    cfg = SpecConfig(num_steps=2, max_batch_size=2, max_context_len=64, draft_mode="eagle" if draft == "mtp" else draft,
                     **settings)
    given, weights = copy.deepcopy(cfg), copy.deepcopy(target.state_dict())
    with monkeypatch.context() as patch:
        patch.setattr("specdec.worker.MLAKVPool", lambda *a, **k: pytest.fail("a pool was built before the refusal"))
        with pytest.raises(ConfigError, match=message):
            EagleWorker(target, drafter, cfg)
    assert cfg == given and all(torch.equal(t, weights[k]) for k, t in target.state_dict().items())
    group = prompts(2, seed=3)
    worker = EagleWorker(target, drafter, dataclasses.replace(cfg, attention_backend="torch_ref", decode_backend=None,
                                                              prefill_backend=None))
    reqs = worker.add_requests(group, 6)
    drain(worker)
    assert [r.output for r in reqs] == reference(target, [(group, 6)])


def test_a_dense_draft_of_a_sparse_target_runs_on_a_dense_draft_backend(test_backends, sparse_target):
    """Only the roles that run a sparse model's passes need sparse ones: a V3 MTP head (dense)
    drafting for the V3.2 target may draft on a backend without them, losslessly."""
    draft = DeepseekMTP(tiny_config(), target=sparse_target).eval()
    worker = EagleWorker(sparse_target, draft, SpecConfig(num_steps=2, topk=2, num_draft_tokens=4,
                                                          decode_backend="dense_only", max_context_len=64))
    group = prompts(3, seed=4)
    reqs = worker.add_requests(group, 10)
    drain(worker)
    assert type(worker.draft_backend.steps[0]) is DenseOnly
    assert [r.output for r in reqs] == reference(sparse_target, [(group, 10)])


# The GPU sparse backends, each over the cache it takes and its page size.
GPU_SPARSE = {"triton_mla": ("bf16", 16), "flashmla_sparse": ("fp8_v32", 64)}


def gpu_sparse_worker(backend: str, topk: int, ndt, max_bs: int = 6):
    """The V3.2 target and its MTP head on the GPU (fp32) under ``backend`` (GPU_SPARSE's cache)."""
    if backend == "flashmla_sparse":
        pytest.importorskip("flash_mla", reason="flashmla_sparse needs the sgl-flash-mla wheel")
    target, mtp = (m.to("cuda") for m in v32_models())
    kv_dtype, page_size = GPU_SPARSE[backend]
    cfg = SpecConfig(num_steps=3, topk=topk, num_draft_tokens=ndt, attention_backend=backend, kv_dtype=kv_dtype,
                     page_size=page_size, max_batch_size=max_bs, max_context_len=256)
    return target, EagleWorker(target, mtp, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(GPU_SPARSE))
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("topk,ndt", [(1, None), (2, 6)])
def test_worker_is_lossless_on_gpu(backend, topk, ndt, graphs):
    """Each sparse backend's passes (indexer and sparse decode kernels) under the worker, eager and
    graphed, with joins: the target-only greedy outputs over the same backend and cache, and every
    page back."""
    target, worker = gpu_sparse_worker(backend, topk, ndt)
    if graphs:
        worker.capture_graphs([1, 2, 4, 6], progress=False)
    groups = [(prompts(2, seed=1), 30), (prompts(3, seed=2), 20), (prompts(1, seed=3), 25)]
    outputs, _ = run_to_completion(worker, groups, join_every=3)
    kv_dtype, page_size = GPU_SPARSE[backend]
    assert outputs == reference(target, groups, backend=backend, kv_dtype=KV_DTYPES[kv_dtype], page_size=page_size)
    assert worker.target_pool.num_free_pages == worker.config.pool_pages - 1


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(GPU_SPARSE))
@pytest.mark.parametrize("graphs", [False, True])
def test_worker_steps_have_no_host_sync(backend, graphs):
    """A topk 2 tree's steps over the sparse model, a join between them: launch_step never syncs."""
    from test_graphs import check_steps_without_sync

    check_steps_without_sync(lambda: gpu_sparse_worker(backend, 2, 6, max_bs=4)[1], graphs)
