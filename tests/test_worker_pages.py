"""The EAGLE worker's KV pages on CPU (fp32, torch_ref): requests take pages as they grow, give
back what they hold ahead when others need it, write nothing past their own pages, and run to
the end of their context."""

from __future__ import annotations

import pytest

from attn.paged import PagedMLABackend
from specdec.baseline import greedy_generate
from specdec.config import SpecConfig
from specdec.draft import StandaloneDraft
from specdec.kv import OutOfPagesError
from specdec.worker import EagleWorker
from spec_helpers import drain, free_pages, make_models, prompts, reference, run_to_completion


def padding_pages_untouched(worker) -> bool:
    """Whether no write reached either pool's padding page (page 0): one row past a request's
    pages lands there, where it changes no output."""
    return not any(cache[0].any() for pool in (worker.target_pool, worker.draft_pool) for cache in pool.kv_buffers)


def test_trees_smaller_than_their_depth_commit_only_inside_their_pages():
    """topk 2, num_steps 5, num_draft_tokens 3: the accepted path is at most 2 tokens past N, and
    commit_kv must not copy the path's padding columns to N + 3..N + 5, past the request's pages:
    in a reused row those positions may still name pages another running request now holds."""
    target, mtp = make_models()
    cfg = SpecConfig(num_steps=5, topk=2, num_draft_tokens=3, page_size=4, max_batch_size=2, max_context_len=64)
    worker = EagleWorker(target, mtp, cfg)
    first = prompts(1, seed=1)[0][:12]
    run_to_completion(worker, [([first], 3)])
    groups = [([[7], prompts(1, seed=5)[0]], 12)]  # [7] reuses the first request's row with one page
    outputs, _ = run_to_completion(worker, groups)
    assert outputs == reference(target, groups)
    assert padding_pages_untouched(worker)


def test_grow_ahead_pages_come_back_before_a_step_runs_out():
    """A request that grew while pages were free holds some past its need; another request's
    step takes them back rather than raising OutOfPagesError."""
    target, mtp = make_models()
    cfg = SpecConfig(num_steps=1, topk=1, page_size=4, max_batch_size=2, max_context_len=64, num_pages=8)
    worker = EagleWorker(target, mtp, cfg)
    early, = worker.add_requests([[1, 2, 3]], 20)
    for _ in range(3):
        worker.step()
    late, = worker.add_requests([[1, 2, 3, 4, 5, 6, 7]], 6)
    drain(worker)
    assert padding_pages_untouched(worker)
    assert early.output == greedy_generate(target, [[1, 2, 3]], 20)[0]
    assert late.output == greedy_generate(target, [[1, 2, 3, 4, 5, 6, 7]], 6)[0]


def test_grow_ahead_stops_at_a_requests_last_step(target, mtp):
    """A request grows ahead only as far as its last possible step needs: 3 prompt tokens and 4
    new ones never need more than 2 pages of 4, so it holds 2 and a request that fits beside them
    is admitted."""
    cfg = SpecConfig(num_steps=1, topk=1, page_size=4, max_batch_size=2, max_context_len=64, num_pages=10)
    worker = EagleWorker(target, mtp, cfg)
    short, = worker.add_requests([[1, 2, 3]], 4)
    worker.step()
    assert free_pages(worker) == (7, 7)  # 9 pages a pool; the request's last step needs 2
    long_prompt = list(range(1, 25))  # 7 pages a pool at most, beside the 2
    long, = worker.add_requests([long_prompt], 2)
    drain(worker)
    assert short.output == greedy_generate(target, [[1, 2, 3]], 4)[0]
    assert long.output == greedy_generate(target, [long_prompt], 2)[0]
    assert free_pages(worker) == (9, 9)


def test_admission_takes_back_grow_ahead_pages(target, mtp):
    """A new request that fits once the running ones hand back the pages they took ahead of their
    next step is admitted (not refused with OutOfPagesError), and both decode as target-only
    decoding does."""
    cfg = SpecConfig(num_steps=1, topk=1, page_size=4, max_batch_size=2, max_context_len=64, num_pages=12)
    worker = EagleWorker(target, mtp, cfg)
    early, = worker.add_requests([[1, 2, 3]], 30)
    for _ in range(5):
        worker.step()
    assert free_pages(worker) == (6, 6)  # 11 pages a pool: 3 for the next step, 2 ahead
    late_prompt = list(range(1, 31))  # 8 pages a pool with its first step's 2 positions
    late, = worker.add_requests([late_prompt], 2)
    assert free_pages(worker) == (0, 0)
    drain(worker)
    assert early.output == greedy_generate(target, [[1, 2, 3]], 30)[0]
    assert late.output == greedy_generate(target, [late_prompt], 2)[0]
    assert free_pages(worker) == (11, 11)
    assert padding_pages_untouched(worker)


