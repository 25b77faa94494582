"""The EAGLE worker on CPU (fp32, torch_ref): lossless against target-only greedy decoding."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch

from specdec.baseline import greedy_generate
from specdec.config import ConfigError, SpecConfig
from specdec.draft import StandaloneDraft
from specdec.kv import OutOfPagesError
from specdec.models import DeepseekMTP, DeepseekV3ForCausalLM
from specdec.sampling import SamplingParams
from specdec.worker import EagleWorker
from spec_helpers import VOCAB, drain, free_pages, prompts, reference, run_to_completion, tiny_config


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
    """Also a draft narrower than the target, in another dtype: the graph runner's static state
    (state_template) takes its hidden states as the draft gives them (the draft's width and dtype,
    not the target's), and decoding stays lossless."""
    torch.manual_seed(5)
    small = DeepseekV3ForCausalLM(tiny_config(num_hidden_layers=1)).eval()
    narrow = DeepseekV3ForCausalLM(tiny_config(num_hidden_layers=1, hidden_size=32)).to(torch.float64).eval()
    groups = [(prompts(4, seed=3), 10)]
    for draft in (small, narrow):
        worker = EagleWorker(target, StandaloneDraft(draft), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6,
                                                                        draft_mode="standalone", max_context_len=128))
        worker.add_requests(groups[0][0][:1], 4)
        template = worker.spec_step.state_template(4).hidden
        assert (template.shape[1], template.dtype) == (worker.state.hidden.shape[1], worker.state.hidden.dtype)
        drain(worker)
        outputs, _ = run_to_completion(worker, groups)
        assert outputs == reference(target, groups)


@pytest.mark.parametrize("draft_vocab", [64, 128])
def test_a_draft_of_another_vocabulary_is_refused_up_front(target, draft_vocab):
    """Its proposals are target token ids, so its vocabulary must be the target's: a wider or
    narrower one (which would propose ids past the target's vocabulary, or fail to embed prompts,
    mid-run) is refused when the worker is built."""
    torch.manual_seed(5)
    small = DeepseekV3ForCausalLM(tiny_config(num_hidden_layers=1, vocab_size=draft_vocab)).eval()
    config = SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, draft_mode="standalone", max_context_len=64)
    with pytest.raises(ConfigError, match=rf"the draft's vocabulary \({draft_vocab} tokens\) must be the target's \(96\)"):
        EagleWorker(target, StandaloneDraft(small), config)
    narrowed = DeepseekMTP(target.config, head=torch.nn.Linear(target.config.hidden_size, draft_vocab, bias=False))
    with pytest.raises(ConfigError, match="the draft's vocabulary"):
        EagleWorker(target, narrowed, SpecConfig(num_steps=2, max_context_len=64))


@pytest.mark.parametrize("setting", ["attention_backend", "decode_backend"])
def test_a_backend_the_device_cannot_run_is_a_config_error_naming_its_setting(target, mtp, setting):
    """The refusal is a ConfigError, which an engine catching ConfigError (as the example does)
    sees, naming the backend, its role and the setting to change."""
    config = SpecConfig(num_steps=2, max_context_len=64, **{setting: "triton_mla"})
    with pytest.raises(ConfigError, match=rf"triton_mla \(\w+\) needs a .* GPU but runs on the device cpu; set "
                                          rf"{setting} to one that runs here: \['torch_ref'\]"):
        EagleWorker(target, mtp, config)


def test_drafts_the_settings_cannot_drive_are_refused_up_front(target, mtp):
    """Refused when the worker is built, each naming the setting to change: a top-k past the
    vocabulary (torch would fail at the first add_requests), an MTP head run standalone (given no
    hidden states), and an ordinary LM in eagle mode (it would run, each token fed a position
    early)."""
    with pytest.raises(ConfigError, match="topk 97 exceeds the vocabulary \\(96 tokens\\); lower topk"):
        EagleWorker(target, mtp, SpecConfig(num_steps=1, topk=97, num_draft_tokens=98, max_context_len=256))
    with pytest.raises(ConfigError, match="draft_mode='standalone' gives the draft no hidden states.*set "
                                          "draft_mode='eagle'"):
        EagleWorker(target, mtp, SpecConfig(num_steps=2, draft_mode="standalone", max_context_len=64))
    with pytest.raises(ConfigError, match="which this draft does not read \\(an ordinary LM\\); set "
                                          "draft_mode='standalone'"):  # not run with each token a position early
        EagleWorker(target, StandaloneDraft(target), SpecConfig(num_steps=2, max_context_len=64))


