"""launch_step reads no device value on the host: the no-sync claim, checked on the CPU.

On a GPU, tests/test_graphs.py runs launch_step under torch's sync debug mode and behind a busy
stream; without one both are silent. Here every aten op launch_step dispatches is watched for the
ones that read tensor values on the host (item, a tensor's truth value, nonzero, unique, boolean
indexing, ...), which on a GPU are syncs; Tensor.tolist is watched in Python (it dispatches
nothing that tells). The model's value checks of CPU inputs (check_inputs, which skips them on a
GPU) are the only reads allowed.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdec.config import SpecConfig
from specdec.draft import StandaloneDraft
from specdec.sampling import SamplingParams
from specdec.worker import EagleWorker
from spec_helpers import make_models, prompts
from toy_models import ToyTarget, noisy_twin

aten = torch.ops.aten
# Ops that read values on the host or size their output by them.
HOST_READS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.nonzero, aten.argwhere, aten.masked_select,
              aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.equal, aten.allclose,
              aten.bincount, aten.histc, aten.masked_scatter, aten.masked_scatter_}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = {("specdec/models/deepseek.py", "check_inputs"), ("specdec/models/deepseek.py", "validate_token_ids")}


def _site() -> tuple[str, str, int] | None:
    """The innermost frame of the package (not of the tests' toy models): file, function, line."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.relpath(frame.filename, REPO)
        if not path.startswith("..") and not path.startswith("tests/"):
            return path, frame.name, frame.lineno
    return None


class HostReads(TorchDispatchMode):
    """Records the package sites of host reads while active."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[tuple[str, str, int, str]] = []
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def record(self, what: str) -> None:
        site = _site()
        if site is not None and site[:2] not in ALLOWED:
            self.sites.append((*site, what))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in HOST_READS:
            self.record(str(func))
        elif packet in INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.record(f"{func} by a boolean mask")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.record(f"{func} without output_size")
        return func(*args, **kwargs)


@pytest.fixture
def host_reads(monkeypatch):
    watch = HostReads()
    tolist = torch.Tensor.tolist

    def watched_tolist(self):
        if watch.active:
            watch.record("Tensor.tolist")
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", watched_tolist)
    return watch


def _worker(kind: str) -> tuple[EagleWorker, dict]:
    common = dict(max_batch_size=4, max_context_len=128, page_size=4)
    if kind == "sampled_standalone":
        toy = ToyTarget(vocab=64)
        cfg = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, draft_mode="standalone", enable_sampling=True, **common)
        return EagleWorker(toy, StandaloneDraft(noisy_twin(toy)), cfg), dict(vocab=64, sampled=True)
    target, mtp = make_models()
    topk = 1 if kind == "chain" else 2
    cfg = SpecConfig(num_steps=3, topk=topk, num_draft_tokens=None if topk == 1 else 6, **common)
    return EagleWorker(target, mtp, cfg), dict(vocab=target.config.vocab_size, sampled=False)


@pytest.mark.parametrize("kind", ["chain", "tree", "sampled_standalone"])
def test_launch_step_reads_no_device_value(host_reads, kind):
    """Eight steps with page growth, a join and an abort between them: launch_step (pages, inputs,
    draft, tree, verify, accept, KV commit, draft-extend) on the torch reference backend."""
    worker, info = _worker(kind)
    sampling = (lambda n: [SamplingParams(0.8, 0.9, 20)] * n) if info["sampled"] else (lambda n: None)
    running = worker.add_requests(prompts(2, seed=5, vocab=info["vocab"]), 40, sampling=sampling(2))
    for i in range(8):
        if i == 3:
            worker.add_requests(prompts(1, seed=6, vocab=info["vocab"]), 20, sampling=sampling(1))
        if i == 5:
            worker.abort(running[:1])
        with host_reads:
            result = worker.launch_step()
        worker.finish_step(result)
    assert host_reads.sites == []
