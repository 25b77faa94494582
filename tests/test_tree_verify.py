import pytest
import torch

from specdec.tree import DraftChain, DraftTree, start_tree, topk_probs
from specdec.accept import AcceptResult, chain_accept, greedy_accept, stop_at_limits


def example_tree(mask_out=None):
    tree = DraftTree(torch.tensor([[0.6, 0.3]]), torch.tensor([[10, 11]]))
    tree.grow(torch.tensor([[[0.5, 0.4], [0.9, 0.05]]]), torch.tensor([[[20, 21], [22, 23]]]))
    return tree, tree.build(torch.tensor([7]), num_draft_tokens=4, num_steps=2, mask_out=mask_out)


def test_tree_picks_best_candidates_with_parents_first():
    tree, vt = example_tree()
    # cumulative scores: 10:.6 11:.3 | 20:.30 21:.24 22:.27 23:.015 -> best three: 10, 11, 20 (tie 11/20 by order)
    assert vt.tokens.tolist() == [[7, 10, 11, 20]]
    assert vt.parents.tolist() == [[0, 0, 0, 1]]
    assert vt.depth.tolist() == [[0, 1, 1, 2]]
    assert vt.child_rank.tolist() == [[0, 0, 1, 0]]
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(vt.mask[0], expected)
    # the next frontier: children 20 (.30) and 22 (.27), grown from frontier slots 0 and 1
    assert tree.frontier_tokens.tolist() == [[20, 22]]
    assert tree.frontier_parent.tolist() == [[0, 1]]


def test_mask_written_in_place_into_backend_buffer():
    buf = torch.zeros(3, 4, 4, dtype=torch.bool)
    _, vt = example_tree(buf)
    assert vt.mask.data_ptr() == buf.data_ptr()
    assert buf[0].sum() == 8 and not buf[1:].any()


def test_ties_keep_the_tree_ancestor_closed():
    tree = DraftTree(torch.tensor([[0.5, 0.5]]), torch.tensor([[1, 2]]))
    tree.grow(torch.tensor([[[1.0, 0.0], [1.0, 0.0]]]), torch.tensor([[[3, 4], [5, 6]]]))
    vt = tree.build(torch.tensor([0]), num_draft_tokens=3, num_steps=2)
    assert vt.tokens.tolist() == [[0, 1, 2]]  # children tie with their parents and come after them


def test_non_finite_draft_logits_keep_the_tree_ancestor_closed():
    """Greedy draft rows with +inf or NaN logits (a 16-bit head that overflowed) score 0, not NaN
    (which would sort above every score): the tree takes no child of a candidate it has not taken
    and grows its frontier only from the taken ones."""
    inf, nan = float("inf"), float("nan")
    probs, _ = topk_probs(torch.tensor([[0.0, 1.0, inf, 2.0], [nan, 1.0, 3.0, nan], [0.0, 1.0, 3.0, 2.0]]), 2)
    assert torch.equal(probs[:2], torch.zeros(2, 2)) and probs[2].gt(0).all()
    tree = DraftTree(torch.tensor([[0.9, 0.1]]), torch.tensor([[10, 11]]))
    probs, _ = topk_probs(torch.tensor([[0.0, 2.0, 1.0, -1.0], [0.0, inf, 0.0, nan]]), 2)
    tree.grow(probs[None], torch.tensor([[[20, 21], [22, 23]]]))
    vt = tree.build(torch.tensor([7]), num_draft_tokens=3, num_steps=2)
    assert vt.tokens.tolist() == [[7, 10, 20]] and vt.parents.tolist() == [[0, 0, 1]]
    assert tree.frontier_tokens.tolist() == [[20, 21]]


def test_greedy_accept_follows_the_matching_path():
    _, vt = example_tree()
    pred = torch.tensor([[10, 20, 0, 99]])  # target argmax after root, 10, 11, 20
    res = greedy_accept(vt, pred, num_steps=2)
    assert res.accept_len.tolist() == [2]
    assert res.path.tolist() == [[0, 1, 3]]
    assert res.emitted.tolist() == [[10, 20, 99]]
    assert res.bonus.tolist() == [99]


def test_greedy_accept_rejects_everything_and_picks_sibling():
    _, vt = example_tree()
    res = greedy_accept(vt, torch.tensor([[5, 20, 0, 99]]), num_steps=2)
    assert res.accept_len.tolist() == [0] and res.emitted.tolist() == [[5, -1, -1]] and res.path.tolist() == [[0, 0, 0]]
    res = greedy_accept(vt, torch.tensor([[11, 20, 42, 99]]), num_steps=2)
    assert res.accept_len.tolist() == [1] and res.emitted.tolist() == [[11, 42, -1]] and res.path.tolist() == [[0, 2, 2]]


