"""The EAGLE worker on CPU (fp32, torch_ref): lossless against target-only greedy decoding."""

from __future__ import annotations

import pytest
import torch

from specdec.baseline import greedy_generate
from specdec.config import ConfigError, SpecConfig
from specdec.draft import StandaloneDraft
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


@pytest.fixture(scope="module")
def target() -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(tiny_config()).eval()


@pytest.fixture(scope="module")
def mtp(target) -> DeepseekMTP:
    torch.manual_seed(1)
    return DeepseekMTP(target.config, target=target).eval()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def run_to_completion(worker: EagleWorker, batches: list[tuple[list[list[int]], int]], join_every: int = 2):
    """Add the request groups one at a time, ``join_every`` steps apart; returns outputs in order and accept lengths."""
    reqs, accept, pending, steps = [], [], list(batches), 0
    while pending or worker.requests:
        if pending and steps % join_every == 0:
            group, max_new = pending.pop(0)
            reqs += worker.add_requests(group, max_new)
        if worker.requests:
            stats = worker.step()
            accept += stats.accept_lens
        steps += 1
    return [r.output for r in reqs], accept


def reference(target, groups):
    out = []
    for group, max_new in groups:
        out += greedy_generate(target, group, max_new)
    return out


@pytest.mark.parametrize("topk,num_steps,ndt", [(1, 1, 2), (1, 3, 4), (1, 5, 6), (2, 3, 6), (4, 2, 8), (3, 4, 10)])
def test_eagle_lossless_with_joins_and_finishes(target, mtp, topk, num_steps, ndt):
    groups = [(prompts(3, seed=topk * 10 + num_steps), 12), (prompts(2, seed=99), 7)]
    cfg = SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=ndt, max_batch_size=6, max_context_len=128)
    worker = EagleWorker(target, mtp, cfg)
    free_before = worker.target_pool.num_free_pages, worker.draft_pool.num_free_pages
    outputs, _ = run_to_completion(worker, groups)
    assert outputs == reference(target, groups)
    assert (worker.target_pool.num_free_pages, worker.draft_pool.num_free_pages) == free_before


def longest_matching_path(tree_tokens, parents, continuation) -> int:
    """Depth of the deepest tree node whose root path spells a prefix of ``continuation``."""
    best, depth_of = 0, {0: 0}
    for node in range(1, len(tree_tokens)):
        p = parents[node]
        if p in depth_of and depth_of[p] < len(continuation) and tree_tokens[node] == continuation[depth_of[p]]:
            depth_of[node] = depth_of[p] + 1
            best = max(best, depth_of[node])
    return best


@pytest.mark.parametrize("topk,num_steps,ndt", [(1, 4, 5), (2, 3, 7), (3, 2, 8)])
def test_identity_draft_accepts_the_best_path(target, topk, num_steps, ndt):
    """The target as its own standalone draft: every chain step accepts num_steps tokens and every
    tree step accepts the deepest tree path that the target's greedy continuation follows."""
    group = prompts(4, seed=7)
    max_new = 16
    expected = greedy_generate(target, group, max_new)
    cfg = SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=ndt, draft_mode="standalone", max_batch_size=4, max_context_len=128)
    worker = EagleWorker(target, StandaloneDraft(target), cfg)
    reqs = worker.add_requests(group, max_new)
    while worker.requests:
        running = list(worker.requests)
        done = [len(r.output) for r in running]
        stats = worker.step()
        tree = worker.last_tree
        for i, req in enumerate(running):
            full = expected[reqs.index(req)] + [-1] * 16
            continuation = full[done[i]:]  # continuation[0] is the root; the tree's depth-d node should be continuation[d]
            assert tree.tokens[i, 0].item() == continuation[0]
            best = longest_matching_path(tree.tokens[i].tolist(), tree.parents[i].tolist(), continuation)
            assert stats.accept_lens[i] == best
            if topk == 1:
                assert best == num_steps
            else:
                assert best >= 1  # the draft's first choice is the target's argmax
    assert [r.output for r in reqs] == expected


def test_standalone_draft_lossless(target):
    torch.manual_seed(5)
    small = DeepseekV3ForCausalLM(tiny_config(num_hidden_layers=1)).eval()
    groups = [(prompts(4, seed=3), 10)]
    worker = EagleWorker(target, StandaloneDraft(small), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, draft_mode="standalone", max_context_len=128))
    outputs, _ = run_to_completion(worker, groups)
    assert outputs == reference(target, groups)


def test_bad_requests_leave_running_state_intact(target, mtp):
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=3, max_context_len=64))
    group = prompts(2, seed=11)
    reqs = worker.add_requests(group, 8)
    free = worker.target_pool.num_free_pages, worker.draft_pool.num_free_pages
    with pytest.raises(ValueError, match="outside the vocabulary"):
        worker.add_requests([[1, 2, VOCAB]], 4)
    with pytest.raises(ValueError, match="max_context_len"):
        worker.add_requests([[1] * 60], 4)
    with pytest.raises(ValueError, match="max_batch_size"):
        worker.add_requests([[1], [2]], 4)
    assert (worker.target_pool.num_free_pages, worker.draft_pool.num_free_pages) == free
    assert len(worker.requests) == 2
    while worker.requests:
        worker.step()
    assert [r.output for r in reqs] == greedy_generate(target, group, 8)


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown attention backend 'flashmla'"):
        SpecConfig(attention_backend="flashmla")
