"""EagleWorker: what an engine embeds, the spec-decode lifecycle over a changing batch.

add_requests (prefill, join) -> launch_step (enqueue one step, no host sync) -> finish_step (wait
for the step's one copy to the host, bookkeeping, finished requests leave) -> ...; step() is
launch_step then finish_step; abort(requests) stops requests early. The step itself is
specdec.step.SpecStep; prefill is specdec.prefill.Prefill; capture_graphs() makes every later
step one CUDA-graph launch (graphs.runner).
"""

from __future__ import annotations

import copy
import weakref
from typing import Optional

import numpy as np
import torch

from attn.multistep import MultiStepDraftBackend
from attn.values import item_list
from specdec.accept import AcceptResult
from specdec.admission import Admission
from specdec.batch import host_to_device
from specdec.config import ConfigError, SpecConfig
from specdec.device import on_device
from specdec.draft import DraftModel, TargetModel, check_draft, check_sparse, check_target
from specdec.guard import CallGuard, exclusive
from specdec.kv import MLAKVPool, OutOfPagesError, check_memory
from specdec.pages import BatchPages
from specdec.parallel import SINGLE
from specdec.prefill import Prefill
from specdec.sampling import SamplingParams
from specdec.state import BatchHost, DecodeState, HostCopy, Request, StepStats
from specdec.step import SpecStep, StepReport
from specdec.tree import VerifyTree


