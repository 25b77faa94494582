"""Prefill: prompts in passes of at most max_prefill_tokens (chunked prefill), and the kv a
prefill writes into both pools (an fp8 cache's kv_scale)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdec.prefill
from specdec.baseline import greedy_generate
from specdec.batch import run_pass
from specdec.config import ConfigError, SpecConfig
from specdec.draft import StandaloneDraft
from specdec.worker import EagleWorker
from spec_helpers import drain, prompts, reference


def cached(pool, row: int, n: int) -> torch.Tensor:
    """``[layers, n, 576]``: the pool's kv of positions [0, n) of req_to_token row ``row``."""
    loc = pool.req_to_token[row, :n].long()
    return torch.stack([cache.flatten(0, 1)[loc] for cache in pool.kv_buffers])


@pytest.mark.parametrize("draft_mode,topk", [("eagle", 1), ("eagle", 2), ("standalone", 1)])
def test_prefill_runs_in_passes_of_at_most_max_prefill_tokens(target, mtp, draft_mode, topk, monkeypatch):
    """Prompts of 3, 4, 9, 2 and 2 tokens under a cap of 6 prefill in chunks, a long prompt over
    several passes (each pass's target and draft pieces checked). The caches and first draft
    candidates equal those of one pass over every prompt, and the outputs stay the greedy ones; a
    standalone draft's passes take the first output after each finished prompt."""
    off = 1 if draft_mode == "standalone" else 0
    draft = StandaloneDraft(target) if draft_mode == "standalone" else mtp
    cfg = SpecConfig(num_steps=2, topk=topk, num_draft_tokens=2 * topk + 1, draft_mode=draft_mode, max_batch_size=5,
                     max_context_len=64, max_prefill_tokens=6)
    worker = EagleWorker(target, draft, cfg)
    whole = EagleWorker(target, draft, SpecConfig(**{**cfg.__dict__, "max_prefill_tokens": 64}))
    passes = []
    mine = (worker.target_prefill_backend, worker.draft_prefill_backend)

    def record(model, backend, batch, *inputs):
        if batch.mode.value == "extend" and any(backend is b for b in mine):
            passes.append((model is target, batch.cu_seqlens_q.diff().tolist(), batch.seq_lens.tolist()))
        return run_pass(model, backend, batch, *inputs)

    monkeypatch.setattr(specdec.prefill, "run_pass", record)
    lengths = [3, 4, 9, 2, 2]
    groups = [([p[:n] for p, n in zip(prompts(5, seed=8), lengths)], 6)]
    chunked, one_pass = worker.add_requests(*groups[0]), whole.add_requests(*groups[0])
    for a, b in zip(chunked, one_pass):  # every layer's kv of the prompt (and the standalone's first output)
        torch.testing.assert_close(cached(worker.target_pool, a.target_row, len(a.prompt)),
                                   cached(whole.target_pool, b.target_row, len(b.prompt)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cached(worker.draft_pool, a.draft_row, len(a.prompt) + off),
                                   cached(whole.draft_pool, b.draft_row, len(b.prompt) + off), atol=1e-5, rtol=1e-5)
    for name in ("root", "hidden", "cand_probs", "cand_ids"):
        torch.testing.assert_close(getattr(worker.state, name), getattr(whole.state, name), atol=1e-5, rtol=1e-5)
    drain(worker)
    assert [r.output for r in chunked] == reference(target, groups)
    target_passes = [(q, kv) for is_target, q, kv in passes if is_target]
    draft_passes = [(q, kv) for is_target, q, kv in passes if not is_target]
    if off == 0:  # 3 | 3 of 4 | 1 + 5 of 9 | 4 + 2 | 2: kv lengths end where each piece ends
        assert target_passes == [([3, 3], [3, 3]), ([1, 5], [4, 5]), ([4, 2], [9, 2]), ([2], [2])]
        assert draft_passes == target_passes
    else:  # each finished prompt costs one token more in the draft's pass
        assert target_passes == [([3, 2], [3, 2]), ([2, 3], [4, 3]), ([5], [8]), ([1, 2, 1], [9, 2, 1]), ([1], [2])]
        assert draft_passes == [([4, 2], [4, 2]), ([3, 3], [5, 3]), ([5], [8]), ([2, 3, 1], [10, 3, 1]), ([2], [3])]
    assert all(sum(q) <= 6 for q, _ in draft_passes)


def test_a_prefill_backend_that_takes_fewer_tokens_gets_passes_of_its_size(target, mtp):
    """A prefill backend's max_prefill_tokens (flashinfer_mla's plan capacity) caps the passes
    below SpecConfig.max_prefill_tokens: the same passes as a config cap of that size."""
    lengths = [3, 4, 9, 2, 2]
    group = [p[:n] for p, n in zip(prompts(5, seed=8), lengths)]
    capped = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=5, max_context_len=64, max_prefill_tokens=6))
    worker = EagleWorker(target, mtp, SpecConfig(num_steps=2, max_batch_size=5, max_context_len=64))
    worker.draft_prefill_backend.max_prefill_tokens = 6
    passes = [[[(r.rid, s, n) for r, s, n in pieces] for pieces in w.prefill.passes(w.add_requests(group, 2))]
              for w in (capped, worker)]
    assert passes[0] == passes[1] and len(passes[0]) == 4


