"""Tree rejection sampling preserves the target distribution (statistical tests on CPU)."""

import re

import pytest
import torch

from spec_helpers import make_models
from specdec.baseline import greedy_generate, sequence_logits
from specdec.config import SpecConfig
from specdec.draft import StandaloneDraft
from specdec.accept import greedy_accept, target_probs, tree_rejection_sample
from specdec.sampling import SamplingParams, hash_uniform
from specdec.tree import DraftTree, VerifyTree, topk_probs
from specdec.worker import EagleWorker

N = 40_000  # samples, one batch row each; TV bound below is ~6 standard errors


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


def make_tree(batch: int, topk: int, num_steps: int, ndt: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    probs0 = torch.rand(1, vocab, generator=g).softmax(-1)
    p, ids = probs0.topk(topk)
    tree = DraftTree(p.expand(batch, -1), ids.expand(batch, -1))
    for _ in range(num_steps - 1):
        q = torch.rand(1, topk, vocab, generator=g).softmax(-1)
        cp, cid = q.topk(topk)
        tree.grow(cp.expand(batch, -1, -1), cid.expand(batch, -1, -1))
    return tree.build(torch.zeros(batch, dtype=torch.long), ndt, num_steps)


def tv_bound(n: int) -> float:
    """TV a sampler of n draws over a few tokens stays under: an exact one's expected TV is at most
    ~0.9 / sqrt(n) over 6 tokens, its spread ~0.25 / sqrt(n)."""
    return 2.0 / n ** 0.5


@pytest.mark.parametrize("topk,num_steps,ndt", [(1, 3, 4), (2, 3, 6), (3, 2, 7)])
def test_every_depth_of_the_tree_follows_the_target(topk, num_steps, ndt):
    """The token emitted after each accepted tree node (a child accepted, or a residual or bonus
    draw) follows the target's distribution after that node, at every depth: a sampler wrong past
    the first drafted token (a residual of another node, or a distorted one) still emits the right
    first token. The targets favour the drafted children, so deep nodes are reached."""
    vocab, n = 6, 60_000
    vt = make_tree(n, topk, num_steps, ndt, vocab, seed=topk)
    g = torch.Generator().manual_seed(100 + topk)
    logits = torch.randn(1, ndt, vocab, generator=g) * 1.5
    for node in range(1, ndt):  # +2 on the token of each node, in its parent's distribution
        logits[0, vt.parents[0, node], vt.tokens[0, node]] += 2.0
    node_probs = logits.softmax(-1).expand(n, -1, -1)
    res = tree_rejection_sample(vt, node_probs, torch.arange(n), torch.zeros(n, dtype=torch.long), num_steps)
    checked = set()
    for node in range(ndt):
        path = []  # the node's tokens from depth 1 down, and its depth
        walk = node
        while walk:
            path.insert(0, int(vt.tokens[0, walk]))
            walk = int(vt.parents[0, walk])
        depth = len(path)
        rows = res.accept_len >= depth
        if depth:
            rows &= (res.emitted[:, :depth] == torch.tensor(path)).all(-1)
        if rows.sum() < 1000:
            continue
        after = res.emitted[rows, depth]
        assert tv(torch.bincount(after, minlength=vocab).double(), node_probs[0, node].double()) < tv_bound(int(rows.sum()))
        checked.add(depth)
    assert checked == set(range(int(vt.depth[0].max()) + 1))  # every depth, the leaves' bonus draws included


def test_rejected_children_leave_the_bonus_residual_when_the_root_token_is_one_of_theirs():
    """Every child of the root rejected, the bonus comes from the root's distribution less the
    children's tokens, also where the root's token is a child's (tokens repeat across depths).
    max_children 3 over 2 children pads with the root's token: a residual built by scattering over
    every child column, padding included, would write the rejected token's probability back."""
    n = 40_000
    vt = VerifyTree(tokens=torch.tensor([[2, 2, 3, 0]]).expand(n, -1), parents=torch.tensor([[0, 0, 0, 1]]).expand(n, -1),
                    depth=torch.tensor([[0, 1, 1, 2]]).expand(n, -1), child_rank=torch.tensor([[0, 0, 1, 0]]).expand(n, -1),
                    mask=torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool).expand(n, -1, -1))
    probs = torch.tensor([[0.1, 0.1, 0.4, 0.4], [1.0, 0.0, 0.0, 0.0], [0.25] * 4, [0.25] * 4]).expand(n, -1, -1)
    res = tree_rejection_sample(vt, probs, torch.arange(n), torch.zeros(n, dtype=torch.long), 2, max_children=3)
    stopped = res.accept_len == 0
    assert set(res.emitted[stopped, 0].tolist()) == {0, 1}
    # Child 2 (token 2) with 0.4; else child 3 (token 3) with 0.4 / 0.6; else a bonus of 0 or 1: the root's distribution.
    first = torch.bincount(res.emitted[:, 0], minlength=4).double()
    assert tv(first, probs[0, 0].double()) < tv_bound(n)


