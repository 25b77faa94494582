"""Tensor parallelism over torch.distributed (gloo, CPU): 2 and 4 ranks spawned per test module.

Each rank loads its slice of one saved checkpoint and runs the same worker calls; the references
are the single-process model's logits and its target-only greedy decoding. fp32 throughout: the
TP all-reduce sums the heads' (and intermediate units') parts in another order than one
process's GEMM does, so logits agree to fp32 rounding (bound: 1e-5 relative + 1e-5 absolute).
"""

from __future__ import annotations

import pickle
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spec_helpers import VOCAB, make_models, prompts, reference
from specdec.config import SpecConfig
from specdec.models import load_deepseek, load_mtp, save_deepseek
from specdec.parallel import Parallel
from specdec.sampling import SamplingParams
from specdec.worker import EagleWorker
from test_models import sequences, target_logits

RANK_TIMEOUT_S = 240
GROUPS = [(prompts(2, seed=3), 9), (prompts(2, seed=4), 6), (prompts(1, seed=5), 12)]
SAMPLED = [SamplingParams(temperature=0.9, top_p=0.9, seed=11), SamplingParams(), SamplingParams(temperature=0.7, seed=5),
           SamplingParams(temperature=1.0, top_k=8, seed=2), SamplingParams(temperature=0.8, seed=9)]
TREES = [dict(num_steps=3, topk=1, num_draft_tokens=4), dict(num_steps=2, topk=2, num_draft_tokens=5)]