class EagleWorker:
    """Runs EAGLE (or standalone-draft) speculative decoding for a changing batch of requests.

    The worker keeps its own validated copy of the SpecConfig (``worker.config``): later edits of
    the caller's object reach nothing, and ``worker.config`` itself is read-only (SpecConfig.lock;
    ``dataclasses.replace(worker.config, ...)`` gives an editable copy for another worker). (The
    backends' adjustments, a Blackwell page size, are made when a SpecConfig is validated, so the
    caller's object shows them too.)"""

    def __init__(self, target: TargetModel, draft: DraftModel, config: SpecConfig) -> None:
        config = copy.deepcopy(config)  # the worker's own: later edits of the caller's reach nothing sized from it
        config.validate()  # again: a config may have been changed since it was built
        config.lock()
        self._config = config
        check_target(target)
        param = next(target.parameters())
        self.device, self.dtype = param.device, param.dtype
        check_draft(draft, target, config)
        self.target, self.draft = target, draft
        self.parallel = getattr(target, "parallel", SINGLE)
        self.draft_offset = config.draft_offset
        kv_dtype = config.cache_dtype(self.dtype, self.device)
        check_sparse(target, draft, config, kv_dtype)
        # (num_layers, index_head_dim) of each pool: a sparse model's holds its indexer keys too
        sizes = tuple((model.num_attention_layers, model.attn_spec().index_head_dim) for model in (target, draft))
        check_memory(config, sizes, kv_dtype, self.device)

        def pool(num_layers: int, index_head_dim: int) -> MLAKVPool:
            return MLAKVPool(num_layers, config.pool_pages, config.page_size, config.max_batch_size,
                             config.max_context_len, kv_dtype, self.device, config.kv_scale, index_head_dim)

        self.target_pool, self.draft_pool = (pool(*size) for size in sizes)
        self.pages = BatchPages(self.target_pool, self.draft_pool, config.num_draft_tokens, self.draft_offset,
                                config.draft_region_len)
        classes = config.backends.classes()
        bs, ndt, steps, topk = config.max_batch_size, config.num_draft_tokens, config.num_steps, config.topk
        tview, dview = self.target_pool.view(), self.draft_pool.view()
        try:  # backends check the model's heads and the passes' sizes against their kernels here
            self.verify_backend = classes["target"](tview, target.attn_spec(), bs, ndt, ndt if topk > 1 else 0)
            self.target_prefill_backend = classes["prefill"](tview, target.attn_spec(), bs, ndt)
            self.draft_backend = MultiStepDraftBackend(classes["draft"], dview, draft.attn_spec(), bs, steps, topk)
            self.draft_prefill_backend = classes["prefill"](dview, draft.attn_spec(), bs, steps + 1)
            self.draft_extend_backend = classes["draft_extend"](dview, draft.attn_spec(), bs, steps + 1)
        except ValueError as err:
            raise ConfigError(f"{err} (this worker's passes: verify {ndt} query tokens a request = num_draft_tokens, "
                              f"draft steps {topk} = topk, draft-extend {steps + 1} = num_steps + 1; batches up to "
                              f"max_batch_size={bs})") from err
        pools = (self.target_pool, self.draft_pool)
        self.admission = Admission(config, target.config.vocab_size, self.pages, self.draft_offset)
        self.prefill = Prefill(target, draft, config, pools, self.target_prefill_backend, self.draft_prefill_backend,
                               self.dtype)
        self.spec_step = SpecStep(target, draft, config, pools, self.verify_backend, self.draft_backend,
                                  self.draft_extend_backend, HostCopy((bs, StepReport.width(steps)), self.device))
        self._requests: tuple[Request, ...] = ()
        self.state: Optional[DecodeState] = None
        self.last_tree: Optional[VerifyTree] = None  # the last step's, until the next (views of the backend's/graphs' buffers)
        self._graph_runner = None  # capture_graphs'
        self._next_rid = 0
        self._issued: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> Request add_requests returned
        self._batch: Optional[BatchHost] = None  # host arrays of the running batch; None: rebuild
        self._in_flight: Optional[AcceptResult] = None  # launch_step's result until finish_step takes it
        self._guard = CallGuard("EagleWorker", recovery="reset")

    @property
    def config(self) -> SpecConfig:
        """The worker's validated, read-only SpecConfig (its pools, buffers and graphs were sized
        from it): build another worker from ``dataclasses.replace(worker.config, ...)``."""
        return self._config

    @property
    def in_flight(self) -> Optional[AcceptResult]:
        """The step launch_step launched and finish_step has not finished (None: none). A
        finish_step that raised before its host bookkeeping (an interrupted wait, out of memory in
        the batch state's gather) changed nothing: call it again with this, e.g. after step()
        raised and this is not None."""
        return self._in_flight

    @property
    def requests(self) -> tuple[Request, ...]:
        """The running requests, in the order of the device state's rows: read-only (a tuple)."""
        return self._requests

    @property
    def graph_runner(self):
        """The GraphRunner capture_graphs built (None: steps run eagerly)."""
        return self._graph_runner

    def check_idle(self, call: str) -> None:
        """Refuse ``call`` while a step is in flight: its results apply to the batch it launched."""
        if self._in_flight is not None:
            raise RuntimeError(f"{call} while a step is in flight: finish_step(worker.in_flight) first")

    @on_device
    @exclusive
    @torch.inference_mode()
    def add_requests(
        self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: Optional[int] = None,
        sampling: Optional[list[SamplingParams]] = None,
    ) -> list[Request]:
        """Prefill new requests (target, then draft) and add them to the running batch.

        prompts: token ids (ints) per request; max_new_tokens >= 1 (the prefill's token is the
        first); eos_token_id: one id or None. sampling: one SamplingParams per prompt (default greedy;
        no seed: a fresh one each, in Request.sampling); temperature > 0 needs
        ``SpecConfig.enable_sampling``. Validates everything first: a bad request (one that
        max_context_len or a pool's pages could not hold at its last step too) raises and changes
        nothing. The new requests take the pages of their prefill and first step (BatchPages.admission),
        else OutOfPagesError, changing nothing; a failure while prefilling (out of memory) releases
        the new requests' pages and rows and leaves the running batch's decode as it was (pages
        its requests held ahead of need, taken back to admit them, stay free). Not while a step
        is in flight (between launch_step and finish_step).
        """
        self.check_idle("add_requests")
        checked = self.admission.check(prompts, max_new_tokens, eos_token_id, sampling, len(self.requests))
        if checked is None:
            return []
        prompts, max_new_tokens, eos_token_id = checked.prompts, checked.max_new_tokens, checked.eos_token_id
        held = self.pages.rows_held()
        try:
            try:
                new = self.admission.allocate(checked, self._next_rid)
            except OutOfPagesError:
                self.pages.free_rows_since(held)  # what it took before a pool ran short
                new = None
            if new is None:  # (outside the except: trim_for's own error is the one to show)
                # The running requests' grow-ahead pages come back first, as they do for a growing request.
                self.pages.trim_for(self._batch_host(), [len(p) for p in prompts], max_new_tokens)
                new = self.admission.allocate(checked, self._next_rid)
            new_state = self.prefill.run(new)
            first = HostCopy(new_state.root.shape, self.device).fetch(new_state.root).tolist()
            keep = [i for i, token in enumerate(first) if not (max_new_tokens <= 1 or token == eos_token_id)]
            if keep:
                new_state = new_state.select(torch.tensor(keep, device=self.device))
                state = new_state if self.state is None else DecodeState.concat([self.state, new_state])
            for i in set(range(len(new))) - set(keep):  # ended at its prefill: done with its pages
                self.pages.release(new[i])
            self._guard.broken = "add_requests"  # until the batch and the new requests agree again
        except BaseException:
            self.pages.free_rows_since(held)  # the new requests' rows and pages, whether they received them or not
            self._guard.broken = None
            raise
        self._next_rid += len(new)
        self._issued.update((id(req), req) for req in new)
        for i, (req, token) in enumerate(zip(new, first)):
            req.output.append(token)  # the prefill's token is the first output
            req.finished = i not in keep
        if keep:
            self.state = state
            self._requests += tuple(new[i] for i in keep)
            self._batch = None
        self._guard.broken = None
        return new

    @exclusive
    def capture_graphs(self, batch_sizes: Optional[list[int]] = None, eager_fallback: bool = False,
                       progress: bool = True, kv_bounds: bool = True):
        """Capture the step as CUDA graphs (graphs.runner.GraphRunner over ``spec_step``): every
        later step whose batch fits a bucket is one launch. batch_sizes: the buckets (default: the
        config's cuda_graph_batch_sizes, else default_buckets), at most max_batch_size; below it only
        with eager_fallback (larger batches run eagerly). kv_bounds: also capture each bucket's
        step per kv bound its backends plan shorter contexts for. Returns the runner, which the
        worker keeps (``graph_runner``). Not while a step is in flight (the warm-ups run a step)."""
        from graphs.runner import GraphRunner  # graphs/ builds on specdec, not the other way round

        self.check_idle("capture_graphs")
        self._graph_runner = GraphRunner(self.spec_step, batch_sizes, eager_fallback, progress, kv_bounds)
        return self._graph_runner

    @exclusive
    def step(self) -> StepStats:
        """One spec-decode iteration over every running request; finished requests leave."""
        self.check_idle("step")
        return self.finish_step(self.launch_step())

    @on_device
    @exclusive
    @torch.inference_mode()
    def launch_step(self) -> AcceptResult:
        """Reserve pages and enqueue the step's device work (graph replay or eager); no host sync."""
        self.check_idle("launch_step")
        if not self.requests:
            raise RuntimeError("no running requests: add_requests first")
        st, target_rows, draft_rows = self.step_inputs()
        out = None
        if self._graph_runner is not None:
            self._guard.broken = "launch_step"  # a replay writes the next state over this one
            out = self._graph_runner.run(st, target_rows, draft_rows, self._batch_host().seq_len)
        if out is None:  # eager: the state is replaced only below
            self._guard.broken = None
            out = self.spec_step.run(st, target_rows, draft_rows)
            self._guard.broken = "launch_step"
        result, self.state, self.last_tree = out
        self.spec_step.host_copy.start(result.emitted.shape[0])
        self._in_flight = result
        self._guard.broken = None
        return result

    def step_inputs(self) -> tuple[DecodeState, torch.Tensor, torch.Tensor]:
        """Reserve every running request's pages for the next step (BatchPages.reserve); returns
        (state, target rows ``[B]``, draft rows ``[B]``), the rows built once per change of the
        batch (the same tensors while it runs unchanged)."""
        h = self._batch_host()
        self.pages.reserve(h)
        return self.state, *h.device_rows

    @on_device
    @exclusive
    def finish_step(self, result: AcceptResult) -> StepStats:
        """Wait for the step's copy to the host (enqueued by launch_step, of ``result`` and its
        stops); then the host bookkeeping, and finished requests leave."""
        if self._in_flight is None:
            raise RuntimeError("finish_step: no step in flight (launch_step raised before launching one, or the "
                               "step was finished): nothing to finish; call launch_step or step")
        if result is not self._in_flight:
            raise RuntimeError("finish_step takes the result of the step in flight (what launch_step returned)")
        host_copy = self.spec_step.host_copy
        report = StepReport.unpack(host_copy.wait())
        if self._config.check_ranks:
            self._check_ranks(report)
        finished = np.flatnonzero(report.done).tolist()
        # The step's one call that may fail (out of memory) comes before any change: a finish_step
        # that raised there or in the wait (an interrupt) may be called again.
        state = self._state_without(finished)
        self._guard.broken = "finish_step"  # from here to the end the batch changes host side only
        host_copy.release()
        self._in_flight = None
        h = self._batch_host()
        # N advances in the batch's array (the page checks') and in each request (what a rebuild of
        # the batch reads): all accept_len + 1 for each request that stays; only finishing ones are cut.
        h.seq_len += report.take
        for req, row, k in zip(h.requests, report.emitted.tolist(), report.take.tolist()):
            req.output += row[:k]
            req.seq_len += k
        self._finish_rows(finished, state)
        self._guard.broken = None
        return StepStats(report.accept_len.tolist(), int(report.take.sum()))

    def _check_ranks(self, report: StepReport) -> None:
        """RuntimeError, before any bookkeeping, when the tensor-parallel ranks accepted different
        tokens this step (SpecConfig.check_ranks); every rank raises alike."""
        emitted = torch.as_tensor(report.emitted.astype(np.int64))
        take = torch.as_tensor(report.take.astype(np.int64))
        kept = torch.where(torch.arange(emitted.shape[1])[None] < take[:, None], emitted, -1)
        digest = torch.tensor([hash(tuple(kept.flatten().tolist()))], dtype=torch.int64, device=self.device)
        if not self.parallel.same_on_all_ranks(digest):
            raise RuntimeError(f"tensor-parallel rank {self.parallel.rank} of {self.parallel.size}: the ranks accepted "
                               "different tokens this step (a rank-dependent result: a bug or a non-deterministic "
                               "kernel); the step is not committed")

    @on_device
    @exclusive
    @torch.inference_mode()
    def abort(self, requests: list[Request]) -> None:
        """Stop running ``requests`` now (e.g. to free pages for others): they leave the batch as
        finished, with the tokens emitted so far, and their KV pages and rows return to the pools.
        Requests already finished are left as they are. Not while a step is in flight."""
        self.check_idle("abort")
        requests = item_list(requests, "abort takes a list of the Requests add_requests returned: abort([request])")
        for r in requests:  # else an engine aborting by id, or with a copy, frees nothing and hears nothing
            if self._issued.get(id(r)) is not r:
                raise ValueError(f"abort: {type(r).__name__} {r if not isinstance(r, Request) else r.rid} is not a "
                                 "Request this worker's add_requests returned (pass those objects, not ids or copies)")
        stop = {id(r) for r in requests}
        rows = [i for i, r in enumerate(self.requests) if id(r) in stop]
        state = self._state_without(rows)
        self._guard.broken = "abort"  # a page release that fails leaves earlier ones done
        self._finish_rows(rows, state)
        self._guard.broken = None

    @on_device
    @exclusive
    @torch.inference_mode()
    def reset(self) -> None:
        """Abort every request (running, or half admitted by an interrupted call) and return every
        page and row: the recovery from a call interrupted between two of its state changes, which
        every other call then refuses. Requests keep the tokens emitted so far; finished ones and
        new ones are as after abort. A step in flight is waited for and dropped."""
        if self._in_flight is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # its kernels read the pools' tables
        for req in list(self._issued.values()):
            req.finished = True
            req.target_row = req.draft_row = -1
        self.target_pool.reset()
        self.draft_pool.reset()
        self._requests, self.state, self.last_tree, self._batch, self._in_flight = (), None, None, None, None
        self.spec_step.host_copy.release()
        self._guard.broken = None

    def _state_without(self, rows: list[int]) -> Optional[DecodeState]:
        """The device state of the running requests but those at ``rows`` (None: none stay; the
        state itself when none leave). Device work that may fail (out of memory): callers get it
        before they change anything."""
        if not rows:
            return self.state
        leaving = set(rows)
        keep = [i for i in range(len(self.requests)) if i not in leaving]
        return self.state.select(host_to_device(keep, self.device)) if keep else None

    def _finish_rows(self, rows: list[int], state: Optional[DecodeState]) -> None:
        """The running requests at ``rows`` finish: their pages and rows return, and the batch
        keeps the others, whose device state is ``state`` (_state_without(rows))."""
        if not rows:
            return
        for i in rows:
            self._requests[i].finished = True
            self.pages.release(self._requests[i])
        leaving = set(rows)
        self._requests = tuple(r for i, r in enumerate(self._requests) if i not in leaving)
        self.state = state
        self._batch = None

    def _batch_host(self) -> BatchHost:
        if self._batch is None:
            self._batch = BatchHost.of(self.requests, self.device)
            self._batch.room = self.pages.room(self._batch)
        return self._batch