def test_a_child_holding_the_last_token_with_mass_is_taken():
    """top-k 2 keeps two tokens, both the root's children: rejecting the first leaves the second
    all the mass, so it must be taken. This draw (seed found by search) is one where a threshold
    computed as p / (sum - the rejected p) falls an ulp below 1: every child would be rejected and
    the bonus drawn from an all-zero residual (token V - 1, which the target gives probability 0)."""
    logits = torch.tensor([[-2.9891786575317383, -1.0215553045272827, -0.4190954864025116, -0.37579426169395447,
                            5.43334436416626, -0.0911627933382988, -0.5446845889091492, -0.7555745840072632]])
    row = target_probs(logits, torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([2]))
    tree = DraftTree(torch.tensor([[0.6, 0.4]]), torch.tensor([[4, 5]])).build(torch.tensor([0]), 3, 1)
    res = tree_rejection_sample(tree, row.expand(3, -1)[None], torch.tensor([19134814]), torch.tensor([0]), 1,
                                max_children=2)
    assert res.accept_len.tolist() == [1] and res.emitted.tolist() == [[5, 4]]


def test_temperature_zero_is_greedy():
    vt = make_tree(64, 2, 3, 6, 10, seed=3)
    logits = torch.randn(64 * 6, 10)
    zeros = torch.zeros(64 * 6)
    probs = target_probs(logits, zeros, torch.ones_like(zeros), torch.zeros(64 * 6, dtype=torch.long)).view(64, 6, 10)
    sampled = tree_rejection_sample(vt, probs, torch.arange(64), torch.zeros(64, dtype=torch.long), 3)
    greedy = greedy_accept(vt, logits.view(64, 6, 10).argmax(-1), 3)
    assert torch.equal(sampled.emitted, greedy.emitted)


def test_top_k_top_p_temperature():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).expand(3, -1)
    probs = target_probs(logits, torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 0.7, 1.0]), torch.tensor([2, 0, 0]))
    full = torch.softmax(torch.tensor([3.0, 2.0, 1.0, 0.0]), -1)
    torch.testing.assert_close(probs[0], torch.cat([full[:2] / full[:2].sum(), torch.zeros(2)]))
    assert (probs[1] > 0).tolist() == [True, True, False, False]  # 0.66 < 0.7 needs the second token
    torch.testing.assert_close(probs[2], torch.softmax(torch.tensor([1.5, 1.0, 0.5, 0.0]), -1))


def test_greedy_rows_pick_the_first_of_tied_maxima_as_argmax_does():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(500, 97, generator=g)
    top = logits.argmax(-1)
    twin = (top + 1 + torch.randint(0, 96, (500,), generator=g)) % 97  # another column, before or after
    logits[torch.arange(500), twin] = logits[torch.arange(500), top]
    zeros = torch.zeros(500)
    probs = target_probs(logits, zeros, torch.ones(500), torch.zeros(500, dtype=torch.long))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.max(-1).values, torch.ones(500))