# ------------------------------------------------------------------------------ harness
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, size: int, port: int, queue, args) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        # bytes, not tensors: a queue shares tensors through file descriptors this process takes along when it exits
        queue.put((rank, True, pickle.dumps(fn(Parallel.from_distributed(), *args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, size: int, *args) -> list:
    """``fn(parallel, *args)`` on ``size`` spawned gloo ranks; their results in rank order. A rank
    that raises fails the test with its traceback; ranks still running after RANK_TIMEOUT_S are
    killed (a rank left waiting in a collective fails the test, it does not hang it)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, size, port, queue, args)) for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(size):
            rank, ok, value = queue.get(timeout=RANK_TIMEOUT_S)
            if not ok:
                raise AssertionError(f"rank {rank} of {size} raised:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(size)]


# ----------------------------------------------------------------------- what each rank runs
class _CountingFile:
    """A safetensors file that counts the bytes of every tensor (or slice) read from it."""

    read = 0

    def __init__(self, file):
        self.file = file

    def __enter__(self):
        self.inner = self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, name):
        return self._count(self.inner.get_tensor(name))

    def get_slice(self, name):
        return _CountingSlice(self.inner.get_slice(name))

    @staticmethod
    def _count(t):
        _CountingFile.read += t.numel() * t.element_size()
        return t


class _CountingSlice:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __getitem__(self, index):
        return _CountingFile._count(self.inner[index])


def _load(parallel: Parallel, path: str):
    """The rank's target and MTP layer, and the bytes of checkpoint tensors it read."""
    import specdec.models.loader as loader

    opener = loader.safe_open
    loader.safe_open = lambda *args, **kwargs: _CountingFile(opener(*args, **kwargs))
    try:
        target = load_deepseek(path, torch.float32, "cpu", parallel)
        mtp = load_mtp(path, torch.float32, "cpu", target=target)
    finally:
        loader.safe_open = opener
    return target, mtp, _CountingFile.read


def _decode(worker: EagleWorker, sampling: bool, abort_after: int) -> list[list[int]]:
    """The GROUPS joining two steps apart, running to completion; the last request of the first
    group aborted after ``abort_after`` steps."""
    reqs, pending, steps = [], list(GROUPS), 0
    while pending or worker.requests:
        if pending and steps % 2 == 0:
            group, max_new = pending.pop(0)
            params = SAMPLED[len(reqs):len(reqs) + len(group)] if sampling else None
            reqs += worker.add_requests(group, max_new, sampling=params)
        if steps == abort_after and not reqs[1].finished:
            worker.abort([reqs[1]])
        if worker.requests:
            worker.step()
        steps += 1
    return [r.output for r in reqs]


def rank_run(parallel: Parallel, path: str) -> dict:
    """Everything a rank reports: logits, greedy and sampled spec decoding per tree, the refused
    bad request, and the divergence check."""
    target, mtp, read = _load(parallel, path)
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    biases = [b for m in (target, mtp) for n, b in m.named_buffers() if "correction_bias" in n]
    out = {"logits": target_logits(target, sequences(VOCAB)), "param_bytes": nbytes(target.parameters()),
           "read_bytes": read,
           # the rank's target and MTP layer (whose checkpoint copies of the embedding and head are read, compared to
           # the target's slices and dropped: mtp.parameters() counts the shared ones once) and the routers' fp32 biases
           "held_bytes": nbytes(target.parameters()) + nbytes(mtp.parameters()) + nbytes(biases),
           "shares": mtp.embed_tokens is target.embed_tokens and mtp.shared_head.head is target.lm_head}
    for i, tree in enumerate(TREES):
        cfg = SpecConfig(**tree, max_batch_size=6, max_context_len=128, enable_sampling=True, check_ranks=True)
        worker = EagleWorker(target, mtp, cfg)
        out[f"greedy{i}"] = _decode(worker, sampling=False, abort_after=3)
        out[f"sampled{i}"] = _decode(worker, sampling=True, abort_after=3)
    worker = EagleWorker(target, mtp, SpecConfig(max_batch_size=6, max_context_len=128, check_ranks=True))
    try:
        worker.add_requests([[1, 2, VOCAB + 5]], 4)  # every rank validates it alike, before any collective
    except ValueError as err:
        out["refused"] = str(err)
    out["after_refusal"] = _decode(worker, sampling=False, abort_after=-1)
    if parallel.rank == 1:  # this rank alone prefers token 7: its accepted tokens differ from the others'
        logits = target.compute_logits
        target.compute_logits = lambda hidden: logits(hidden) + 100.0 * (torch.arange(VOCAB) == 7)
    try:
        _decode(worker, sampling=False, abort_after=-1)
    except RuntimeError as err:
        out["diverged"] = str(err)
    return out


# --------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    target, mtp = make_models()  # layer 0 dense, layer 1 and the MTP layer MoE
    path = tmp_path_factory.mktemp("tp_model")
    save_deepseek(target, str(path), mtp=mtp)
    return str(path), target, mtp


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def ranks(request, checkpoint):
    return request.param, run_ranks(rank_run, request.param, checkpoint[0])


def one_process(checkpoint, tree: dict, sampling: bool) -> list[list[int]]:
    _, target, mtp = checkpoint
    cfg = SpecConfig(**tree, max_batch_size=6, max_context_len=128, enable_sampling=True)
    return _decode(EagleWorker(target, mtp, cfg), sampling, abort_after=3)


def test_tp_logits_match_one_process(ranks, checkpoint):
    tp, results = ranks
    expected = target_logits(checkpoint[1], sequences(VOCAB))
    for rank, res in enumerate(results):
        for got, want in zip(res["logits"], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"rank {rank} of {tp}")
    for got0, got in zip(results[0]["logits"], results[-1]["logits"]):
        assert torch.equal(got0, got)  # every rank holds the same gathered logits, bit for bit


@pytest.mark.parametrize("tree", range(len(TREES)), ids=["topk1", "topk2"])
def test_tp_spec_decoding_is_one_process_greedy_decoding(ranks, checkpoint, tree):
    tp, results = ranks
    _, target, _ = checkpoint
    full = reference(target, GROUPS)
    for res in results:
        assert res[f"greedy{tree}"] == results[0][f"greedy{tree}"]
    got = results[0][f"greedy{tree}"]
    for i, (out, want) in enumerate(zip(got, full)):
        assert out == want if i != 1 else want[:len(out)] == out, (tp, i)  # request 1 was aborted: a prefix
    assert 0 < len(got[1]) < len(full[1])


@pytest.mark.parametrize("tree", range(len(TREES)), ids=["topk1", "topk2"])
def test_tp_sampling_draws_alike_on_every_rank_and_as_one_process(ranks, checkpoint, tree):
    _, results = ranks
    for res in results:
        assert res[f"sampled{tree}"] == results[0][f"sampled{tree}"]
    assert results[0][f"sampled{tree}"] == one_process(checkpoint, TREES[tree], sampling=True)


def test_a_bad_request_is_refused_alike_and_the_ranks_go_on(ranks, checkpoint):
    _, results = ranks
    assert all("vocab_size" in res["refused"] for res in results)
    full = reference(checkpoint[1], GROUPS)
    assert all(res["after_refusal"] == full for res in results)


def test_the_rank_check_catches_ranks_that_diverge(ranks):
    _, results = ranks
    assert all("ranks accepted different tokens" in res["diverged"] for res in results)


def test_each_rank_reads_only_its_slice(ranks):
    """The loader reads each cut tensor's rank slice alone: what a rank read is what it holds, about 1/tp of the
    model (plus the replicated latent KV projection and norms)."""
    _, results = ranks
    assert all(res["read_bytes"] == res["held_bytes"] for res in results), [(r["read_bytes"], r["held_bytes"]) for r in results]
    assert all(res["shares"] for res in results)  # each rank found the MTP layer's copies equal to its target's slices


def test_each_rank_holds_its_slice(ranks, checkpoint):
    tp, results = ranks
    target = checkpoint[1]
    whole = sum(p.numel() * 4 for p in target.parameters())
    kv_a = 576 * target.config.hidden_size * 4 * target.config.num_hidden_layers  # the one latent KV head's
    replicated = kv_a + sum(p.numel() * 4 for n, p in target.named_parameters() if "norm" in n or "mlp.gate." in n)
    assert any("experts_gate_up" in n for n, _ in target.named_parameters())
    assert all(res["param_bytes"] == replicated + (whole - replicated) // tp for res in results)


def test_launch_problems_are_named_before_anything_starts(monkeypatch):
    """launch_problem reads the environment only: a bad tp, a world of another size than tp, and a
    LOCAL_RANK past this machine's CUDA devices are reasons; torchrun's matching world is none."""
    from specdec.parallel import launch_problem, start_ranks

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch_problem(1, cpu) is None and launch_problem(1, cuda) is None
    assert "an int >= 1 ranks, got 0" in launch_problem(0, cpu)
    assert "over 2 ranks runs under torchrun --nproc-per-node 2 (WORLD_SIZE is None)" in launch_problem(2, cpu)
    with pytest.raises(ValueError, match="runs under torchrun --nproc-per-node 2"):
        start_ranks(2, cpu)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    assert launch_problem(2, cpu) is None
    assert f"runs on cuda:{torch.cuda.device_count()}, and this machine has" in launch_problem(2, cuda)
