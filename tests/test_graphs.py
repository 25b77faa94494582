"""CUDA-graph runner: bucket selection and padding on CPU; replay == eager and losslessness on GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attn.kernels.triton_mla import wgmma as wgmma_tile
from attn.kernels.triton_mla.plan import narrow_plan_limit
from graphs.runner import GRAPH_KINDS, GraphRunner, StaticInputs, default_buckets, pick_bucket
from specdec.baseline import GreedyDecoder, greedy_generate
from specdec.config import SpecConfig
from specdec.draft import StandaloneDraft
from specdec.models import DeepseekV3ForCausalLM
from specdec.sampling import SamplingParams
from specdec.state import DecodeState
from specdec.kv import PADDING_ROW
from specdec.worker import EagleWorker
from spec_helpers import VOCAB, make_models, needs_library, prompts, reference, run_to_completion, tiny_config


def test_buckets():
    assert default_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_buckets(6) == [1, 2, 4, 6]
    buckets = [1, 2, 4, 8]
    assert [pick_bucket(buckets, b) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert pick_bucket(buckets, 9) is None


def test_a_cpu_worker_is_refused():
    target, mtp = make_models()
    worker = EagleWorker(target, mtp, SpecConfig(max_batch_size=2, max_context_len=64))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; the worker runs on cpu"):
        worker.capture_graphs()


def test_static_inputs_pad_rows_harmlessly():
    static = StaticInputs({"target_rows": torch.full((8,), 7), "seq_lens": torch.full((8,), 9), "hidden": torch.ones(8, 3)})
    static.fill({"target_rows": torch.tensor([3, 5, 6]), "seq_lens": torch.tensor([10, 11, 12]), "hidden": torch.full((3, 3), 2.0)}, bucket=4)
    assert static.tensors["target_rows"].tolist() == [3, 5, 6, PADDING_ROW, 7, 7, 7, 7]  # rows past the bucket are not read
    assert static.tensors["seq_lens"].tolist()[:4] == [10, 11, 12, 0]
    assert static.tensors["hidden"][3].eq(0).all() and static.tensors["hidden"][:3].eq(2).all()
    assert [t.shape[0] for t in static.view(4).values()] == [4, 4, 4]


def fake_step(capturable: bool, config: SpecConfig):
    """Only what the runner inspects before capturing."""
    class FakeStep:
        device = torch.device("cuda")
        backends = [type("B", (), {"name": "some_mla", "supports_cuda_graph": capturable})()]

    step = FakeStep()
    step.config = config
    return step


def test_uncapturable_backend_refused():
    with pytest.raises(ValueError, match="some_mla.*cannot be captured"):
        GraphRunner(fake_step(False, SpecConfig()))


@pytest.mark.parametrize("batch_sizes, message", [
    ([1, 8], r"must lie in \[1, max_batch_size=4\], got \[1, 8\]"),
    ([0, 4], r"must lie in \[1, max_batch_size=4\], got \[0, 4\]"),
    ([1, 2], r"largest CUDA-graph batch size \(2\) is below max_batch_size \(4\).*or pass eager_fallback=True"),
    ([], "batch_sizes is empty"),
])
def test_buckets_refused_before_any_capture(batch_sizes, message):
    """Buckets the runner cannot serve are refused up front, naming what to change."""
    with pytest.raises(ValueError, match=message):
        GraphRunner(fake_step(True, SpecConfig(max_batch_size=4)), batch_sizes=batch_sizes)


@pytest.mark.parametrize("flag, value", [("eager_fallback", "no"), ("kv_bounds", [64]), ("progress", 1)])
def test_flags_must_be_bools(flag, value):
    """The runner's flags take True or False only: a truthy stand-in ("no", a list of bounds, 1)
    is refused, naming the flag and the value."""
    with pytest.raises(ValueError, match=re.escape(f"GraphRunner's {flag} must be True or False, got {value!r}")):
        GraphRunner(fake_step(True, SpecConfig(max_batch_size=4)), [1, 2, 4], **{flag: value})


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
    inputs = worker.step_inputs()
    worker.spec_step.plan_passes_on_host(torch.tensor([r.seq_len for r in worker.requests], dtype=torch.int32))
    worker.spec_step.run(*inputs)
    assert len(planned) == len(backends) and planned == seen


def test_a_kv_bound_reaches_every_pass_as_its_own_bound():
    """Under a kv bound (a bound on N), each pass's AttnBatch.max_kv_len is the bound plus
    the pass's extra kv rows (pass_shapes), which holds its seq_lens, and its backend plans for it;
    kv_len_buckets turns the backends' kv_len_bounds into bounds on N."""
    target, mtp = make_models("cpu", torch.float32)
    cfg = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=16, max_batch_size=4, max_context_len=256)
    worker = EagleWorker(target, mtp, cfg)
    worker.add_requests(prompts(3, seed=4), 30)
    worker.step()
    step = worker.spec_step
    shapes = step.pass_shapes()
    assert len(shapes) == cfg.num_steps + 1 and all(b.kv_len_bounds(4, q) == () for b, _, q in shapes)
    assert step.kv_len_buckets(4) == []
    bound, seen = max(r.seq_len for r in worker.requests) + 5, []
    for backend, _, _ in shapes:
        backend.init_forward_metadata = lambda batch, shared_block_tables=None, b=backend, f=backend.init_forward_metadata: (
            f(batch, shared_block_tables), seen.append((id(b), batch.max_kv_len, max(batch.seq_lens.tolist()),
                                                        b.metadata.max_seq_len)))[0]
    step.run(*worker.step_inputs(), kv_bound=bound)
    expected = [(id(b), bound + extra) for b, extra, _ in shapes]
    assert [(b, limit) for b, limit, _, _ in seen] == expected
    assert all(longest <= limit == planned for _, limit, longest, planned in seen)
    worker.verify_backend.kv_len_bounds = lambda bs, q_len: (100, 300) if (bs, q_len) == (4, 6) else ()
    worker.draft_extend_backend.kv_len_bounds = lambda bs, q_len: (3,)  # no N fits: kv rows past N alone are 4
    assert step.kv_len_buckets(4) == [94, 294] and step.kv_len_buckets(2) == []
    for draft_step in worker.draft_backend.steps:  # 97 - 2 and 97 - 4 rows: within KV_BOUND_GAP of 94, kept once
        draft_step.kv_len_bounds = lambda bs, q_len: (97,)
    assert step.kv_len_buckets(4) == [93, 294]