def test_standalone_admission_counts_the_draft_pools_extra_position(target):
    """A standalone draft's pool holds one position more than the target's (the first output): an
    admission that fits the target's pages but not the draft's is refused and takes no grow-ahead
    page back (the check comes before any page is taken back)."""
    cfg = SpecConfig(num_steps=1, topk=1, draft_mode="standalone", page_size=4, max_batch_size=2, max_context_len=64,
                     num_pages=12)
    worker = EagleWorker(target, StandaloneDraft(target), cfg)
    early, = worker.add_requests([[1, 2, 3]], 30)
    for _ in range(3):
        worker.step()
    assert free_pages(worker) == (6, 6)  # and two pages ahead a pool
    with pytest.raises(OutOfPagesError, match=r"admitting 1 request\(s\) needs the draft pool 9 pages, 6 free and 2 "
                                              r"held ahead of need; abort a running request, add fewer, or raise "
                                              r"SpecConfig.num_pages") as refused:
        worker.add_requests([list(range(1, 31))], 2)  # with its first step: 8 target pages, 9 draft pages
    assert refused.value.__context__ is None  # not shown beneath the allocator's own, first refusal
    assert free_pages(worker) == (6, 6)  # the refused call took no page back
    drain(worker)
    assert early.output == greedy_generate(target, [[1, 2, 3]], 30)[0]
    assert free_pages(worker) == (11, 11) and padding_pages_untouched(worker)


def test_admission_holds_the_first_steps_pages(target, mtp):
    """A request is admitted only with the pages of its first step, not only its prompt's (the
    next step would raise OutOfPagesError): refused, it changes nothing; the running request
    finishes, and then it fits."""
    cfg = SpecConfig(num_steps=1, topk=1, page_size=4, max_batch_size=2, max_context_len=64, num_pages=12)
    worker = EagleWorker(target, mtp, cfg)
    early, = worker.add_requests([[1, 2, 3]], 4)  # its last step needs 2 pages a pool
    assert free_pages(worker) == (9, 9)
    late_prompt = list(range(1, 37))  # 9 pages a pool; with its first step's 2 positions, 10
    with pytest.raises(OutOfPagesError, match="needs the target pool 10 pages, 9 free and 0 held ahead of need and "
                                              "the draft pool 10 pages, 9 free"):
        worker.add_requests([late_prompt], 2)
    assert free_pages(worker) == (9, 9) and worker.requests == (early,)
    drain(worker)
    late, = worker.add_requests([late_prompt], 2)
    assert [worker.target_pool.capacity[late.target_row], worker.draft_pool.capacity[late.draft_row]] == [40, 40]
    drain(worker)
    assert early.output == greedy_generate(target, [[1, 2, 3]], 4)[0]
    assert late.output == greedy_generate(target, [late_prompt], 2)[0]
    assert free_pages(worker) == (11, 11) and padding_pages_untouched(worker)


def test_a_request_longer_than_the_pool_is_refused(target, mtp):
    """A request whose last step needs more pages than a pool has could never finish (alone, its
    own growth would run the pool out): refused with a ValueError naming num_pages, before anything
    changes. One page less is admitted, and runs to its end."""
    cfg = SpecConfig(num_steps=1, topk=1, page_size=4, max_batch_size=3, max_context_len=64, num_pages=12)
    worker = EagleWorker(target, mtp, cfg)
    running, = worker.add_requests([[1, 2, 3]], 4)
    free = free_pages(worker)
    with pytest.raises(ValueError, match="needs 12 KV pages of the target pool at its last step, which has 11; "
                                         "raise SpecConfig.num_pages"):
        worker.add_requests([[5], [5, 6]], 43)  # [5, 6]'s last step at N = 43 writes up to 45 ([5]: 44)
    assert free_pages(worker) == free and worker.requests == (running,)
    drain(worker)
    longest, = worker.add_requests([[5, 6]], 42)  # up to 44: 11 pages
    drain(worker)
    assert running.output == greedy_generate(target, [[1, 2, 3]], 4)[0]
    assert longest.output == greedy_generate(target, [[5, 6]], 42)[0]


