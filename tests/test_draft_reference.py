"""The worker's drafts against an independent drafter.

Losslessness holds for any draft, so the worker tests cannot see a draft that attends to the
wrong ancestors, continues the wrong hidden state or sits at the wrong position. Here every draft
forward of a step (SpecStep.draft's steps and draft-extend) is compared with the draft model run from
scratch, one sequence at a time, over a fresh cache with plain causal attention:
EAGLE (MTP): token t_{p+1} at position p with the target's hidden state h_p for p < N (one target
pass over the committed tokens), and the MTP's own previous output past N; standalone: the draft
LM's logits over the whole sequence (specdec.baseline.sequence_logits). The tree is rebuilt from
the reference probabilities with specdec.tree (unit-tested in tests/test_tree_verify.py)."""

import functools

import pytest
import torch

from attn.backends.torch_ref import TorchRefBackend
from attn.base import AttnBatch, ForwardMode
from spec_helpers import prompts
from specdec.baseline import sequence_logits
from specdec.config import SpecConfig
from specdec.draft import StandaloneDraft
from specdec.kv import MLAKVPool
from specdec.tree import DraftTree, start_tree
from specdec.worker import EagleWorker


@torch.no_grad()
def fresh_pass(fn, num_layers, spec, n):
    """fn(positions, backend, batch) over a fresh one-request cache: one causal pass of n tokens."""
    pages = n // 4 + 2
    pool = MLAKVPool(num_layers, pages, 4, 1, 4 * pages, torch.float32)
    row = pool.alloc_request()
    pool.ensure_capacity(row, n)
    backend = TorchRefBackend(pool.view(), spec, 1, n)
    batch = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([n], dtype=torch.int32),
                      pool.req_to_token[row, :n].long(), torch.tensor([0, n], dtype=torch.int32), n, False)
    backend.init_forward_metadata(batch)
    return fn(torch.arange(n), backend, batch)


def eagle_reference(target, mtp):
    @functools.cache
    def hidden(committed):  # the target's hidden states h_0..h_{N-1}
        ids = torch.tensor(committed)
        return fresh_pass(lambda pos, b, batch: target(ids, pos, b, batch), target.num_attention_layers,
                          target.attn_spec(), len(committed))

    def logits(committed, path):  # the MTP's logits after committed's last token, then path
        n0 = len(committed) - 1
        h, tokens = hidden(tuple(committed[:-1])), committed[1:] + path
        h_in = h
        for n in range(n0, n0 + len(path) + 1):
            ids = torch.tensor(tokens[:n])
            out = fresh_pass(lambda pos, b, batch: mtp(ids, pos, h_in[:n], b, batch), 1, mtp.attn_spec(), n)
            h_in = torch.cat([h, out[n0 - 1:]])  # past N, each position continues the MTP's own output
        return mtp.compute_logits(out[-1:])[0]
    return logits


def reference_tree(ref, committed, topk, num_steps, ndt):
    """(frontier paths before each draft forward, the verify tree) from reference probabilities."""
    probs, ids = torch.softmax(ref(committed, []), -1).topk(topk)
    tree, paths, frontiers = start_tree(probs[None], ids[None]), [[t] for t in ids.tolist()], []
    for _ in range(1, num_steps):
        frontiers.append(paths)
        p, i = zip(*(torch.softmax(ref(committed, path), -1).topk(topk) for path in paths))
        tree.grow(torch.stack(p)[None], torch.stack(i)[None])
        parent = tree.frontier_parent[0].tolist() if isinstance(tree, DraftTree) else [0]
        paths = [paths[q] + [t] for q, t in zip(parent, tree.frontier_tokens[0].tolist())]
    return frontiers, tree.build(torch.tensor([committed[-1]]), ndt, num_steps)


@pytest.mark.parametrize("mode,topk,num_steps,ndt", [("eagle", 1, 3, None), ("eagle", 2, 3, 6), ("eagle", 3, 4, 8),
                                                     ("standalone", 2, 3, 6)])
def test_every_draft_forward_matches_a_drafter_run_from_scratch(target, mtp, monkeypatch, mode, topk, num_steps, ndt):
    if mode == "eagle":
        draft, ref = mtp, eagle_reference(target, mtp)
    else:
        draft = StandaloneDraft(target)
        ref = lambda committed, path: sequence_logits(target, committed + path)[-1]
    cfg = SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=ndt, draft_mode=mode, max_batch_size=2,
                     max_context_len=128)
    worker = EagleWorker(target, draft, cfg)
    compute = draft.compute_logits
    recorded = []
    monkeypatch.setattr(draft, "compute_logits", lambda h: recorded.append(compute(h)) or recorded[-1])
    worker.add_requests(prompts(2, seed=9), 12)
    for _ in range(3):
        running = list(worker.requests)
        committed = [r.prompt + r.output for r in running]
        recorded.clear()
        result = worker.launch_step()
        tree = worker.last_tree
        worker.finish_step(result)
        calls = list(recorded)  # the reference's own compute_logits calls go to the list too
        assert len(calls) == num_steps  # num_steps - 1 draft forwards, then draft-extend
        for i, c in enumerate(committed):
            frontiers, want = reference_tree(ref, c, topk, num_steps, cfg.num_draft_tokens)
            for step, paths in enumerate(frontiers):
                got = torch.softmax(calls[step].view(len(running), topk, -1)[i], -1)
                expected = torch.stack([torch.softmax(ref(c, path), -1) for path in paths])
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            assert tree.tokens[i].tolist() == want.tokens[0].tolist()
            assert tree.parents[i].tolist() == want.parents[0].tolist()
            n = int(result.accept_len[i]) + 1  # draft-extend: the next step's first candidates
            after = c + result.emitted[i, :n].tolist()
            torch.testing.assert_close(torch.softmax(calls[-1][i], -1), torch.softmax(ref(after, []), -1),
                                       atol=1e-4, rtol=1e-4)
        if not worker.requests:
            break