def test_a_hidden_state_draft_unlike_the_target_is_refused_up_front(target):
    """An MTP head reads the target's hidden states: one in another dtype, on another device or of
    another width is refused when the worker is built (not a matmul error in eh_proj at the first
    add_requests). A standalone draft in another dtype runs, and is accepted."""
    for shares in (None, target):  # its own embedding and head, or the target's
        other_dtype = DeepseekMTP(target.config, target=shares, dtype=torch.bfloat16)
        with pytest.raises(ConfigError, match=r"the draft has parameters in \['torch.bfloat16'\] and the "
                                              r"target's are torch.float32"):
            EagleWorker(target, other_dtype, SpecConfig(num_steps=2, max_context_len=64))
        elsewhere = DeepseekMTP(target.config, target=shares, device="meta")
        with pytest.raises(ConfigError, match=r"the draft has parameters on \['meta'\] and the target on cpu"):
            EagleWorker(target, elsewhere, SpecConfig(num_steps=2, max_context_len=64))
    narrower = DeepseekMTP(tiny_config(hidden_size=32))
    with pytest.raises(ConfigError, match=r"hidden states \(64 wide: the target's config.hidden_size\) but has hidden_size 32"):
        EagleWorker(target, narrower, SpecConfig(num_steps=2, max_context_len=64))
    EagleWorker(target, DeepseekMTP(target.config, target=target), SpecConfig(num_steps=2, max_context_len=64))
    standalone = StandaloneDraft(DeepseekV3ForCausalLM(target.config, dtype=torch.bfloat16))
    EagleWorker(target, standalone, SpecConfig(num_steps=2, draft_mode="standalone", max_context_len=64))


