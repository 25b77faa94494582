"""CUDA-graph runner: bucket selection and padding on CPU; replay == eager and losslessness on GPU."""

from __future__ import annotations

import pytest
import torch

from graphs.runner import GRAPH_KINDS, GraphRunner, StaticInputs, default_buckets, pick_bucket
from specdec.config import SpecConfig
from specdec.draft import StandaloneDraft
from specdec.kv import PADDING_ROW
from specdec.worker import EagleWorker
from spec_helpers import make_models, prompts, reference, run_to_completion


def test_buckets():
    assert default_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_buckets(6) == [1, 2, 4, 6]
    buckets = [1, 2, 4, 8]
    assert [pick_bucket(buckets, b) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert pick_bucket(buckets, 9) is None


def test_static_inputs_pad_rows_harmlessly():
    static = StaticInputs({"target_rows": torch.full((8,), 7), "seq_lens": torch.full((8,), 9), "hidden": torch.ones(8, 3)})
    static.fill({"target_rows": torch.tensor([3, 5, 6]), "seq_lens": torch.tensor([10, 11, 12]), "hidden": torch.full((3, 3), 2.0)}, bucket=4)
    assert static.tensors["target_rows"].tolist() == [3, 5, 6, PADDING_ROW, 7, 7, 7, 7]  # rows past the bucket are not read
    assert static.tensors["seq_lens"].tolist()[:4] == [10, 11, 12, 0]
    assert static.tensors["hidden"][3].eq(0).all() and static.tensors["hidden"][:3].eq(2).all()
    assert [t.shape[0] for t in static.view(4).values()] == [4, 4, 4]


def test_uncapturable_backend_refused():
    class FakeWorker:  # only what the runner inspects before capturing
        config = SpecConfig()
        verify_backend = type("B", (), {"name": "some_mla", "supports_cuda_graph": False})()
        draft_extend_backend = verify_backend
        draft_backend = type("M", (), {"steps": []})()

    with pytest.raises(ValueError, match="some_mla.*cannot be captured"):
        GraphRunner(FakeWorker())


@pytest.mark.parametrize("topk,ndt,mode", [(1, None, "eagle"), (2, 6, "eagle"), (3, 8, "standalone")])
def test_host_plans_match_the_device_passes(topk, ndt, mode):
    """What plan_passes_on_host tells a host-planning backend (kv lengths, q_len) is what the
    pass it precedes then builds on the device, for every backend of the step."""
    target, mtp = make_models("cpu", torch.float32)
    draft = StandaloneDraft(target) if mode == "standalone" else mtp
    cfg = SpecConfig(num_steps=3, topk=topk, num_draft_tokens=ndt, draft_mode=mode, page_size=16, max_batch_size=4, max_context_len=256)
    worker = EagleWorker(target, draft, cfg)
    worker.add_requests(prompts(3, seed=4), 30)
    worker.step()
    backends = [worker.verify_backend, worker.draft_extend_backend, *worker.draft_backend.steps]
    planned, seen = {}, {}
    for b in backends:
        b.needs_cpu_seq_lens = True
        b.init_forward_metadata_replay_cuda_graph = lambda bs, lens, q, b=b: planned.__setitem__(id(b), (lens.tolist(), q))
        b.init_forward_metadata = lambda batch, shared_block_tables=None, b=b, f=b.init_forward_metadata: (
            seen.__setitem__(id(b), (batch.seq_lens.tolist(), batch.max_q_len)), f(batch, shared_block_tables))[1]
    worker._reserve_pages()
    worker.plan_passes_on_host(worker.host_seq_lens(3))
    worker.spec_pass(*worker.step_inputs())
    assert len(planned) == len(backends) and planned == seen


GPU_BACKENDS = ["torch_ref", "triton_mla", "flashinfer_mla"]


def gpu_worker(backend, topk=1, num_steps=3, ndt=None, max_bs=4):
    target, mtp = make_models("cuda", torch.float32)
    cfg = SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=ndt, attention_backend=backend, kv_dtype="bf16",
                     page_size=16, max_batch_size=max_bs, max_context_len=256)
    return target, EagleWorker(target, mtp, cfg)