def test_tiny_temperatures_and_top_p_stay_finite():
    """A temperature that overflows logits / T, and a top_p that rounds to 0 in fp32, still give
    the greedy token: a one-hot row, not NaN (a NaN row samples as the last token)."""
    logits = torch.tensor([[3.0, 9.0, -2.0, 1.0]]).expand(4, -1)
    probs = target_probs(logits, torch.tensor([1e-39, 1e-44, 1.0, 1e-30]), torch.tensor([1.0, 1.0, 1e-46, 1.0]),
                         torch.zeros(4, dtype=torch.long))
    assert torch.equal(probs, torch.eye(4)[1].expand(4, -1))
    _, ids = topk_probs(logits, 2, torch.tensor([1e-39, 1e-44, 1.0, 1e-30]))
    assert ids[:, 0].tolist() == [1, 1, 1, 1]


def test_non_finite_logits_give_argmax_to_greedy_rows_and_a_distribution_to_sampled_ones():
    """Rows with +inf (a 16-bit head that overflowed), NaN or no finite logit give finite
    distributions summing to 1: greedy rows one-hot on torch.argmax's choice (what target-only
    greedy takes), sampled rows spread over the +inf tokens, over the finite ones with NaN as -inf,
    or uniform. A NaN row would sample as the last token id."""
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[1.0, inf, 2.0, inf, 0.5], [1.0, 3.0, nan, 2.0, 0.5], [-inf] * 5, [nan, -inf, nan, -inf, nan],
                         [1.0, 3.0, -inf, 2.0, inf]])
    n = rows.shape[0]
    for temperature in (0.0, 1.0):
        probs = target_probs(rows, torch.full((n,), temperature), torch.ones(n), torch.zeros(n, dtype=torch.long))
        assert probs.isfinite().all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(n))
        if temperature == 0:
            assert torch.equal(probs.argmax(-1), rows.argmax(-1)) and torch.equal(probs.amax(-1), torch.ones(n))
    finite_row = torch.tensor([1.0, 3.0, -inf, 2.0, 0.5])  # row 1 with its NaN as -inf
    expected = torch.stack([torch.tensor([0, 0.5, 0, 0.5, 0]), torch.softmax(finite_row, -1), torch.full((5,), 0.2),
                            torch.full((5,), 0.2), torch.tensor([0, 0, 0, 0, 1.0])])
    torch.testing.assert_close(probs, expected)
    _, ids = topk_probs(rows, 1, torch.ones(n))
    assert ids[[0, 1, 4], 0].tolist() == [1, 1, 4]


def test_worker_decodes_a_target_with_an_infinite_logit_as_target_only_greedy():
    from toy_models import ToyTarget, noisy_twin

    class Overflowing(ToyTarget):
        def compute_logits(self, hidden):
            logits = super().compute_logits(hidden)
            logits[:, 5] = float("inf")
            return logits

    target = Overflowing(vocab=32, seed=3)
    expected = greedy_generate(target, [[1, 2, 3]], 8)[0]
    for sampling in (False, True):
        cfg = SpecConfig(num_steps=2, draft_mode="standalone", enable_sampling=sampling, page_size=4, max_batch_size=2,
                         max_context_len=64)
        worker = EagleWorker(target, StandaloneDraft(noisy_twin(target)), cfg)
        params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1)] if sampling else None
        reqs = worker.add_requests([[1, 2, 3]] * (2 if sampling else 1), 8, sampling=params)
        while worker.requests:
            worker.step()
        # the +inf token everywhere, the prefill's included, greedy and sampled alike
        assert all(r.output == expected == [5] * 8 for r in reqs)


def test_top_p_one_keeps_the_whole_vocabulary():
    """fp32's running sum reaches 1 before a long tail ends: top_p = 1 must not cut it there."""
    logits = torch.randn(8, 129280, generator=torch.Generator().manual_seed(0)) * 3
    ones = torch.ones(8)
    probs = target_probs(logits, ones, ones, torch.zeros(8, dtype=torch.long))
    assert (probs > 0).all()
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