@pytest.mark.parametrize("draft_mode,topk,num_steps,ndt", [
    ("eagle", 1, 3, None), ("eagle", 2, 3, 6), ("eagle", 4, 3, 5), ("standalone", 1, 3, None), ("standalone", 4, 3, 5),
])
def test_a_request_that_fills_its_context_exactly_runs_to_the_end(target, mtp, monkeypatch, draft_mode, topk, num_steps,
                                                                  ndt):
    """A prompt of max_context_len - max_new_tokens - spec_headroom tokens is admitted, its last
    step runs at N = prompt + max_new_tokens - 2 and some pass attends to the whole context, every
    write inside it (the pools refuse more: the headroom is neither short nor long), and it decodes
    the greedy tokens; one token more is refused."""
    draft = StandaloneDraft(target) if draft_mode == "standalone" else mtp
    cfg = SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=ndt, draft_mode=draft_mode, max_batch_size=1,
                     max_context_len=64)
    worker = EagleWorker(target, draft, cfg)
    max_new = 14  # the identity draft advances 4 a step: from the prompt, N reaches prompt + 12
    prompt = prompts(1, seed=11)[0] * 8
    prompt = prompt[:64 - max_new - cfg.spec_headroom]
    with pytest.raises(ValueError, match="exceed max_context_len"):
        worker.add_requests([prompt + [1]], max_new)
    kv_ends = []  # every pass's longest kv (its new tokens included), target and draft alike
    init = PagedMLABackend.init_forward_metadata
    monkeypatch.setattr(PagedMLABackend, "init_forward_metadata",
                        lambda self, batch, *args, **kwargs: kv_ends.append(int(batch.seq_lens.max()))
                        or init(self, batch, *args, **kwargs))
    req, = worker.add_requests([prompt], max_new)
    seen = []
    while worker.requests:
        seen.append(req.seq_len)
        worker.step()
    assert max(seen) == len(prompt) + max_new - 2
    assert max(kv_ends) == cfg.max_context_len
    assert req.output == greedy_generate(target, [prompt], max_new)[0]
    assert padding_pages_untouched(worker)


@pytest.mark.parametrize("draft_mode", ["eagle", "standalone"])
def test_a_request_of_one_new_token_needs_only_its_prompt(target, mtp, draft_mode):
    """max_new_tokens=1 ends at the prefill: no spec headroom. An EAGLE draft admits a prompt of
    max_context_len tokens; a standalone draft, whose pool also holds the first output, one less."""
    draft = StandaloneDraft(target) if draft_mode == "standalone" else mtp
    worker = EagleWorker(target, draft, SpecConfig(num_steps=2, draft_mode=draft_mode, max_batch_size=2, max_context_len=64))
    longest = 64 - (draft_mode == "standalone")
    prompt = (prompts(1, seed=13)[0] * 8)[:longest]
    with pytest.raises(ValueError, match="exceed max_context_len 64"):
        worker.add_requests([prompt + [1]], 1)
    with pytest.raises(ValueError, match="spec headroom exceed"):
        worker.add_requests([prompt], 2)
    req, = worker.add_requests([prompt], 1)
    assert req.finished and req.output == greedy_generate(target, [prompt], 1)[0] and not worker.requests
    assert free_pages(worker) == (worker.config.pool_pages - 1,) * 2


def test_a_step_refused_for_pages_changes_neither_pool():
    """A step refused for pages takes none, even where the target pool could grow before the draft
    pool runs short, or a pool trims its grow-ahead before finding too few. Scans pool sizes for
    steps that run out, each of which must leave free pages and every request's capacity as they
    were, and decode losslessly once a request is aborted."""
    from toy_models import ToyTarget, noisy_twin

    target = ToyTarget(vocab=64)
    draft = StandaloneDraft(noisy_twin(target))

    def pools(worker) -> tuple:
        """Free pages, and each running request's capacity in both pools."""
        return free_pages(worker), {r.rid: (worker.target_pool.capacity[r.target_row],
                                            worker.draft_pool.capacity[r.draft_row]) for r in worker.requests}

    refused = 0
    for num_pages in range(8, 30):
        cfg = SpecConfig(num_steps=3, draft_mode="standalone", page_size=4, max_batch_size=3, max_context_len=128,
                         num_pages=num_pages)
        worker = EagleWorker(target, draft, cfg)
        try:
            requests = worker.add_requests([[1, 2, 3], [4, 5]], 40)
        except (OutOfPagesError, ValueError):
            continue
        while worker.requests:
            before = pools(worker)
            try:
                worker.step()
            except OutOfPagesError:
                refused += 1
                assert pools(worker) == before, num_pages
                worker.abort([worker.requests[-1]])
        for request in requests:
            expected = greedy_generate(target, [request.prompt], 40)[0]
            assert request.output == expected[:len(request.output)]
    assert refused > 0