def _pad(live: dict[str, torch.Tensor], bucket: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in live.items():
        pad = torch.full((bucket - t.shape[0], *t.shape[1:]), PADDING_ROW if name.endswith("rows") else 0, dtype=t.dtype, device=t.device)
        out[name] = torch.cat([t, pad])
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("topk,ndt", [(1, None), (2, 6)])
@pytest.mark.parametrize("batch", [3, 4])  # padded and exact bucket
@pytest.mark.parametrize("joined", [True, False])
def test_replay_equals_eager_bitwise(backend, topk, ndt, batch, joined):
    """Each kind of graph replayed alone, and the three joined into one launch, give the
    eager pass's outputs bitwise: the draft tree (draft), the accept result (verify) and the
    next state (draft-extend)."""
    _skip_trees_without_masks(backend, topk)
    target, worker = gpu_worker(backend, topk=topk, ndt=ndt)
    runner = GraphRunner(worker, [1, 2, 4], progress=False)
    worker.add_requests(prompts(batch, seed=batch), 20)
    for _ in range(2):  # a couple of steps so states differ per request
        worker.step()
    worker._reserve_pages()
    st, trows, drows = worker.step_inputs()
    live = {"target_rows": trows, "draft_rows": drows, **vars(st)}
    padded = _pad(live, 4)
    if runner.host_planned:
        worker.plan_passes_on_host(worker.host_seq_lens(4))
    result, state, tree = worker.spec_pass(worker.state_from(padded), padded["target_rows"], padded["draft_rows"])
    expected = {kind: [t[:batch].clone() for t in vars(part).values()]
                for kind, part in zip(GRAPH_KINDS, (tree, result, state))}
    if joined:
        result, state, tree = runner.run(st, trows, drows)
        got = {kind: list(vars(part).values()) for kind, part in zip(GRAPH_KINDS, (tree, result, state))}
    else:
        runner.static.fill(live, 4)
        outputs, got = runner.captured[4].outputs, {}
        for kind in GRAPH_KINDS:
            runner.replay(4, kind)
            part = {"draft": outputs["tree"], "verify": outputs["result"], "draft_extend": worker.state_from(runner.static.view(4))}[kind]
            got[kind] = [t[:batch].clone() for t in vars(part).values()]
    for kind in GRAPH_KINDS:
        assert len(got[kind]) == len(expected[kind])
        for e, g in zip(expected[kind], got[kind]):
            assert torch.equal(e, g), kind


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("topk,ndt", [(1, None), (2, 6)])
def test_long_run_with_graphs_is_lossless(backend, topk, ndt):
    _skip_trees_without_masks(backend, topk)
    target, worker = gpu_worker(backend, topk=topk, ndt=ndt, max_bs=6)
    GraphRunner(worker, [1, 2, 4, 6], progress=False)
    groups = [(prompts(2, seed=1), 40), (prompts(3, seed=2), 25), (prompts(1, seed=3), 30)]
    outputs, _ = run_to_completion(worker, groups, join_every=5)
    assert outputs == reference(target, groups, backend=backend, kv_dtype=torch.bfloat16)
    assert worker.target_pool.num_free_pages == worker.config.num_pages - 1


def _skip_trees_without_masks(backend, topk):
    if topk > 1 and backend == "flashinfer_mla":
        pytest.skip("flashinfer_mla has no tree masks")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,graphs,topk", [("triton_mla", False, 2), ("triton_mla", True, 2),
                                                    ("flashinfer_mla", False, 1), ("flashinfer_mla", True, 1)])
def test_whole_step_has_no_host_sync(backend, graphs, topk):
    """Steps with a join and page growth in between: launch_step (pages, inputs, draft, tree,
    verify, accept, KV commit, draft-extend) never syncs, eager or graphed."""
    _, worker = gpu_worker(backend, topk=topk, ndt=6 if topk > 1 else None)
    if graphs:
        GraphRunner(worker, [1, 2, 4], progress=False)
    worker.add_requests(prompts(2, seed=5), 40)
    for i in range(6):
        if i == 3:
            worker.add_requests(prompts(1, seed=6), 20)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            result = worker.launch_step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        worker.finish_step(result)
