"""The worker over models that are not specdec.models' (tests/toy_models.py, written from the
TargetModel / DraftModel contract alone): lossless, and a model that breaks the contract is named
before or at its first pass, not deep inside a kernel or in wrong tokens."""

from __future__ import annotations

import pytest
import torch

from specdec.baseline import greedy_generate
from specdec.config import ConfigError, SpecConfig
from specdec.draft import StandaloneDraft
from specdec.worker import EagleWorker
from spec_helpers import free_pages, prompts, run_to_completion
from toy_models import ToyEagleDraft, ToyTarget, noisy_twin

VOCAB = 64


@pytest.mark.parametrize("draft, topk, ndt", [("eagle", 1, None), ("eagle", 2, 6), ("twin", 1, None), ("twin", 2, 6)])
def test_models_of_the_contract_decode_losslessly(draft, topk, ndt):
    """A toy target with an untrained toy EAGLE head (it runs the hidden-state plumbing; it accepts
    next to nothing), or with a noisy twin of itself as a standalone draft, whose steps accept every
    length from 0 to num_steps: target-only greedy tokens, with joins and finishes."""
    target = ToyTarget(vocab=VOCAB)
    drafter = ToyEagleDraft(target) if draft == "eagle" else StandaloneDraft(noisy_twin(target))
    cfg = SpecConfig(num_steps=3, topk=topk, num_draft_tokens=ndt, draft_mode="eagle" if draft == "eagle" else "standalone",
                     page_size=4, max_batch_size=3, max_context_len=128)
    worker = EagleWorker(target, drafter, cfg)
    groups = [(prompts(2, seed=1, vocab=VOCAB), 20), (prompts(1, seed=2, vocab=VOCAB), 12)]
    outputs, accepts = run_to_completion(worker, groups)
    assert outputs == [out for group, n in groups for out in greedy_generate(target, group, n)]
    if draft == "twin":
        assert set(accepts) == {0, 1, 2, 3}


class _NoLogits(ToyTarget):
    compute_logits = None


def _deeper_than_declared() -> ToyTarget:
    target = ToyTarget(vocab=VOCAB)
    target.num_attention_layers = 1  # its second layer writes layer 1 of a one-layer pool
    return target


def _padded_head() -> ToyTarget:
    target = ToyTarget(vocab=VOCAB)
    target.head = torch.nn.Linear(target.config.hidden_size, VOCAB + 8)  # a head padded past the vocabulary
    return target


def _fp32_output() -> ToyTarget:
    target = ToyTarget(vocab=VOCAB).to(torch.bfloat16)
    forward = target.forward
    target.forward = lambda *args: forward(*args).float()
    return target


def _draft_without(target: ToyTarget, name: str) -> ToyEagleDraft:
    """A draft head lacking one member of the contract: an attribute gone or unreadable, a method None."""
    draft = ToyEagleDraft(target)
    if name in vars(draft):
        delattr(draft, name)
    elif name in ("attn_spec", "compute_logits"):
        setattr(draft, name, None)
    else:  # a class attribute
        def unreadable(self):
            raise AttributeError(name)

        draft.__class__ = type(f"DraftWithout_{name}", (ToyEagleDraft,), {name: property(unreadable)})
    return draft


@pytest.mark.parametrize("name", ["num_attention_layers", "vocab_size", "needs_hidden_in", "hidden_size", "attn_spec",
                                  "compute_logits"])
def test_a_draft_off_the_contract_is_named(name):
    """A draft lacking a member of DraftModel (gone, unreadable or None) is refused when the worker
    is built, with a ConfigError naming the member and the protocol, not at its first use."""
    target = ToyTarget(vocab=VOCAB)
    cfg = SpecConfig(num_steps=2, page_size=4, max_batch_size=2, max_context_len=64)
    with pytest.raises(ConfigError, match=rf"the draft model lacks \['{name}'\]: specdec.draft.DraftModel"):
        EagleWorker(target, _draft_without(target, name), cfg)


def test_an_ordinary_lm_passed_as_the_draft_is_told_to_wrap_it():
    target = ToyTarget(vocab=VOCAB)
    cfg = SpecConfig(num_steps=2, draft_mode="standalone", page_size=4, max_batch_size=2, max_context_len=64)
    with pytest.raises(ConfigError, match=r"lacks \['vocab_size', 'needs_hidden_in', 'hidden_size'\].*"
                                          r"StandaloneDraft\(lm\) with draft_mode='standalone'"):
        EagleWorker(target, noisy_twin(target), cfg)


@pytest.mark.parametrize("make, when, needle", [
    (lambda: _NoLogits(vocab=VOCAB), "init", r"lacks \['compute_logits'\]"),
    (lambda: ToyTarget(vocab=VOCAB).train(), "init", r"training mode .*call target.eval\(\)"),
    (lambda: torch.nn.Linear(2, 2).eval(), "init", r"lacks \['config', 'num_attention_layers', 'attn_spec'"),
    (_deeper_than_declared, "add", r"layer_id must lie in \[0, 1\) .*num_attention_layers\), got 1"),
    (_padded_head, "add", r"compute_logits returned \(1, 72\) for 1 rows; .*config.vocab_size=64"),
    (_fp32_output, "add", r"forward returned \(\d+, 32\) torch.float32 .*parameters' dtype \(torch.bfloat16\)"),
])
def test_a_model_off_the_contract_is_named(make, when, needle):
    """A target off the contract (no compute_logits, training mode, not a model, more layers than
    it declares, a head past the vocabulary, output in another dtype) is refused with an error
    naming what is wrong: when the worker is built, or at its first add_requests, which then
    leaves the pools and the batch as they were."""
    target = make()
    cfg = SpecConfig(num_steps=2, draft_mode="standalone", page_size=4, max_batch_size=2, max_context_len=64)
    if when == "init":
        with pytest.raises(ConfigError, match=needle):
            EagleWorker(target, StandaloneDraft(ToyTarget(vocab=VOCAB)), cfg)
        return
    worker = EagleWorker(target, StandaloneDraft(target), cfg)
    free = free_pages(worker)
    with pytest.raises(ValueError, match=needle):
        worker.add_requests(prompts(1, seed=3, vocab=VOCAB), 8)
    assert free_pages(worker) == free and not worker.requests