def test_hash_uniform_is_uniform_and_reproducible():
    seeds = torch.arange(50_000)
    u = hash_uniform(seeds, torch.full_like(seeds, 7), 3)
    assert torch.equal(u, hash_uniform(seeds, torch.full_like(seeds, 7), 3))
    assert 0 <= u.min() and u.max() < 1
    assert tv(torch.histc(u.float(), 10, 0, 1).double(), torch.full((10,), 0.1, dtype=torch.float64)) < 0.01
    assert not torch.equal(u, hash_uniform(seeds, torch.full_like(seeds, 8), 3))


def test_bad_sampling_params():
    for kw in (dict(temperature=-1), dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=0),
               dict(top_p=float("nan")), dict(top_k=-2), dict(top_k=1.5), dict(top_k=2**64), dict(seed=2**63), dict(seed=0.5), dict(temperature=True),
               dict(top_p="1"), dict(temperature=1e39)):
        (name, value), = kw.items()
        with pytest.raises(ValueError, match=rf"^{name} must be .*, got {re.escape(repr(value))}$"):
            SamplingParams(**kw)


def test_the_largest_fp32_temperature_still_ranks_by_logit():
    """Temperatures up to fp32's largest are accepted and keep top-k/top-p ranking the likeliest
    tokens (one beyond it would be inf in the worker's fp32 tensors: every logit 0, and top_k=1
    would emit token 0, not the argmax)."""
    big = float(torch.finfo(torch.float32).max)
    SamplingParams(temperature=big, top_k=1)
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    one = lambda v, dtype=torch.float32: torch.tensor([v], dtype=dtype)
    probs = target_probs(logits, one(big), one(1.0), one(1, torch.int64))
    assert probs.tolist() == [[0.0, 0.0, 1.0, 0.0]]
    probs = target_probs(logits, one(big), one(0.5), one(0, torch.int64))
    assert probs.tolist() == [[0.0, 0.0, 0.5, 0.5]]


@pytest.mark.parametrize("topk,ndt", [(1, None), (2, 6)])
def test_worker_samples_the_target_distribution(topk, ndt):
    """Seeded requests under three sampling settings, the draft the target itself (drafts are
    often accepted): each of the first three tokens (the prefill's, then the first step's first
    two: an accepted draft or a residual draw, and what follows an accepted one), given the tokens
    before it, follows the target's distribution under the request's own settings. Greedy requests
    in the same batches get exactly the greedy output. Three settings, because a worker that
    sampled at temperature 1 whatever the request asked, or ignored top_k and top_p, would pass a
    test of temperature 0.9 alone."""
    vocab, prompt, new_tokens = 6, [1, 2, 3, 4, 5], 3
    settings = [dict(temperature=0.5), dict(temperature=2.0, top_k=3), dict(temperature=1.0, top_p=0.6)]
    target, _ = make_models(vocab_size=vocab)
    cfg = SpecConfig(num_steps=3, topk=topk, num_draft_tokens=ndt, draft_mode="standalone", enable_sampling=True,
                     max_batch_size=256, max_context_len=32)
    worker = EagleWorker(target, StandaloneDraft(target), cfg)
    greedy = greedy_generate(target, [prompt], new_tokens)[0]
    n_batches, per_batch = 24, 256
    sampled: list[list[list[int]]] = [[] for _ in settings]
    accepted = 0
    for b in range(n_batches):
        kinds = [None if i % 16 == 0 else i % len(settings) for i in range(per_batch)]
        params = [SamplingParams(**(settings[k] if k is not None else dict(temperature=0.0)), seed=b * per_batch + i)
                  for i, k in enumerate(kinds)]
        reqs = worker.add_requests([prompt] * per_batch, new_tokens, sampling=params)
        while worker.requests:
            accepted += sum(worker.step().accept_lens)
        for req, kind in zip(reqs, kinds):
            if kind is None:
                assert req.output == greedy
            else:
                sampled[kind].append(req.output)
    assert accepted > sum(map(len, sampled)) // 4  # the acceptance path is exercised, not only bonus draws

    def probs(ids: list[int], setting: dict) -> torch.Tensor:
        logits = sequence_logits(target, ids)[-1:]
        one = lambda name, default, dtype=torch.float32: torch.tensor([setting.get(name, default)], dtype=dtype)
        return target_probs(logits, one("temperature", 1.0), one("top_p", 1.0), one("top_k", 0, torch.long))[0].double()

    covered = []  # positions with a prefix of enough samples, per setting
    for setting, outputs in zip(settings, sampled):
        outputs = torch.tensor(outputs)
        checked = set()
        for pos in range(new_tokens):
            for prefix in {tuple(row[:pos].tolist()) for row in outputs}:
                rows = (outputs[:, :pos] == torch.tensor(prefix, dtype=torch.long)).all(-1)
                if rows.sum() < 400:
                    continue
                counts = torch.bincount(outputs[rows, pos], minlength=vocab).double()
                assert tv(counts, probs(prompt + list(prefix), setting)) < tv_bound(int(rows.sum())), (setting, prefix)
                checked.add(pos)
        covered.append(checked)
    # Every setting's first two tokens; the third where its likeliest prefixes are common enough
    # (not at temperature 2, whose ~1900 samples spread over 9 prefixes).
    assert all(checked >= {0, 1} for checked in covered) and any(2 in checked for checked in covered), covered


