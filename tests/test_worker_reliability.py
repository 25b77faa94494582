"""What a worker survives: a second thread's call is refused, the running requests cannot be
reordered, an interrupt at any line of a call leaves the worker consistent (and lossless) or
refusing every call but reset(), and sizes no machine holds are refused when it is built."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from specdec.config import ConfigError, SpecConfig
from specdec.worker import EagleWorker
from spec_helpers import free_pages, make_models, prompts, reference

SPECDEC = str(Path(__file__).resolve().parent.parent / "specdec")
GROUPS = [(prompts(2, seed=21), 7), (prompts(1, seed=22), 5)]


@pytest.fixture(scope="module")
def models():
    return make_models()


@pytest.fixture(scope="module")
def expected(models):
    return reference(models[0], GROUPS)


def new_worker(models, **config) -> EagleWorker:
    cfg = dict(num_steps=2, topk=2, num_draft_tokens=4, page_size=4, max_batch_size=3, max_context_len=64)
    return EagleWorker(*models, SpecConfig(**{**cfg, **config}))


def test_a_second_thread_is_refused_while_a_call_runs(models):
    worker = new_worker(models)
    reqs = worker.add_requests(*GROUPS[0])
    inside, release = threading.Event(), threading.Event()
    run = worker.spec_step.run

    def slow_run(*args, **kwargs):
        inside.set()
        assert release.wait(30)
        return run(*args, **kwargs)

    worker.spec_step.run = slow_run
    stepper = threading.Thread(target=lambda: worker.step())
    stepper.start()
    assert inside.wait(30)
    for name, call in (("step", worker.step), ("launch_step", worker.launch_step), ("abort", lambda: worker.abort(reqs)),
                       ("add_requests", lambda: worker.add_requests([[1, 2]], 4)), ("reset", worker.reset)):
        with pytest.raises(RuntimeError, match=f"^{name}: EagleWorker.step is running on another thread; EagleWorker "
                                               "takes one caller at a time"):
            call()
    release.set()
    stepper.join(30)
    worker.spec_step.run = run
    while worker.requests:
        worker.step()
    assert [r.output for r in reqs] == reference(models[0], GROUPS[:1])


def test_the_running_requests_cannot_be_reordered(models):
    worker = new_worker(models)
    worker.add_requests(*GROUPS[0])
    assert isinstance(worker.requests, tuple)
    with pytest.raises(AttributeError):
        worker.requests.sort(key=lambda r: -r.rid)
    with pytest.raises(AttributeError):
        worker.requests = list(reversed(worker.requests))


def interrupted(call, line: int, where: tuple[str, ...]) -> bool:
    """Run ``call()`` raising KeyboardInterrupt at its ``line``-th executed line in ``where``
    (specdec/ modules such as "worker.py", or function names such as "alloc_request"); True if it
    was interrupted, False if it ended first."""
    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] == line:
                raise KeyboardInterrupt
        return local

    def start(frame, event, arg):
        code = frame.f_code
        if code.co_filename.startswith(SPECDEC) and (Path(code.co_filename).name in where or code.co_name in where):
            return local
        return None

    sys.settrace(start)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def recover_and_finish(worker: EagleWorker, pending: list) -> list:
    """What an engine does after an interrupted call (README): reset() where a call says so,
    else finish the step in flight; then it admits what is pending and decodes to the end.
    Returns the requests it admitted."""
    try:
        worker.abort([])
    except RuntimeError as err:
        if "call reset()" not in str(err):
            assert "in flight" in str(err), err
        else:
            worker.reset()
    if worker.in_flight is not None:
        worker.finish_step(worker.in_flight)
    reqs = [req for group in pending for req in worker.add_requests(*group)]
    while worker.requests:
        worker.step()
    return reqs


def check(worker: EagleWorker, reqs: list, expected: list, pages: tuple[int, int]) -> None:
    """Every output is a prefix of target-only greedy decoding's (all of it unless reset() cut it
    short), and every page and row came back."""
    for req, want in zip(reqs, expected, strict=True):
        assert req.finished and req.output == want[:len(req.output)]
    assert free_pages(worker) == pages
    assert all(len(pool._free_rows) == pool.req_to_token.shape[0] - 1 for pool in (worker.target_pool, worker.draft_pool))


# The worker's own bookkeeping, where its state changes; the passes' code (step, tree, accept, the
# models) changes none of it, and eager passes are interrupted in launch_step's scenario.
BOOKKEEPING = ("worker.py", "admission.py", "pages.py", "kv.py", "state.py", "guard.py", "batch.py")
# scenario: (the call interrupted, where its lines are counted, stride)
SCENARIOS = {
    "add_requests": (lambda worker, reqs: lambda: worker.add_requests(*GROUPS[1]), BOOKKEEPING, 1),
    "alloc_request": (lambda worker, reqs: lambda: worker.add_requests(*GROUPS[1]), ("alloc_request",), 1),
    "launch_step": (lambda worker, reqs: worker.launch_step, BOOKKEEPING + ("step.py", "tree.py", "accept.py"), 5),
    "finish_step": (lambda worker, reqs: (lambda result: lambda: worker.finish_step(result))(worker.launch_step()),
                    BOOKKEEPING, 1),
    "abort": (lambda worker, reqs: lambda: worker.abort(reqs[:1]), BOOKKEEPING, 1),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_an_interrupt_at_any_line_leaves_the_worker_consistent_or_refusing(models, expected, scenario):
    """A KeyboardInterrupt at each executed line of the call's bookkeeping (launch_step: every 5th),
    then the engine's recovery: every output a prefix of target-only greedy decoding's, whole
    where no reset() cut it, and no page or row held. Some lines fall in a window the worker
    marks (it then refuses every call but reset()), the others leave it consistent."""
    make_call, where, stride = SCENARIOS[scenario]
    line, hit, marked = 0, True, set()
    while hit:
        line += stride
        worker = new_worker(models)
        pages = free_pages(worker)
        reqs = worker.add_requests(*GROUPS[0])
        worker.step()
        hit = interrupted(make_call(worker, reqs), line, where)
        broken = worker._guard.broken is not None
        marked.add(broken)
        admitting = scenario in ("add_requests", "alloc_request")
        new = [r for r in worker._issued.values() if r not in reqs] if admitting else []
        reqs += new + recover_and_finish(worker, [] if new else [GROUPS[1]])
        check(worker, reqs, expected, pages)
        if not broken:  # no reset(): every request but an aborted one decodes to its end
            kept = reqs[1:] if scenario == "abort" else reqs
            assert all(r.output == e for r, e in zip(kept, expected[len(reqs) - len(kept):])), line
    assert line > 3 * stride  # the harness reached into the call
    if scenario in ("add_requests", "finish_step", "abort", "launch_step"):
        assert True in marked


@pytest.mark.parametrize("setting, value", [("num_pages", 10**9), ("max_context_len", 2**29), ("num_pages", 2**62)])
def test_sizes_no_machine_holds_are_refused_by_name(models, setting, value):
    config = {**dict(num_steps=2, page_size=64, max_batch_size=1, max_context_len=128), setting: value}
    with pytest.raises(ConfigError, match=r"the KV pools need [\d.]+ GiB .* available; lower num_pages, max_context_len "
                                          "or max_batch_size"):
        EagleWorker(*models, SpecConfig(**config))
