import torch

from specdec.tree import DraftTree
from specdec.verify import greedy_accept


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