def test_chain_topk1():
    tree = DraftTree(torch.tensor([[0.9], [0.8]]), torch.tensor([[3], [4]]))
    tree.grow(torch.tensor([[[0.7]], [[0.6]]]), torch.tensor([[[5]], [[6]]]))
    vt = tree.build(torch.tensor([1, 2]), num_draft_tokens=3, num_steps=2)
    assert vt.tokens.tolist() == [[1, 3, 5], [2, 4, 6]]
    assert torch.equal(vt.mask[0], torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    res = greedy_accept(vt, torch.tensor([[3, 5, 8], [4, 0, 0]]), num_steps=2)
    assert res.emitted.tolist() == [[3, 5, 8], [4, 0, -1]]


@pytest.mark.parametrize("num_steps", [1, 2, 3, 5])
def test_draft_chain_and_chain_accept_match_the_general_tree(num_steps):
    """topk = 1: DraftChain's constant layout and chain_accept's prefix rule give exactly what
    the general DraftTree and greedy_accept give, for every accept length."""
    g = torch.Generator().manual_seed(num_steps)
    batch, vocab = 64, 4  # a small vocab: many partial matches
    probs = torch.rand(num_steps, batch, 1, generator=g)
    ids = torch.randint(vocab, (num_steps, batch, 1), generator=g)
    root = torch.randint(vocab, (batch,), generator=g)
    general, chain = DraftTree(probs[0], ids[0]), start_tree(probs[0], ids[0])
    assert isinstance(chain, DraftChain)
    for p, i in zip(probs[1:], ids[1:]):
        general.grow(p[:, :, None], i[:, :, None])
        chain.grow(p[:, :, None], i[:, :, None])
        assert torch.equal(chain.frontier_tokens, general.frontier_tokens)
    buf = torch.zeros(batch + 1, num_steps + 1, num_steps + 1, dtype=torch.bool)
    want, got = general.build(root, num_steps + 1, num_steps), chain.build(root, num_steps + 1, num_steps, buf)
    for name, t in vars(want).items():
        assert torch.equal(getattr(got, name), t), name
    assert got.mask.data_ptr() == buf.data_ptr()
    # target predictions agreeing with the chain for a random prefix, random after it
    agree = torch.randint(num_steps + 1, (batch,), generator=g)
    pred = torch.randint(vocab, (batch, num_steps + 1), generator=g)
    prefix = torch.arange(num_steps)[None, :] < agree[:, None]
    pred[:, :-1] = torch.where(prefix, want.tokens[:, 1:], pred[:, :-1])
    ref, res = greedy_accept(want, pred, num_steps), chain_accept(got, pred, num_steps)
    assert (ref.accept_len >= agree).all()
    for name, t in vars(ref).items():
        assert (t is None and getattr(res, name) is None) or torch.equal(getattr(res, name), t), name


def test_draft_chain_checks_the_tree_size():
    chain = DraftChain(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="num_draft_tokens=3"):
        chain.build(torch.zeros(2, dtype=torch.long), 3, 2)


@pytest.mark.parametrize("seed", range(3))
def test_stop_at_limits_matches_a_token_by_token_loop(seed):
    """take / done against appending one emitted token at a time until the first eos or the
    max_new_tokens limit; a vocabulary of 6 makes eos hits, also past the accepted tokens, common."""
    g = torch.Generator().manual_seed(seed)
    batch, width = 64, 4
    accept_len = torch.randint(0, width, (batch,), generator=g)
    emitted = torch.randint(0, 6, (batch, width), generator=g)
    emitted[torch.arange(width) > accept_len[:, None]] = -1
    seq_lens = torch.randint(10, 20, (batch,), generator=g)
    limit = seq_lens + torch.randint(1, 6, (batch,), generator=g)
    eos = torch.randint(-1, 6, (batch,), generator=g)
    result = AcceptResult(accept_len, torch.zeros_like(emitted), emitted, emitted[:, 0])
    take, done = stop_at_limits(result, seq_lens, limit, eos)
    for b in range(batch):
        n, taken, hit_eos = seq_lens[b].item(), 0, False
        for token in emitted[b, : accept_len[b] + 1].tolist():
            if n >= limit[b]:
                break
            taken, n = taken + 1, n + 1
            if token == eos[b]:
                hit_eos = True
                break
        assert take[b].item() == taken
        assert done[b].item() == (hit_eos or n >= limit[b].item())