def test_a_step_replays_the_smallest_kv_bound_holding_its_longest_request():
    runner = type("R", (), {"kv_bounds": {4: [94, 294, None], 1: [None]}})()
    for longest, bound in ((10, 94), (94, 94), (95, 294), (294, 294), (295, None)):
        assert GraphRunner.kv_bound(runner, 4, longest) == bound and GraphRunner.kv_bound(runner, 1, longest) is None


GPU_BACKENDS = ["torch_ref", "triton_mla", "flashinfer_mla", "flashmla"]


def page_size_of(backend: str) -> int:
    """The tests' page size: FlashMLA's kernel takes pages of 64 only; 16 spans pages in a pass elsewhere."""
    return 64 if backend == "flashmla" else 16


def gpu_worker(backend, topk=1, num_steps=3, ndt=None, max_bs=4, device="cuda", draft_mode="eagle", **config):
    needs_library(backend)
    target, mtp = make_models(device, torch.float32)
    draft = StandaloneDraft(target) if draft_mode == "standalone" else mtp
    cfg = SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=ndt, attention_backend=backend, kv_dtype="bf16",
                     page_size=page_size_of(backend), max_batch_size=max_bs, max_context_len=256, draft_mode=draft_mode,
                     **config)
    return target, EagleWorker(target, draft, cfg)


def host_seq_lens(worker) -> np.ndarray:
    """The running requests' N ``[b]`` int64, as the worker hands them to GraphRunner.run."""
    return np.array([r.seq_len for r in worker.requests], dtype=np.int64)