def test_bad_requests_leave_running_state_intact(target, mtp):
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=3, max_context_len=64))
    group = prompts(2, seed=11)
    reqs = worker.add_requests(group, 8)
    free = free_pages(worker)
    with pytest.raises(ValueError, match=r"^prompts\[0\]'s token ids must lie in \[0, vocab_size=96\); got \[96\]"):
        worker.add_requests([[1, 2, VOCAB]], 4)
    with pytest.raises(ValueError, match=r"^prompts\[0\] is empty"):
        worker.add_requests([[]], 4)
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
        (([[1, 2]], torch.tensor(True)), {}, "max_new_tokens must be an int"),  # not taken as 1
        (([torch.tensor([True, False])], 4), {}, r"each prompt must be a list of token ids \(ints\)"),  # not the prompt [1, 0]
        (([[1, 2]], 4), dict(eos_token_id=torch.tensor([True])), "eos_token_id must be one int or None"),
        (([[1.5, 2.0]], 4), {}, r"each prompt must be a list of token ids \(ints\)"),
        (([[1, 2]], 4), dict(eos_token_id=[1, 2]), "eos_token_id must be one int or None"),
        (([[1, 2]], 4), dict(eos_token_id=2**63), r"eos_token_id must lie in \[0, vocab_size="),
        (([[1, 2]], 4), dict(eos_token_id=-1), r"eos_token_id must lie in \[0, vocab_size=96\); got \[-1\]"),
        (([1, 2, 3], 4), {}, r"each prompt must be a list of token ids \(ints\), got int"),  # a flat prompt
        ((torch.tensor([1, 2, 3]), 4), {}, r"each prompt must be a list of token ids \(ints\), got Tensor"),
        ((None, 4), {}, "prompts must be a list of token-id lists, one per request, got NoneType"),
        (([[1, 2]], 4), dict(sampling=SamplingParams()), "sampling must be a list of SamplingParams, one per prompt"),
        (([], 0), {}, "max_new_tokens must be >= 1"),  # no prompts: the arguments are checked all the same
        (([[1, 2], [3]], 4), dict(sampling=[SamplingParams(), None]), r"sampling\[1\] must be a SamplingParams, got NoneType"),
        (([[1, 2], [3]], 4), dict(sampling=[]), "got 0 SamplingParams for 2 prompts"),
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
    prefill_pass = worker.prefill._pass
    worker.prefill._pass = lambda *args: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("simulated"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        worker.add_requests(prompts(2, seed=14), 8)
    worker.prefill._pass = prefill_pass
    assert free_pages(worker) == free
    assert worker.requests == tuple(reqs)
    more = worker.add_requests(prompts(2, seed=14), 8)  # the rows came back: room for two more
    assert [r.rid for r in reqs + more] == [0, 1, 2, 3]  # the failed admission used no request ids
    drain(worker)
    assert [r.output for r in reqs + more] == greedy_generate(target, group + prompts(2, seed=14), 8)


def test_nothing_changes_the_batch_while_a_step_is_in_flight(target, mtp):
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=4, max_context_len=64))
    group = prompts(2, seed=15)
    reqs = worker.add_requests(group, 10)
    result = worker.launch_step()
    for name, call in (("launch_step", worker.launch_step), ("step", worker.step),
                       ("add_requests", lambda: worker.add_requests([[1, 2]], 4)), ("abort", lambda: worker.abort(reqs))):
        with pytest.raises(RuntimeError, match=f"^{name} while a step is in flight"):  # the call made, by name
            call()
    with pytest.raises(RuntimeError, match="result of the step in flight"):
        worker.finish_step(object())
    host_copy = worker.spec_step.host_copy
    wait = host_copy.wait
    host_copy.wait = lambda: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):  # an interrupted wait: finish_step may be called again
        worker.finish_step(result)
    host_copy.wait = wait
    assert worker.in_flight is result
    worker.finish_step(result)
    assert worker.in_flight is None
    for finished in (result, worker.in_flight):  # taken once; None (what in_flight says) names the case
        with pytest.raises(RuntimeError, match="no step in flight .launch_step raised before launching one, or the step was finished"):
            worker.finish_step(finished)
    drain(worker)
    assert [r.output for r in reqs] == greedy_generate(target, group, 10)


def test_a_finish_step_or_abort_that_fails_changes_nothing(target, mtp, monkeypatch):
    """The batch's state shrinks by a gather on the device, which may run out of memory: a
    finish_step or abort where it fails changes nothing (requests, outputs, pages, state), and
    finish_step(worker.in_flight) / abort again then complete it; the decode stays target-only
    greedy. A half-done shrink would let requests leave while the state kept their rows: the next
    step would fail, or run a new request on another's state."""
    from specdec.state import DecodeState

    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=4, max_context_len=64))
    group = prompts(3, seed=16)
    aborted, *others = reqs = worker.add_requests(group[:2], 20) + worker.add_requests(group[2:], 8)
    select, failing = DecodeState.select, [True]
    monkeypatch.setattr(DecodeState, "select", lambda st, keep: (
        (_ for _ in ()).throw(RuntimeError("out of memory")) if failing[0] else select(st, keep)))

    def snapshot():
        return ([r.rid for r in worker.requests], [list(r.output) for r in reqs], [r.finished for r in reqs],
                free_pages(worker), worker.state.root.clone())

    before = snapshot()
    with pytest.raises(RuntimeError, match="out of memory"):
        worker.abort([aborted])
    after = snapshot()
    assert after[:4] == before[:4] and torch.equal(after[4], before[4])
    failing[0] = False
    worker.abort([aborted])
    assert aborted.finished and worker.requests == tuple(others)
    failed = False
    while worker.requests:
        result = worker.launch_step()
        failing[0] = True
        before = snapshot()
        try:
            worker.finish_step(result)  # raises only in a step where a request finishes
        except RuntimeError:
            failed = True
            after = snapshot()
            assert after[:4] == before[:4] and torch.equal(after[4], before[4]) and worker.in_flight is result
            failing[0] = False
            worker.finish_step(worker.in_flight)
        failing[0] = False
    assert failed  # the request of 8 tokens finished before the other
    assert [r.output for r in others] == greedy_generate(target, group[1:2], 20) + greedy_generate(target, group[2:], 8)