def test_each_step_draws_new_uniforms():
    """Every spec step draws fresh random numbers (DecodeState.counter advances). A target whose
    logits are all equal samples i.i.d. uniform tokens at temperature 1, so consecutive emitted
    tokens agree with probability 1 / vocab; a step that reused the previous step's uniforms would
    emit the same token every step."""
    vocab, n, max_new = 6, 64, 12
    target, _ = make_models(vocab_size=vocab)
    with torch.no_grad():
        target.lm_head.weight.zero_()  # every logit 0: the target's distribution is uniform
    cfg = SpecConfig(num_steps=1, topk=1, draft_mode="standalone", enable_sampling=True, max_batch_size=n,
                     max_context_len=64)
    worker = EagleWorker(target, StandaloneDraft(target), cfg)
    reqs = worker.add_requests([[1, 2, 3]] * n, max_new,
                               sampling=[SamplingParams(temperature=1.0, seed=s) for s in range(n)])
    while worker.requests:
        worker.step()
    tokens = torch.tensor([r.output[1:] for r in reqs])  # the step-emitted tokens
    same = (tokens[:, 1:] == tokens[:, :-1]).double().mean().item()
    assert abs(same - 1 / vocab) < 0.06, same  # ~700 pairs: sd ~0.014
    counts = torch.bincount(tokens.flatten(), minlength=vocab).double()
    assert (counts / counts.sum() - 1 / vocab).abs().max() < 0.04


def test_unseeded_requests_sample_independently_and_record_their_seed():
    """Requests without a seed each get a fresh one, so unseeded requests of one prompt sample
    different tokens; the seed lands in Request.sampling, and passing it back replays the
    request."""
    vocab, n, max_new = 6, 16, 8
    target, _ = make_models(vocab_size=vocab)
    with torch.no_grad():
        target.lm_head.weight.zero_()  # uniform: two of 16 outputs of 8 tokens agree with p < 1e-4
    cfg = SpecConfig(num_steps=2, topk=1, draft_mode="standalone", enable_sampling=True, max_batch_size=n,
                     max_context_len=64)
    worker = EagleWorker(target, StandaloneDraft(target), cfg)
    reqs = worker.add_requests([[1, 2, 3]] * n, max_new, sampling=[SamplingParams(temperature=1.0)] * n)
    while worker.requests:
        worker.step()
    assert len({tuple(r.output) for r in reqs}) == n
    seeds = [r.sampling.seed for r in reqs]
    assert len(set(seeds)) == n and all(0 <= seed < 2**62 for seed in seeds)
    again = worker.add_requests([[1, 2, 3]] * 2, max_new, sampling=[reqs[0].sampling, reqs[5].sampling])
    while worker.requests:
        worker.step()
    assert [r.output for r in again] == [reqs[0].output, reqs[5].output]