def _pad(live: dict[str, torch.Tensor], bucket: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in live.items():
        pad = torch.full((bucket - t.shape[0], *t.shape[1:]), PADDING_ROW if name.endswith("rows") else 0, dtype=t.dtype, device=t.device)
        out[name] = torch.cat([t, pad])
    return out


@pytest.mark.gpu
def test_a_replaced_state_field_reaches_the_graphs():
    """The runner skips copying the last replay's own state back into its static inputs. A field
    of that state replaced by another tensor is copied (the tree's root is the new token), and the
    next step's state is the graph's again: a batch change after it stays lossless."""
    target, worker = gpu_worker("triton_mla")
    runner = worker.capture_graphs([1, 2, 4], progress=False)
    worker.add_requests(prompts(3, seed=3), 20)
    worker.step()
    st, trows, drows = worker.step_inputs()
    assert all(a is b for a, b in zip((*vars(st).values(), trows, drows), runner._resident, strict=True))
    st.root = (st.root + 1) % target.config.vocab_size
    _, _, tree = runner.run(st, trows, drows, host_seq_lens(worker))
    assert torch.equal(tree.tokens[:, 0], st.root)

    target, worker = gpu_worker("triton_mla")
    worker.capture_graphs([1, 2, 4], progress=False)
    group = prompts(3, seed=3)
    reqs = worker.add_requests(group, 20)
    worker.step()
    worker.state.root = worker.state.root.clone()  # equal values, another tensor
    worker.step()
    late = worker.add_requests([[5, 6, 7]], 4)
    while worker.requests:
        worker.step()
    assert [r.output for r in reqs + late] == reference(target, [(group, 20), ([[5, 6, 7]], 4)], backend="triton_mla",
                                                        kv_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("topk,ndt", [(1, None), (2, 6)])
@pytest.mark.parametrize("batch", [3, 4])  # padded and exact bucket
def test_replay_equals_eager_bitwise(backend, topk, ndt, batch):
    """A replayed step gives each stage's eager outputs bitwise: the draft tree (draft), the
    accept result (verify) and the next state (draft-extend)."""
    _skip_trees_without_masks(backend, topk)
    target, worker = gpu_worker(backend, topk=topk, ndt=ndt)
    runner = worker.capture_graphs([1, 2, 4], progress=False)
    worker.add_requests(prompts(batch, seed=batch), 20)
    for _ in range(2):  # a couple of steps so states differ per request
        worker.step()
    st, trows, drows = worker.step_inputs()
    live = {"target_rows": trows, "draft_rows": drows, **vars(st)}
    padded = _pad(live, 4)
    if runner.host_planned:
        worker.spec_step.plan_passes_on_host(padded["seq_lens"].int().cpu())
    result, state, tree = worker.spec_step.run(DecodeState.of(padded), padded["target_rows"], padded["draft_rows"])
    expected = {kind: [None if t is None else t[:batch].clone() for t in vars(part).values()]
                for kind, part in zip(GRAPH_KINDS, (tree, result, state))}
    result, state, tree = runner.run(st, trows, drows, host_seq_lens(worker))
    got = {kind: list(vars(part).values()) for kind, part in zip(GRAPH_KINDS, (tree, result, state))}
    for kind in GRAPH_KINDS:
        assert len(got[kind]) == len(expected[kind])
        for e, g in zip(expected[kind], got[kind]):
            assert (e is None and g is None) or torch.equal(e, g), kind


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("topk,ndt", [(1, None), (2, 6)])
def test_long_run_with_graphs_is_lossless(backend, topk, ndt):
    _skip_trees_without_masks(backend, topk)
    target, worker = gpu_worker(backend, topk=topk, ndt=ndt, max_bs=6)
    worker.capture_graphs([1, 2, 4, 6], progress=False)
    groups = [(prompts(2, seed=1), 40), (prompts(3, seed=2), 25), (prompts(1, seed=3), 30)]
    outputs, _ = run_to_completion(worker, groups, join_every=5)
    assert outputs == reference(target, groups, backend=backend, kv_dtype=torch.bfloat16, page_size=page_size_of(backend))
    assert worker.target_pool.num_free_pages == worker.config.pool_pages - 1


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_graphed_target_only_decoding_equals_eager(backend):
    """The graphed baseline the benchmarks and the example time (GreedyDecoder(cuda_graph=True):
    an eager step, a capturing one, then replays) decodes what eager decoding does."""
    needs_library(backend)
    target, _ = make_models("cuda", torch.float32)
    group = prompts(3, seed=5)
    kwargs = dict(backend=backend, page_size=page_size_of(backend), kv_dtype=torch.bfloat16)
    decoder = GreedyDecoder(target, group, 20, cuda_graph=True, **kwargs)
    for _ in range(19):
        decoder.step()
    assert decoder.graph is not None
    assert decoder.outputs() == greedy_generate(target, group, 20, **kwargs)
    with pytest.raises(RuntimeError, match="max_new_tokens"):
        decoder.step()


@pytest.mark.gpu
def test_runner_misuse_is_refused_and_results_are_the_steps_own():
    """Capturing while a step is in flight (its warm-ups would run into that step's copy to the
    host), empty buckets and cudaMallocAsync are refused; numpy buckets become Python ints; each
    replay returns a result object of its own, and finish_step refuses a stale one; a standalone
    draft narrower than the target is captured. Decoding stays target-only greedy throughout."""
    target, worker = gpu_worker("triton_mla")
    group = prompts(3, seed=2)
    reqs = worker.add_requests(group, 16)
    in_flight = worker.launch_step()
    with pytest.raises(RuntimeError, match="capture_graphs while a step is in flight"):
        worker.capture_graphs([1, 2, 4], progress=False)
    worker.finish_step(in_flight)
    with pytest.raises(ValueError, match="batch_sizes is empty"):  # not the default buckets
        worker.capture_graphs([], progress=False)
    # Refused under cudaMallocAsync: Triton refuses its pointers in a capture.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
        with pytest.raises(ValueError, match="native CUDA allocator, not cudaMallocAsync"):
            worker.capture_graphs([1, 2, 4], progress=False)
    runner = worker.capture_graphs(np.array([1, 2, 4]), progress=False)
    assert runner.buckets == [1, 2, 4] and all(type(b) is int for b in runner.buckets)
    first = worker.launch_step()
    worker.finish_step(first)
    second = worker.launch_step()
    assert second is not first
    with pytest.raises(RuntimeError):
        worker.finish_step(first)
    worker.finish_step(second)
    while worker.requests:
        worker.step()
    assert [r.output for r in reqs] == reference(target, [(group, 16)], backend="triton_mla", kv_dtype=torch.bfloat16)

    torch.manual_seed(5)
    narrow = DeepseekV3ForCausalLM(tiny_config(num_hidden_layers=1, hidden_size=32)).cuda().eval()
    cfg = SpecConfig(num_steps=3, draft_mode="standalone", attention_backend="triton_mla", kv_dtype="bf16",
                     page_size=16, max_batch_size=4, max_context_len=256)
    worker = EagleWorker(target, StandaloneDraft(narrow), cfg)
    worker.capture_graphs([1, 2, 4], progress=False)
    groups = [(prompts(3, seed=6), 20)]
    outputs, _ = run_to_completion(worker, groups)
    assert outputs == reference(target, groups, backend="triton_mla", kv_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_steps_from_a_thread_that_has_done_no_gpu_work(graphs):
    """Steps from an engine's scheduler thread decode target-only greedy tokens: in a step of an
    unchanged batch the graph's launch is the thread's first GPU work, so the worker makes its
    device's context current."""
    import threading

    target, worker = gpu_worker("triton_mla")
    if graphs:
        worker.capture_graphs([1, 2, 4], progress=False)
    group = prompts(3, seed=3)
    reqs = worker.add_requests(group, 24)
    worker.step()
    errors = []

    def drive() -> None:
        try:
            while worker.requests:
                worker.step()
        except Exception as error:  # reported below: pytest does not see a thread's exceptions
            errors.append(error)

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join()
    assert not errors, errors
    assert [r.output for r in reqs] == reference(target, [(group, 24)], backend="triton_mla", kv_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton_mla", "flashinfer_mla"])
@pytest.mark.parametrize("graphs", [False, True])
def test_a_worker_on_another_gpu_than_the_current_one(graphs, backend):
    """An engine driving two GPUs from one process: a worker on cuda:1, stepped while cuda:0 is
    current, sends its kernel launches, event records and graph captures and replays to cuda:1
    (specdec.device.on_device), decodes what target-only decoding on cuda:1 does, and holds no
    memory on cuda:0. Needs two GPUs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.cuda.set_device(0)
    torch.cuda.reset_peak_memory_stats(0)  # the peak from here on: frees of earlier tests' tensors cannot hide an allocation
    held_on_0 = torch.cuda.memory_allocated(0)
    target, worker = gpu_worker(backend, device="cuda:1")
    if graphs:
        worker.capture_graphs([1, 2, 4], progress=False)
    groups = [(prompts(2, seed=7), 24), (prompts(2, seed=8), 16)]
    outputs, _ = run_to_completion(worker, groups)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert torch.cuda.max_memory_allocated(0) == held_on_0
    with torch.cuda.device(1):  # the baseline's kernel launches take the current device
        expected = reference(target, groups, backend=backend, kv_dtype=torch.bfloat16)
    assert outputs == expected


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch_ref", "triton_mla"])
def test_batches_above_the_largest_bucket_run_eagerly_with_eager_fallback(backend):
    target, worker = gpu_worker(backend, max_bs=4)
    with pytest.raises(ValueError, match="eager_fallback"):
        worker.capture_graphs([1, 2], progress=False)
    worker.capture_graphs([1, 2], eager_fallback=True, progress=False)
    groups = [(prompts(3, seed=8), 24), (prompts(1, seed=9), 12)]
    outputs, _ = run_to_completion(worker, groups, join_every=3)
    assert outputs == reference(target, groups, backend=backend, kv_dtype=torch.bfloat16)


@pytest.mark.gpu
def test_steps_switch_kv_bounds_as_requests_grow_and_stay_lossless():
    """triton_mla on SM90 over 64-token pages: a 16-head verify of 4 tokens plans the narrow Triton
    tile up to 2k kv rows and the wgmma tile past it (contexts of 4k), so the runner captures the
    batch-1 step for N <= 2044 too. A request growing past that replays both kinds, losslessly."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    limit = narrow_plan_limit(1, 16, 4, 4096, sms, wide_tiles=True)  # 2048 on an H100 SXM (132 SMs)
    if torch.cuda.get_device_capability()[0] != 9 or wgmma_tile.gluon is None or not limit:
        pytest.skip("the wgmma tile (and so a second plan) is SM90's, with Gluon")
    target, mtp = make_models("cuda", torch.float32, num_attention_heads=16, max_position_embeddings=4096)
    cfg = SpecConfig(num_steps=3, topk=1, attention_backend="triton_mla", kv_dtype="bf16", page_size=64,
                     max_batch_size=2, max_context_len=4096)
    worker = EagleWorker(target, mtp, cfg)
    runner = worker.capture_graphs([1, 2], progress=False)
    bound = limit - 4  # verify and draft-extend attend N + 4 kv rows
    assert bound in runner.kv_bounds[1] and runner.kv_bounds[1][-1] is None
    replayed = []
    replay = runner.replay
    runner.replay = lambda bucket, kv_bound=None: (replayed.append((bucket, kv_bound)), replay(bucket, kv_bound))
    prompt = torch.randint(0, VOCAB, (bound - 25,), generator=torch.Generator().manual_seed(7)).tolist()
    groups = [([prompt], 60)]
    outputs, _ = run_to_completion(worker, groups)
    assert outputs == reference(target, groups, backend="triton_mla", kv_dtype=torch.bfloat16)
    assert (1, bound) in replayed and (1, None) in replayed
    assert worker.capture_graphs([1], eager_fallback=True, progress=False, kv_bounds=False).kv_bounds == {1: [None]}


_HELD_BY_TWO_RUNNERS = """
import json, torch
from test_graphs import gpu_worker

held, workers = [], []  # workers alive to the end: a freed graph pool's blocks would serve the next capture
for buckets in ([1], [1, 2, 4, 8]):
    _, worker = gpu_worker("triton_mla", max_bs=8)
    workers.append(worker)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    worker.capture_graphs(buckets, eager_fallback=True, progress=False)
    held.append(torch.cuda.memory_allocated() - before)
print(json.dumps(held))
"""


@pytest.mark.gpu
def test_a_second_runner_holds_no_more_cublas_workspace():
    """cuBLAS keeps a workspace for each stream it has run on (32 MiB on SM90) for the life of the
    process; every capture of every runner warms up and is captured on one stream per device
    (capture_stream), so a second runner, of four buckets, holds less than one more. In a fresh
    process: torch hands out 32 streams a device round robin, which earlier tests have run on."""
    tests = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _HELD_BY_TWO_RUNNERS], cwd=tests, env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    held = json.loads(out.splitlines()[-1])
    assert held[1] < 16 * 2**20, [h / 2**20 for h in held]


def _skip_trees_without_masks(backend, topk):
    if topk > 1 and backend in ("flashinfer_mla", "flashmla"):
        pytest.skip(f"{backend} has no tree masks")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,graphs,topk", [("triton_mla", False, 2), ("triton_mla", True, 2),
                                                    ("flashinfer_mla", False, 1), ("flashinfer_mla", True, 1),
                                                    ("flashmla", False, 1), ("flashmla", True, 1)])
def test_whole_step_has_no_host_sync(backend, graphs, topk):
    """Steps with a join and page growth in between: launch_step (pages, inputs, draft, tree,
    verify, accept, KV commit, draft-extend) never syncs, eager or graphed."""
    check_steps_without_sync(lambda: gpu_worker(backend, topk=topk, ndt=6 if topk > 1 else None)[1], graphs)


def check_steps_without_sync(make_worker, graphs: bool) -> None:
    """Six steps of a fresh worker (``make_worker()``, graphs captured for batches 1, 2 and 4 where
    ``graphs``), a join and page growth in between: no launch_step syncs (_launch_without_sync)."""
    for checked in _runs(graphs):
        worker = make_worker()
        if graphs:
            worker.capture_graphs([1, 2, 4], progress=False)
        worker.add_requests(prompts(2, seed=5), 40)
        for i in range(6):
            if i == 3:
                worker.add_requests(prompts(1, seed=6), 20)
            _launch_without_sync(worker, checked, graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_sampled_standalone_steps_have_no_host_sync(graphs):
    """As above with tree rejection sampling (temperature, top-p, top-k) over a standalone draft's
    topk 2 trees, a join and an abort between steps."""
    for checked in _runs(graphs):
        _, worker = gpu_worker("triton_mla", topk=2, ndt=6, draft_mode="standalone", enable_sampling=True)
        if graphs:
            worker.capture_graphs([1, 2, 4], progress=False)
        running = worker.add_requests(prompts(2, seed=5), 40, sampling=[SamplingParams(0.8, 0.9, 20)] * 2)
        for i in range(6):
            if i == 2:
                worker.add_requests(prompts(1, seed=6), 20, sampling=[SamplingParams(1.0)])
            if i == 4:
                worker.abort(running[:1])
            _launch_without_sync(worker, checked, graphs)


def _runs(graphed: bool) -> tuple[bool, ...]:
    """Whether each run of a no-sync test is checked: graphed, a first unchecked run compiles what
    the busy-stream check must not wait for; eager, one checked run (no busy stream)."""
    return (False, True) if graphed else (True,)


def _launch_without_sync(worker, checked: bool, graphed: bool) -> None:
    """One step; checked: its launch_step runs under torch's sync debug mode set to raise and,
    graphed, behind ~0.5 s of queued device work: the debug mode misses event waits, a stream left
    busy does not (a wait for anything queued after it would outlast it). Not eager: an eager step
    of ~1000 kernels fills the launch queue behind the busy stream and waits for room, no sync."""
    if not checked:
        worker.finish_step(worker.launch_step())
        return
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    if graphed:
        torch.cuda._sleep(10**9)
        busy.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = worker.launch_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not (graphed and busy.query()), "launch_step waited for the device"
    worker.finish_step(result)