@pytest.mark.parametrize("topk,ndt,draft_masks", [(2, 6, [(3, 2, 2), (3, 2, 4)]), (1, None, [None, None])])
def test_tree_mask_buffers_are_compact_and_preallocated(target, mtp, topk, ndt, draft_masks):
    """The verify pass's mask is [max_bs, ndt, ndt] bool (the prefix is always visible), a topk > 1
    draft step's [max_bs, topk, step * topk]; with topk 1 the verify block is causal and no pass
    has a mask buffer."""
    cfg = SpecConfig(num_steps=3, topk=topk, num_draft_tokens=ndt, max_batch_size=3, max_context_len=64)
    worker = EagleWorker(target, mtp, cfg)
    verify, = worker.verify_backend.get_verify_buffers_to_fill_after_draft()
    steps = [step.get_verify_buffers_to_fill_after_draft()[0] for step in worker.draft_backend.steps]
    if topk > 1:
        assert verify.dtype == torch.bool and verify.shape == (3, 6, 6)
        assert all(m.dtype == torch.bool for m in steps) and [tuple(m.shape) for m in steps] == draft_masks
    else:
        assert verify is None and steps == draft_masks


def test_tokens_go_to_the_host_before_draft_extend(target, mtp, monkeypatch):
    """launch_step enqueues the copy of the emitted tokens right after verify, before draft-extend,
    so finish_step's wait overlaps the draft-extend still running on the device."""
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=2, max_context_len=64))
    worker.add_requests(prompts(2, seed=18), 8)
    order = []
    step = worker.spec_step
    copy, extend = step.host_copy.enqueue, step.draft_extend
    monkeypatch.setattr(step.host_copy, "enqueue", lambda *a, **k: (order.append("copy"), copy(*a, **k))[1])
    monkeypatch.setattr(step, "draft_extend", lambda *a, **k: (order.append("draft_extend"), extend(*a, **k))[1])
    worker.step()
    assert order == ["copy", "draft_extend"]


def test_an_engine_editing_its_requests_changes_no_decode(target, mtp):
    """Clearing output already streamed, or lowering max_new_tokens, then a batch change: the
    worker's record of N and of each request's limits stays its own (not recomputed from the
    output or from max_new_tokens), and both requests decode target-only greedy tokens."""
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, page_size=4, max_batch_size=3, max_context_len=128))
    group = prompts(2, seed=19)
    reqs = worker.add_requests(group, 60)
    streamed = []
    for _ in range(6):
        worker.step()
    streamed += reqs[0].output
    reqs[0].output.clear()
    reqs[1].max_new_tokens = 5
    worker.add_requests(prompts(1, seed=20), 4)
    drain(worker)
    expected = greedy_generate(target, group, 60)
    assert streamed + reqs[0].output == expected[0] and reqs[1].output == expected[1]


