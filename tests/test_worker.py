"""The EAGLE worker on CPU (fp32, torch_ref): lossless against target-only greedy decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.baseline import greedy_generate
from specdec.config import ConfigError, SpecConfig
from specdec.draft import StandaloneDraft
from specdec.models import DeepseekV3ForCausalLM
from specdec.kv import OutOfPagesError
from specdec.worker import EagleWorker
from spec_helpers import VOCAB, prompts, reference, run_to_completion, tiny_config


def free_pages(worker) -> tuple[int, int]:
    """Free pages of the target and the draft pool."""
    return worker.target_pool.num_free_pages, worker.draft_pool.num_free_pages


def drain(worker) -> None:
    """Step until every request has finished."""
    while worker.requests:
        worker.step()


@pytest.mark.parametrize("topk,num_steps,ndt", [(1, 1, 2), (1, 3, 4), (1, 5, 6), (2, 3, 6), (4, 2, 8), (3, 4, 10)])
def test_eagle_lossless_with_joins_and_finishes(target, mtp, topk, num_steps, ndt):
    groups = [(prompts(3, seed=topk * 10 + num_steps), 12), (prompts(2, seed=99), 7)]
    cfg = SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=ndt, max_batch_size=6, max_context_len=128)
    worker = EagleWorker(target, mtp, cfg)
    free_before = free_pages(worker)
    outputs, _ = run_to_completion(worker, groups)
    assert outputs == reference(target, groups)
    assert free_pages(worker) == free_before


def longest_matching_path(tree_tokens, parents, continuation) -> int:
    """Depth of the deepest tree node whose root path spells ``continuation`` (``[0]`` = the root)."""
    best, depth_of = 0, {0: 0}
    for node in range(1, len(tree_tokens)):
        p = parents[node]
        if p in depth_of and depth_of[p] + 1 < len(continuation) and tree_tokens[node] == continuation[depth_of[p] + 1]:
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
            continuation = full[done[i] - 1:]  # [0] is the root (last output); depth-d nodes should be [d]
            assert tree.tokens[i, 0].item() == continuation[0]
            best = longest_matching_path(tree.tokens[i].tolist(), tree.parents[i].tolist(), continuation)
            assert stats.accept_lens[i] == best
            if topk == 1:
                assert best == num_steps
            else:
                assert best >= 1  # the draft's first choice is the target's argmax
    assert [r.output for r in reqs] == expected


def test_eos_and_max_new_tokens_end_requests_mid_step(target):
    """A request stops at its first eos (kept) or at max_new_tokens even when a step accepts
    tokens past it; the rest of the batch runs on, and every page comes back."""
    group = prompts(4, seed=11)
    max_new = 14  # the prefill token + 3 steps of 4 tokens, then 1 of the next step's 4
    expected = greedy_generate(target, group, max_new)
    eos = expected[0][6]  # mid-step for request 0 (steps emit outputs 1-4, 5-8, ...)
    want = [seq[: seq.index(eos) + 1] if eos in seq else seq for seq in expected]
    assert any(len(w) < max_new for w in want) and any(len(w) == max_new for w in want)
    cfg = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4, draft_mode="standalone", max_batch_size=4, max_context_len=128)
    worker = EagleWorker(target, StandaloneDraft(target), cfg)
    free_before = free_pages(worker)
    reqs = worker.add_requests(group, max_new, eos_token_id=eos)
    while worker.requests:
        stats = worker.step()
        assert stats.accept_lens and all(n == 3 for n in stats.accept_lens)
    assert [r.output for r in reqs] == want and all(r.finished for r in reqs)
    assert free_pages(worker) == free_before


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
    free = free_pages(worker)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=96\); got \[96\]"):
        worker.add_requests([[1, 2, VOCAB]], 4)
    with pytest.raises(ValueError, match="max_context_len"):
        worker.add_requests([[1] * 60], 4)
    with pytest.raises(ValueError, match="max_batch_size"):
        worker.add_requests([[1], [2]], 4)
    assert free_pages(worker) == free
    assert len(worker.requests) == 2
    drain(worker)
    assert [r.output for r in reqs] == greedy_generate(target, group, 8)


def test_more_bad_inputs_are_refused_up_front(target, mtp):
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=3, max_context_len=64))
    free = free_pages(worker)
    for args, kwargs, needle in [
        (([[1, 2]], 0), {}, "max_new_tokens must be >= 1"),
        (([[1, 2]], 3.5), {}, "max_new_tokens must be an int"),
        (([[1, 2]], True), {}, "max_new_tokens must be an int"),
        (([[1.5, 2.0]], 4), {}, "prompt tokens must be ints"),
        (([[1, 2]], 4), dict(eos_token_id=[1, 2]), "eos_token_id must be one int or None"),
        (([[1, 2]], 4), dict(eos_token_id=2**63), "token ids must lie in"),
    ]:
        with pytest.raises(ValueError, match=needle):
            worker.add_requests(*args, **kwargs)
    assert worker.add_requests([], 4) == [] and not worker.requests
    assert free_pages(worker) == free
    group = [np.array(p) for p in prompts(2, seed=12)]  # numpy ids are ints too
    assert worker.add_requests(np.zeros((0, 3), dtype=np.int64), 4) == []
    reqs = worker.add_requests(group, 6)
    drain(worker)
    assert [r.output for r in reqs] == greedy_generate(target, [p.tolist() for p in group], 6)


def test_a_failed_prefill_releases_the_new_requests(target, mtp):
    """An error after the new requests got their rows and pages (out of memory in the prefill)
    returns them and leaves the running batch as it was."""
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=4, max_context_len=64))
    group = prompts(2, seed=13)
    reqs = worker.add_requests(group, 8)
    free = free_pages(worker)
    forward = worker._forward
    worker._forward = lambda *args: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("simulated"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        worker.add_requests(prompts(2, seed=14), 8)
    worker._forward = forward
    assert free_pages(worker) == free
    assert worker.requests == reqs
    more = worker.add_requests(prompts(2, seed=14), 8)  # the rows came back: room for two more
    drain(worker)
    assert [r.output for r in reqs + more] == greedy_generate(target, group + prompts(2, seed=14), 8)


def test_nothing_changes_the_batch_while_a_step_is_in_flight(target, mtp):
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=4, max_context_len=64))
    group = prompts(2, seed=15)
    reqs = worker.add_requests(group, 10)
    result = worker.launch_step()
    for call in (worker.launch_step, lambda: worker.add_requests([[1, 2]], 4), lambda: worker.abort(reqs)):
        with pytest.raises(RuntimeError, match="in flight"):
            call()
    with pytest.raises(RuntimeError, match="result of the step in flight"):
        worker.finish_step(object())
    wait = worker._emitted.wait
    worker._emitted.wait = lambda: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):  # an interrupted wait: finish_step may be called again
        worker.finish_step(result)
    worker._emitted.wait = wait
    worker.finish_step(result)
    with pytest.raises(RuntimeError, match="result of the step in flight"):
        worker.finish_step(result)  # taken once
    drain(worker)
    assert [r.output for r in reqs] == greedy_generate(target, group, 10)


def test_abort_frees_a_request_and_the_rest_run_on(target, mtp):
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=4, max_context_len=64))
    free = free_pages(worker)
    group = prompts(3, seed=16)
    reqs = worker.add_requests(group, 12)
    worker.step()
    emitted = list(reqs[1].output)
    worker.abort([reqs[1]])
    worker.abort([reqs[1]])  # no longer running: nothing to do
    assert reqs[1].finished and reqs[1].output == emitted and worker.requests == [reqs[0], reqs[2]]
    drain(worker)
    expected = greedy_generate(target, group, 12)
    assert [reqs[0].output, reqs[2].output] == [expected[0], expected[2]]
    assert emitted == expected[1][: len(emitted)]
    assert free_pages(worker) == free


def test_out_of_pages_mid_run_recovers_by_abort(target, mtp):
    """A step that cannot reserve pages raises before it launches; aborting a request returns its
    pages and the other runs on to its greedy output."""
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=2, max_context_len=128, num_pages=9))
    group = prompts(2, seed=17)
    reqs = worker.add_requests(group, 80)
    with pytest.raises(OutOfPagesError):
        while worker.requests:
            worker.step()
    worker.abort([reqs[0]])
    drain(worker)
    assert reqs[1].output == greedy_generate(target, group[1:], 80)[0]
    assert free_pages(worker) == (8, 8)


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown attention backend 'flashmla'"):
        SpecConfig(attention_backend="flashmla")


@pytest.mark.parametrize("enable_sampling", [False, True])
def test_lossless_when_the_target_ties_its_top_logits(enable_sampling):
    """Every upper-half vocab row of lm_head copies a lower-half one, so every maximum logit is
    tied: greedy requests must still take argmax's choice, the first of the tied tokens."""
    from spec_helpers import make_models

    target, mtp = make_models()
    with torch.no_grad():
        target.lm_head.weight[VOCAB // 2:2 * (VOCAB // 2)] = target.lm_head.weight[:VOCAB // 2]
    groups = [(prompts(6, seed=3), 8)]
    cfg = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, enable_sampling=enable_sampling, max_batch_size=6,
                     max_context_len=64)
    outputs, _ = run_to_completion(EagleWorker(target, mtp, cfg), groups)
    assert outputs == reference(target, groups)
    assert all(token < VOCAB // 2 for output in outputs for token in output)


def test_trees_smaller_than_their_depth_commit_only_inside_their_pages():
    """topk 2, num_steps 5, num_draft_tokens 3: the accepted path is at most 2 tokens past N, and
    commit_kv must not copy the path's padding columns to N + 3..N + 5, past the request's pages.
    A reused row's stale positions pointed there at pages another running request now held."""
    from spec_helpers import make_models

    target, mtp = make_models()
    cfg = SpecConfig(num_steps=5, topk=2, num_draft_tokens=3, page_size=4, max_batch_size=2, max_context_len=64)
    worker = EagleWorker(target, mtp, cfg)
    first = prompts(1, seed=1)[0][:12]
    run_to_completion(worker, [([first], 3)])
    groups = [([[7], prompts(1, seed=5)[0]], 12)]  # [7] reuses the first request's row with one page
    outputs, _ = run_to_completion(worker, groups)
    assert outputs == reference(target, groups)
    assert not worker.target_pool.kv_buffers[0][0].any()  # nothing went to the padding page either


def test_grow_ahead_pages_come_back_before_a_step_runs_out():
    """A request that grew while pages were free holds some past its need; another request's
    step takes them back rather than raising OutOfPagesError."""
    from spec_helpers import make_models

    target, mtp = make_models()
    cfg = SpecConfig(num_steps=1, topk=1, page_size=4, max_batch_size=2, max_context_len=64, num_pages=8)
    worker = EagleWorker(target, mtp, cfg)
    early, = worker.add_requests([[1, 2, 3]], 20)
    for _ in range(3):
        worker.step()
    late, = worker.add_requests([[1, 2, 3, 4, 5, 6, 7]], 6)
    drain(worker)
    assert early.output == greedy_generate(target, [[1, 2, 3]], 20)[0]
    assert late.output == greedy_generate(target, [[1, 2, 3, 4, 5, 6, 7]], 6)[0]


def test_prefill_runs_in_groups_of_at_most_max_prefill_tokens(target, mtp):
    """Prompts of 3, 4, 9, 2 and 2 tokens under a cap of 6: passes of [3], [4], [9] (alone, over
    the cap) and [2, 2]; the outputs stay the greedy ones."""
    cfg = SpecConfig(num_steps=2, max_batch_size=5, max_context_len=64, max_prefill_tokens=6)
    worker = EagleWorker(target, mtp, cfg)
    passes = []
    prefill = worker._prefill
    worker._prefill = lambda group: passes.append([len(r.prompt) for r in group]) or prefill(group)
    lengths = [3, 4, 9, 2, 2]
    groups = [([p[:n] for p, n in zip(prompts(5, seed=8), lengths)], 6)]
    outputs, _ = run_to_completion(worker, groups)
    assert passes == [[3], [4], [9], [2, 2]]
    assert outputs == reference(target, groups)
    with pytest.raises(ConfigError, match="max_prefill_tokens must be >= 1"):
        SpecConfig(max_prefill_tokens=0)
    # A standalone draft's pass takes one token more a prompt: two prompts of 3 are two passes there.
    standalone = EagleWorker(target, StandaloneDraft(target), SpecConfig(
        num_steps=2, draft_mode="standalone", max_batch_size=2, max_context_len=64, max_prefill_tokens=6))
    assert [[len(r.prompt) for r in group] for group in standalone._prefill_groups(
        standalone.add_requests([[1, 2, 3], [4, 5, 6]], 2))] == [[3], [3]]