def test_prefill_pieces_cover_the_prompts_in_order_within_the_cap():
    """prefill_pieces over random lengths and caps: the pieces spell every prompt in order, no pass
    holds two pieces of one prompt, and every pass costs at most the cap unless it is one piece."""
    from specdec.batch import prefill_pieces
    rng = np.random.default_rng(3)
    for _ in range(300):
        lengths = rng.integers(1, 40, size=rng.integers(1, 6)).tolist()
        cap, extra = int(rng.integers(1, 30)), int(rng.integers(0, 2))
        passes = prefill_pieces(lengths, cap, extra)
        flat = [piece for pieces in passes for piece in pieces]
        assert [(i, s) for i, s, _ in flat] == [(i, s) for i, n in enumerate(lengths) for s in
                                                np.cumsum([0] + [n for j, _, n in flat if j == i])[:-1].tolist()]
        assert all(sum(n for j, _, n in flat if j == i) == n for i, n in enumerate(lengths))
        for pieces in passes:
            assert pieces and len({i for i, _, _ in pieces}) == len(pieces)
            cost = sum(n + (extra if s + n == lengths[i] else 0) for i, s, n in pieces)
            assert cost <= cap or len(pieces) == 1
    with pytest.raises(ConfigError, match="max_prefill_tokens must be >= 1"):
        SpecConfig(max_prefill_tokens=0)


def test_target_only_prefill_in_passes_matches_one_pass(target, monkeypatch):
    """Target-only greedy decoding with its prefill cut into 5-token passes gives the tokens of one pass."""
    import specdec.baseline
    group = [p[:n] for p, n in zip(prompts(3, seed=4), [12, 3, 7])]
    whole = greedy_generate(target, group, 6)
    monkeypatch.setattr(specdec.baseline, "MAX_PREFILL_TOKENS", 5)
    assert greedy_generate(target, group, 6) == whole


def test_kv_scale_reaches_both_pools_of_an_fp8_cache(target):
    """SpecConfig.kv_scale: an fp8_e4m3 cache stores kv / kv_scale, in the target's pool and the
    draft's. A layer's first kv input does not depend on attention, so the first layer's rows of
    the prompt equal the fp32 cache's values over 4, rounded to e4m3; the draft here is the target
    itself (standalone), whose first layer writes the same rows into its own pool. Bad scales are
    refused up front."""
    group = prompts(2, seed=12)
    workers = [EagleWorker(target, StandaloneDraft(target),
                           SpecConfig(num_steps=2, kv_dtype=dtype, kv_scale=scale, draft_mode="standalone",
                                      max_batch_size=2, max_context_len=64))
               for scale, dtype in ((1.0, "fp32"), (4.0, "fp8_e4m3"))]
    exact, scaled = (w.add_requests(group, 6) for w in workers)
    for a, b in zip(exact, scaled):
        want = (cached(workers[0].target_pool, a.target_row, len(a.prompt))[0] / 4).to(torch.float8_e4m3fn)
        for pool, row in ((workers[1].target_pool, b.target_row), (workers[1].draft_pool, b.draft_row)):
            got = cached(pool, row, len(b.prompt))[0]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    for bad in (0.0, -1.0, float("inf"), True, "2", 1e-50, 1e39):  # (1e-50 is 0 in fp32, 1e39 inf)
        with pytest.raises(ConfigError, match=r"kv_scale must be a finite number in \[2\*\*-64, 2\*\*64\]"):
            SpecConfig(kv_dtype="fp8_e4m3", kv_scale=bad)
    with pytest.raises(ConfigError, match="scales an fp8_e4m3 cache only"):
        SpecConfig(kv_dtype="bf16", kv_scale=2.0)