def test_abort_frees_a_request_and_the_rest_run_on(target, mtp):
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=4, max_context_len=64))
    free = free_pages(worker)
    group = prompts(3, seed=16)
    reqs = worker.add_requests(group, 12)
    worker.step()
    emitted = list(reqs[1].output)
    for wrong, needle in ((reqs[1], r"abort takes a list of the Requests add_requests returned: abort\(\[request\]\), got Request"),
                          ([reqs[1].rid], "int 1 is not a Request this worker's add_requests returned"),
                          ([copy.copy(reqs[1])], "Request 1 is not a Request this worker's add_requests returned")):
        with pytest.raises(ValueError, match=needle):  # by id or with a copy: refused, nothing freed
            worker.abort(wrong)
    assert worker.requests == tuple(reqs)
    # Hashable and compared by identity, as abort takes them: an engine keys its tables by them.
    assert len({*reqs}) == 3 and copy.copy(reqs[1]) != reqs[1]
    worker.abort([reqs[1]])
    worker.abort([reqs[1]])  # no longer running: nothing to do
    assert reqs[1].finished and reqs[1].output == emitted and worker.requests == (reqs[0], reqs[2])
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
    with pytest.raises(ConfigError, match="attention_backend must be one of .*got 'flash_mla'"):
        SpecConfig(attention_backend="flash_mla")


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


def test_the_worker_keeps_its_own_config(target, mtp):
    """Edits of the caller's SpecConfig after the worker is built change nothing in the worker
    (its pools and backends were sized from it): it still runs a request to the end losslessly."""
    cfg = SpecConfig(num_steps=2, max_batch_size=2, max_context_len=64)
    worker = EagleWorker(target, mtp, cfg)
    cfg.max_context_len, cfg.num_steps, cfg.num_draft_tokens = 256, 3, 4
    group = [prompts(1, seed=14)[0][:10]]
    with pytest.raises(ValueError, match="exceed max_context_len 64"):
        worker.add_requests(group, 100)
    req, = worker.add_requests(group, 50)
    drain(worker)
    assert req.output == greedy_generate(target, group, 50)[0]


def test_the_workers_config_is_read_only(target, mtp):
    """An edit of worker.config is refused, naming dataclasses.replace (the worker was sized from
    it); copies of it, replace's, deepcopy's and pickle's, are editable and build another worker."""
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=2, max_context_len=64))
    with pytest.raises(ConfigError, match=r"read-only.*dataclasses.replace\(worker.config, topk=\.\.\.\)"):
        worker.config.topk = 2
    with pytest.raises(ConfigError, match="read-only"):
        del worker.config.max_context_len  # (would read the class default, 512)
    with pytest.raises(AttributeError):
        worker.config = dataclasses.replace(worker.config, max_context_len=128)  # (would admit what the pools cannot hold)
    with pytest.raises(AttributeError):
        worker.config.cuda_graph_batch_sizes.append(2)  # a tuple: GraphRunner's default buckets stay
    worker.config.validate()  # validating it again normalises nothing new and is allowed
    assert (worker.config.topk, worker.config.max_context_len, worker.config.cuda_graph_batch_sizes) == (1, 64, ())
    for other in (dataclasses.replace(worker.config, max_context_len=128), copy.deepcopy(worker.config),
                  pickle.loads(pickle.dumps(worker.config))):
        other.max_batch_size = 1
        assert other != worker.config
    bigger = EagleWorker(target, mtp, dataclasses.replace(worker.config, max_context_len=128))
    group = [prompts(1, seed=3)[0][:10]]
    req, = bigger.add_requests(group, 100)
    drain(bigger)
    assert req.output == greedy_generate(target, group, 100)[0]


def test_worker_calls_run_with_the_workers_device_current(monkeypatch):
    """specdec.device.on_device: a call makes the object's CUDA device current for its length
    (Triton launches, event records and graph captures take the current device) and leaves a CPU
    one alone; the worker's entry points carry it."""
    from specdec import device as device_module

    entered = []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append("exit")

    class Holder:
        def __init__(self, device):
            self.device = torch.device(device)

        @device_module.on_device
        def call(self, x):
            entered.append(("ran", x))
            return x + 1

    monkeypatch.setattr(torch.cuda, "device", Recorder)
    assert Holder("cuda:1").call(1) == 2 and Holder("cpu").call(5) == 6
    assert entered == [torch.device("cuda:1"), ("ran", 1), "exit", ("ran", 5)]
    wrapper = device_module.on_device(lambda self: None).__code__
    assert all(getattr(EagleWorker, name).__code__ is wrapper for name in ("add_requests", "launch_step", "finish_step", "abort"))
