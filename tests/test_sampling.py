"""Tree rejection sampling preserves the target distribution (statistical tests on CPU)."""

import pytest
import torch

from spec_helpers import make_models
from specdec.baseline import greedy_generate, sequence_logits
from specdec.config import SpecConfig
from specdec.draft import StandaloneDraft
from specdec.sampling import SamplingParams, hash_uniform, target_probs, tree_rejection_sample
from specdec.tree import DraftTree, topk_probs
from specdec.verify import greedy_accept
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


@pytest.mark.parametrize("topk,num_steps,ndt", [(1, 3, 4), (2, 3, 6), (3, 2, 7)])
def test_first_two_tokens_follow_the_target(topk, num_steps, ndt):
    vocab = 6
    vt = make_tree(N, topk, num_steps, ndt, vocab, seed=topk)
    g = torch.Generator().manual_seed(100 + topk)
    node_probs = (torch.randn(1, ndt, vocab, generator=g) * 1.5).softmax(-1).expand(N, -1, -1)
    res = tree_rejection_sample(vt, node_probs, torch.arange(N), torch.zeros(N, dtype=torch.long), num_steps)
    first = res.emitted[:, 0]
    assert tv(torch.bincount(first, minlength=vocab).double(), node_probs[0, 0].double()) < 0.02
    # Second token given the first: the target's distribution after the node holding `first`
    # (when the draft proposed it), else a fresh step would begin: only check drafted ones.
    for node in range(1, ndt):
        if vt.parents[0, node] != 0:
            continue
        rows = (first == vt.tokens[0, node]) & (res.accept_len >= 1)
        if rows.sum() < 2000:
            continue
        second = res.emitted[rows, 1]
        assert tv(torch.bincount(second, minlength=vocab).double(), node_probs[0, node].double()) < 0.04


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
    the greedy token (they used to give NaN rows, sampled as the last token)."""
    logits = torch.tensor([[3.0, 9.0, -2.0, 1.0]]).expand(4, -1)
    probs = target_probs(logits, torch.tensor([1e-39, 1e-44, 1.0, 1e-30]), torch.tensor([1.0, 1.0, 1e-46, 1.0]),
                         torch.zeros(4, dtype=torch.long))
    assert torch.equal(probs, torch.eye(4)[1].expand(4, -1))
    _, ids = topk_probs(logits, 2, torch.tensor([1e-39, 1e-44, 1.0, 1e-30]))
    assert ids[:, 0].tolist() == [1, 1, 1, 1]


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
        with pytest.raises(ValueError):
            SamplingParams(**kw)


def test_the_largest_fp32_temperature_still_ranks_by_logit():
    """Temperatures up to fp32's largest are accepted and keep top-k/top-p ranking the likeliest
    tokens (one beyond it became inf in the worker's fp32 tensors: every logit 0, and top_k=1
    emitted token 0 where greedy took the argmax)."""
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
    """The first two sampled tokens of many seeded requests (identity draft, so drafts are often
    accepted) follow the target's own sampling distribution; greedy requests in the same batches
    still get exactly the greedy output."""

    vocab, temp, prompt = 6, 0.9, [1, 2, 3, 4, 5]
    target, _ = make_models(vocab_size=vocab)
    cfg = SpecConfig(num_steps=3, topk=topk, num_draft_tokens=ndt, draft_mode="standalone", enable_sampling=True,
                     max_batch_size=256, max_context_len=32)
    worker = EagleWorker(target, StandaloneDraft(target), cfg)
    greedy = greedy_generate(target, [prompt], 2)[0]
    n_batches, per_batch = 24, 256
    pairs, accepted = [], 0
    for b in range(n_batches):
        params = [SamplingParams(temperature=temp if i % 16 else 0.0, seed=b * per_batch + i) for i in range(per_batch)]
        reqs = worker.add_requests([prompt] * per_batch, 2, sampling=params)
        while worker.requests:
            accepted += sum(worker.step().accept_lens)
        for req, p in zip(reqs, params):
            if p.temperature == 0:
                assert req.output == greedy
            else:
                pairs.append(req.output)
    assert accepted > len(pairs) // 4  # the acceptance path is exercised, not only bonus draws

    def probs(ids):
        logits = sequence_logits(target, ids)[-1:]
        t = torch.tensor([temp])
        return target_probs(logits, t, torch.ones(1), torch.zeros(1, dtype=torch.long))[0].double()

    first = probs(prompt)
    joint = torch.stack([first[r] * probs(prompt + [r]) for r in range(vocab)]).flatten()
    pairs_t = torch.tensor(pairs)
    counts = torch.bincount(pairs_t[:, 0] * vocab + pairs_t[:, 1], minlength=vocab * vocab).double()
    # ~5750 samples over 36 cells: the expected TV of an exact sampler is about 0.03.
    assert tv(counts, joint) < 0.06


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
    """Requests without a seed each get a fresh one (with one default seed, every unseeded request
    of a prompt sampled the same tokens); the seed lands in Request.sampling, and passing it back
    replays the request."""
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
