"""EagleWorker: the spec-decode step. draft -> build tree -> verify -> accept -> draft-extend.

Conventions. A request's target has KV for positions ``[0, N)``; its root token t_N (the last
emitted token) is not yet in the target's cache. The EAGLE draft processes token t_{p+1} with the
target hidden state h_p at draft position p, so its cache covers ``[0, N)`` too; a standalone
draft processes t_p at position p and covers ``[0, N]``. ``draft_offset`` (0 or 1) is that shift.
Inside a step nothing reads a device value on the host; the emitted tokens, accept lengths and
stops reach the host by one non-blocking copy enqueued before draft-extend, and the host's
bookkeeping overlaps that last pass.
"""

from __future__ import annotations

import copy
import weakref
from typing import Optional

import numpy as np
import torch

from attn.base import KV_DTYPES, AttnBatch, ForwardMode, const_arange
from attn.multistep import MultiStepDraftBackend
from attn.paged import rows as cache_rows
from attn.registry import check_device, check_kv_dtype
from specdec.batch import extend_pass, host_to_device, prefill_cap, prefill_pieces, uniform_batch
from specdec.config import ConfigError, SpecConfig, int_list, item_list, require_int
from specdec.device import on_device
from specdec.draft import DraftModel, TargetModel, check_draft, check_target
from specdec.kv import MLAKVPool, OutOfPagesError
from specdec.models import validate_token_ids
from specdec.pages import BatchPages
from specdec.sampling import SamplingParams, hash_uniform, sample_from, target_probs, tree_rejection_sample, with_seeds
from specdec.state import BatchHost, DecodeState, HostCopy, Request, StepStats, last_step_n
from specdec.tree import VerifyTree, start_tree, topk_probs
from specdec.verify import AcceptResult, chain_accept, greedy_accept, stop_at_limits


KV_BOUND_GAP = 64  # kv rows within which EagleWorker.kv_len_buckets keeps one bound


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
        self.draft_offset = 0 if config.draft_mode == "eagle" else 1
        choice = config.backends
        try:
            check_device(choice, self.device)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        kv_dtype = self.dtype if config.kv_dtype == "auto" else KV_DTYPES[config.kv_dtype]
        if config.kv_dtype == "auto":  # the model's dtype must suit the backends as a named one would
            name = next((n for n, d in KV_DTYPES.items() if d == kv_dtype), str(kv_dtype))
            try:
                check_kv_dtype(choice, name)
            except ValueError as err:
                raise ConfigError(f"kv_dtype='auto' is the model's dtype, {name}: {err}") from None

        def pool(num_layers: int) -> MLAKVPool:
            return MLAKVPool(num_layers, config.pool_pages, config.page_size, config.max_batch_size,
                             config.max_context_len, kv_dtype, self.device, config.kv_scale)

        self.target_pool, self.draft_pool = pool(target.num_attention_layers), pool(draft.num_attention_layers)
        self.pages = BatchPages(self.target_pool, self.draft_pool, config.num_draft_tokens, self.draft_offset,
                                config.draft_region_len)
        classes = choice.classes()
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
        self.requests: list[Request] = []
        self.state: Optional[DecodeState] = None
        self.last_tree: Optional[VerifyTree] = None  # the last step's, until the next (views of the backend's/graphs' buffers)
        self.graph_runner = None  # set by graphs.runner.GraphRunner(worker)
        # A bound on N the step's passes plan their kernels for (AttnBatch.max_kv_len: N + the pass's
        # extra kv rows); the graph runner sets it while it captures a kv bucket's step. None: none.
        self.kv_len_bound: Optional[int] = None
        self._next_rid = 0
        self._issued: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> Request add_requests returned
        self._batch: Optional[BatchHost] = None  # host arrays of the running batch; None: rebuild
        # the step's one copy to the host: [bs, num_steps + 4] = emitted tokens, accept_len, take, done
        self._emitted = HostCopy((bs, steps + 4), self.device)
        self._in_flight: Optional[AcceptResult] = None  # launch_step's result until finish_step takes it

    # ------------------------------------------------------------ admission
    @on_device
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
        cfg = self.config
        max_new_tokens = require_int(max_new_tokens, "max_new_tokens must be an int")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (the prefill emits the first token), got {max_new_tokens}")
        vocab = self.target.config.vocab_size
        if eos_token_id is not None:
            eos_token_id = require_int(eos_token_id, "eos_token_id must be one int or None")
            validate_token_ids([eos_token_id], vocab, "eos_token_id")
        prompts = item_list(prompts, "prompts must be a list of token-id lists, one per request")
        if not prompts:
            return []
        sampling = ([SamplingParams()] * len(prompts) if sampling is None
                    else item_list(sampling, "sampling must be a list of SamplingParams, one per prompt"))
        if len(sampling) != len(prompts):
            raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
        for i, params in enumerate(sampling):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling[{i}] must be a SamplingParams, got {type(params).__name__}")
        sampling = with_seeds(sampling)
        if not cfg.enable_sampling and any(p.temperature > 0 for p in sampling):
            raise ValueError("temperature > 0 needs SpecConfig(enable_sampling=True) (rejection-sampling verification)")
        if len(self.requests) + len(prompts) > cfg.max_batch_size:
            raise ValueError(f"{len(self.requests)} running + {len(prompts)} new requests exceed max_batch_size {cfg.max_batch_size}")
        prompts = [int_list(prompt, "each prompt must be a list of token ids (ints)") for prompt in prompts]
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompts[{i}] is empty: a request needs at least one token")
            validate_token_ids(prompt, vocab, f"prompts[{i}]'s token ids")
            # One new token comes from the prefill (the draft's pool also holds it when standalone);
            # more take spec steps, which need the headroom.
            need = len(prompt) + (max_new_tokens + cfg.spec_headroom if max_new_tokens > 1 else self.draft_offset)
            if need > cfg.max_context_len:
                headroom = f" + {cfg.spec_headroom} spec headroom" if max_new_tokens > 1 else ""
                raise ValueError(
                    f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens}{headroom} exceed max_context_len "
                    f"{cfg.max_context_len}; raise max_context_len or shorten the request"
                )
            self.pages.check_fits(len(prompt), max_new_tokens)
        try:
            new = self._allocate(prompts, max_new_tokens, eos_token_id, sampling)
        except OutOfPagesError:
            new = None
        if new is None:  # (outside the except: trim_for's own error is the one to show)
            # The running requests' grow-ahead pages come back first, as they do for a growing request.
            self.pages.trim_for(self._batch_host(), [len(p) for p in prompts], max_new_tokens)
            new = self._allocate(prompts, max_new_tokens, eos_token_id, sampling)
        try:
            # Every prompt ends in one pass, in order: the states concatenate in new's order.
            ended = (self._prefill(pieces) for pieces in self._prefill_passes(new))
            new_state = DecodeState.concat([state for state in ended if state is not None])
            first = HostCopy(new_state.root.shape, self.device).fetch(new_state.root).tolist()
            keep = [i for i, token in enumerate(first) if not (max_new_tokens <= 1 or token == eos_token_id)]
            if keep:
                new_state = new_state.select(torch.tensor(keep, device=self.device))
                state = new_state if self.state is None else DecodeState.concat([self.state, new_state])
        except BaseException:
            for req in new:
                self.pages.release(req)
            raise
        self._next_rid += len(new)
        self._issued.update((id(req), req) for req in new)
        for i, (req, token) in enumerate(zip(new, first)):
            req.output.append(token)  # the prefill's token is the first output
            if i not in keep:
                req.finished = True
                self.pages.release(req)
        if keep:
            self.state = state
            self.requests.extend(new[i] for i in keep)
            self._batch = None
        return new

    def _allocate(self, prompts: list[list[int]], max_new_tokens: int, eos: Optional[int], sampling: list[SamplingParams]) -> list[Request]:
        new: list[Request] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, sampling)):
                # Ids are taken once add_requests succeeds: a refused or failed admission uses none.
                req = Request(self._next_rid + i, list(prompt), max_new_tokens, eos, self.target_pool.alloc_request(), -1,
                              params, seq_len=len(prompt), last_n=last_step_n(len(prompt), max_new_tokens))
                new.append(req)
                req.draft_row = self.draft_pool.alloc_request()
                self.pages.take((req.target_row, req.draft_row), len(prompt), max_new_tokens)
        except BaseException:
            for req in new:
                self.pages.release(req)
            raise
        return new

    def _prefill_passes(self, new: list[Request]) -> list[list[tuple[Request, int, int]]]:
        """new's prompts in passes of at most max_prefill_tokens tokens (the config's, or fewer
        where a prefill backend takes fewer): (request, start, length) pieces
        (specdec.batch.prefill_pieces); the draft's pass is the longer, by draft_offset a finished
        prompt."""
        cap = prefill_cap(self.config.max_prefill_tokens, [self.target_prefill_backend, self.draft_prefill_backend])
        cuts = prefill_pieces([len(r.prompt) for r in new], cap, self.draft_offset)
        return [[(new[i], start, n) for i, start, n in pieces] for pieces in cuts]

    def _prefill(self, pieces: list[tuple[Request, int, int]]) -> Optional[DecodeState]:
        """One prefill pass over prompt pieces ``(request, start, length)``, the kv before each
        start already cached: target pass; for the requests whose prompt ends here, the first token
        (sampled as a verify would); draft pass; their first draft candidates. Returns their
        DecodeState (None when no prompt ends in this pass)."""
        dev, off = self.device, self.draft_offset
        starts = [s for _, s, _ in pieces]
        batch, ids, positions = extend_pass(self.target_pool.req_to_token, [r.target_row for r, _, _ in pieces], starts,
                                            [r.prompt[s:s + n] for r, s, n in pieces])
        hidden = self._forward(self.target, self.target_prefill_backend, batch, ids, positions)
        if hidden.dtype != self.dtype or hidden.dim() != 2 or hidden.shape[0] != ids.shape[0]:
            raise ValueError(f"the target's forward returned {tuple(hidden.shape)} {hidden.dtype} for {ids.shape[0]} "
                             f"tokens; it must return [tokens, D] in its parameters' dtype ({self.dtype}): TargetModel")
        ending = [k for k, (r, s, n) in enumerate(pieces) if s + n == len(r.prompt)]
        done = [pieces[k][0] for k in ending]
        if done:
            last = batch.cu_seqlens_q[1:].long()[ending] - 1
            params = DecodeState.sampling_tensors(done, dev)
            logits = self.target.compute_logits(hidden[last])
            if logits.shape != (len(done), self.target.config.vocab_size):
                raise ValueError(f"the target's compute_logits returned {tuple(logits.shape)} for {len(done)} rows; "
                                 f"it must return [rows, config.vocab_size={self.target.config.vocab_size}]")
            probs = target_probs(logits, *params[:3])
            root = sample_from(probs, hash_uniform(params[3], torch.zeros_like(params[3]), -1))

        # The draft sees (prompt + [root])[1 - off:] at positions 0..: a piece's draft tokens are
        # (prompt + [root])[s + 1 - off : s + n + 1 - off], plus the root after a standalone
        # draft's last piece. Every root slot is known on the host.
        tokens, root_slots, packed = [], [], 0
        for k, (r, s, n) in enumerate(pieces):
            piece = r.prompt[s + 1 - off:s + 1 - off + n]
            if k in ending:  # the piece ends the prompt: its last draft token is the root
                piece = piece + [0]
                root_slots.append(packed + len(piece) - 1)
            tokens.append(piece)
            packed += len(piece)
        dbatch, draft_ids, dpositions = extend_pass(self.draft_pool.req_to_token, [r.draft_row for r, _, _ in pieces],
                                                    starts, tokens)
        if done:
            draft_ids[torch.tensor(root_slots, device=dev)] = root
        dhidden = self._forward(self.draft, self.draft_prefill_backend, dbatch, draft_ids, dpositions,
                                hidden if off == 0 else None)
        if not done:
            return None
        dlast = dbatch.cu_seqlens_q[1:].long()[ending] - 1
        cand = topk_probs(self.draft.compute_logits(dhidden[dlast]), self.config.topk, params[0])
        seq_lens = torch.tensor([len(r.prompt) for r in done], device=dev)
        stops = torch.tensor([[len(r.prompt) + r.max_new_tokens - 1 for r in done],
                              [-1 if r.eos_token_id is None else r.eos_token_id for r in done]], device=dev)
        return DecodeState(root, seq_lens, dhidden[dlast], *cand, *params, torch.ones_like(params[3]), *stops.unbind(0))

    @staticmethod
    def _forward(model: torch.nn.Module, backend, batch: AttnBatch, *inputs: Optional[torch.Tensor]) -> torch.Tensor:
        """Build the pass's attention metadata, then run ``model(*inputs, backend, batch)``."""
        backend.init_forward_metadata(batch)
        return model(*inputs, backend, batch)

    # ----------------------------------------------------------------- step
    def step(self) -> StepStats:
        """One spec-decode iteration over every running request; finished requests leave."""
        self.check_idle("step")
        return self.finish_step(self.launch_step())

    @on_device
    @torch.inference_mode()
    def launch_step(self) -> AcceptResult:
        """Reserve pages and enqueue the step's device work (graph replay or eager); no host sync."""
        self.check_idle("launch_step")
        if not self.requests:
            raise RuntimeError("no running requests: add_requests first")
        self._reserve_pages()
        st, target_rows, draft_rows = self.step_inputs()
        out = None
        if self.graph_runner is not None:
            out = self.graph_runner.run(st, target_rows, draft_rows)
        if out is None:
            out = self.spec_pass(st, target_rows, draft_rows)
        result, self.state, self.last_tree = out
        self._emitted.start(result.emitted.shape[0])
        self._in_flight = result
        return result

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

    def check_idle(self, call: str) -> None:
        """Refuse ``call`` while a step is in flight: its results apply to the batch it launched."""
        if self._in_flight is not None:
            raise RuntimeError(f"{call} while a step is in flight: finish_step(worker.in_flight) first")

    @on_device
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
        self._finish_rows(rows, self._state_without(rows))

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
            self.requests[i].finished = True
            self.pages.release(self.requests[i])
        leaving = set(rows)
        self.requests = [r for i, r in enumerate(self.requests) if i not in leaving]
        self.state = state
        self._batch = None

    def state_template(self, batch_size: int) -> DecodeState:
        """An (uninitialised) DecodeState of ``batch_size`` rows, hidden states as the draft gives
        them: the graph runner's static inputs."""
        return DecodeState.empty(batch_size, self.config.topk, self.draft.hidden_size,
                                 next(self.draft.parameters()).dtype, self.device)

    state_from = staticmethod(DecodeState.of)  # the graph runner's static inputs as a DecodeState

    def _batch_host(self) -> BatchHost:
        if self._batch is None:
            self._batch = BatchHost.of(self.requests, self.device)
            self._batch.room = self.pages.room(self._batch)
        return self._batch

    def step_inputs(self) -> tuple[DecodeState, torch.Tensor, torch.Tensor]:
        """(state, target rows ``[B]``, draft rows ``[B]``) of the running batch; the rows are
        built once per change of the batch (the same tensors while it runs unchanged)."""
        return self.state, *self._batch_host().device_rows

    def host_seq_lens(self, batch_size: int) -> torch.Tensor:
        """N of each running request, zero-padded to ``batch_size`` rows: ``[batch_size]`` int32 host."""
        lens = torch.zeros(batch_size, dtype=torch.int32)
        lens[: len(self.requests)] = torch.from_numpy(self._batch_host().seq_len)
        return lens

    def longest_seq_len(self) -> int:
        """The largest N of the running batch (host)."""
        return int(self._batch_host().seq_len.max())

    def pass_shapes(self) -> list[tuple[object, int, int]]:
        """(backend, extra kv rows, query tokens) of every pass of a step, in order: a pass over a
        request of length N attends N + extra kv rows, as draft_tree / verify / draft_extend build it."""
        cfg, off = self.config, self.draft_offset
        shapes = [(backend, off + j * cfg.topk, cfg.topk) for j, backend in enumerate(self.draft_backend.steps, start=1)]
        shapes += [(self.verify_backend, cfg.num_draft_tokens, cfg.num_draft_tokens),
                   (self.draft_extend_backend, off + cfg.num_steps + 1, cfg.num_steps + 1)]
        return shapes

    def _max_kv_len(self, extra: int) -> Optional[int]:
        """The bound of a pass of N + extra kv rows under kv_len_bound (None: no bound)."""
        return None if self.kv_len_bound is None else self.kv_len_bound + extra

    def kv_len_buckets(self, batch_size: int) -> list[int]:
        """Bounds on N (ascending) up to which some pass of a step over ``batch_size`` requests
        launches another kernel plan than for the longest context (its backend's kv_len_bounds):
        a CUDA graph of the step per bound serves the batches whose requests are all that short.
        Of bounds within KV_BOUND_GAP rows of each other (one backend's bound seen by passes of
        different extra rows) only the smallest: the rest would each capture the step again for
        a few lengths more."""
        bounds = sorted({bound - extra for backend, extra, q_len in self.pass_shapes()
                         for bound in backend.kv_len_bounds(batch_size, q_len) if bound > extra})
        kept: list[int] = []
        for bound in bounds:
            if not kept or bound - kept[-1] > KV_BOUND_GAP:
                kept.append(bound)
        return kept

    def plan_passes_on_host(self, seq_lens: torch.Tensor) -> None:
        """Host planning of every pass of a step, for backends that plan on the host
        (``needs_cpu_seq_lens``) ahead of a graph replay. seq_lens: ``[bs]`` int32 host, the
        requests' N (pass_shapes: the kv lengths are N + extra)."""
        bs = seq_lens.shape[0]
        for backend, extra, q_len in self.pass_shapes():
            if backend.needs_cpu_seq_lens:
                backend.init_forward_metadata_replay_cuda_graph(bs, seq_lens + extra, q_len)

    @torch.inference_mode()
    def spec_pass(
        self, st: DecodeState, target_rows: torch.Tensor, draft_rows: torch.Tensor
    ) -> tuple[AcceptResult, DecodeState, VerifyTree]:
        """draft -> tree -> verify -> accept -> KV commit -> draft-extend; device work only.

        The emitted tokens, accept lengths and stops (``stop_at_limits``: eos, max_new_tokens) go
        to the host in one copy before draft-extend, so finish_step's host bookkeeping runs while the
        device still works on draft-extend. The graph runner captures its three parts
        (draft_tree, verify_and_accept with the copy and its event record, draft_extend) as
        three graphs."""
        tree = self.draft_tree(st, draft_rows)
        result, hidden = self.verify_and_accept(st, tree, target_rows)
        return result, self.draft_extend(st, result, hidden, draft_rows), tree

    def verify_and_accept(self, st: DecodeState, tree: VerifyTree, target_rows: torch.Tensor) -> tuple[AcceptResult, torch.Tensor]:
        """verify -> accept -> KV commit -> stops, and the host copy of their outputs enqueued.
        Returns the accept result and the target's hidden states ``[B, ndt, D]``."""
        logits, hidden = self.verify(st, tree, target_rows)
        result = self.accept(st, tree, logits)
        self.commit_kv(st, result, target_rows)
        take, done = stop_at_limits(result, st.seq_lens, st.limit, st.eos)
        self._emitted.enqueue(torch.cat([result.emitted, result.accept_len[:, None], take[:, None], done[:, None]], dim=1))
        return result, hidden

    def _reserve_pages(self) -> None:
        """Pages for every running request's next step (BatchPages.reserve)."""
        self.pages.reserve(self._batch_host())

    def draft_tree(self, st: DecodeState, rows: torch.Tensor) -> VerifyTree:
        """num_steps - 1 draft forwards from the first candidates; returns the verify tree.

        Forward j feeds the ``topk`` frontier tokens (depth j) at draft position N + off + j - 1,
        stores their KV at draft kv index N + off + (j - 1) * topk + f and, for topk > 1, attends
        to the prefix plus the frontier's ancestors through a tree mask.
        """
        cfg, off = self.config, self.draft_offset
        topk, bs = cfg.topk, st.root.shape[0]
        tree = start_tree(st.cand_probs, st.cand_ids)
        draft_len = st.seq_lens + off
        batches = [
            uniform_batch(ForwardMode.DECODE, self.draft_pool.req_to_token, rows, draft_len + (j - 1) * topk, topk,
                          draft_len + j * topk, None if topk == 1 else mask[:bs], self._max_kv_len(off + j * topk))
            for j, mask in zip(range(1, cfg.num_steps), self.draft_backend.tree_masks())
        ]
        if batches:
            self.draft_backend.init_forward_metadata(batches)
        temperature = self._temperatures(st, topk)
        hidden = st.hidden[:, None, :].expand(-1, topk, -1)
        if topk > 1:
            eye = torch.eye(topk, dtype=torch.bool, device=self.device).expand(bs, -1, -1)
            ancestors = eye[:, :, :0]  # [B, topk, j * topk]: which drafted kv rows each frontier node sees
        for j, (batch, backend) in enumerate(zip(batches, self.draft_backend.steps), start=1):
            if topk > 1:  # each frontier node continues its parent's hidden state and sees its ancestors
                parent_slot = tree.frontier_parent[:, :, None]
                if j > 1:
                    ancestors = ancestors.gather(1, parent_slot.expand(-1, -1, ancestors.shape[2]))
                    hidden = hidden.gather(1, parent_slot.expand(-1, -1, hidden.shape[2]))
                ancestors = torch.cat([ancestors, eye], dim=2)
                batch.custom_mask.copy_(ancestors)
            positions = (draft_len + j - 1)[:, None].expand(-1, topk).flatten()
            out = self.draft(tree.frontier_tokens.flatten(), positions, hidden.flatten(0, 1), backend, batch)
            probs, ids = topk_probs(self.draft.compute_logits(out), topk, temperature)
            hidden = out.view(bs, topk, -1)
            tree.grow(probs.view(bs, topk, topk), ids.view(bs, topk, topk))
        mask_buf = self.verify_backend.get_verify_buffers_to_fill_after_draft()[0]
        return tree.build(st.root, cfg.num_draft_tokens, cfg.num_steps, mask_buf)

    def verify(
        self, st: DecodeState, tree: VerifyTree, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward over the tree at kv indices N..N+ndt-1. Returns (logits ``[B, ndt, V]``
        fp32, hidden ``[B, ndt, D]``)."""
        ndt = self.config.num_draft_tokens
        mask = tree.mask if self.config.topk > 1 else None
        batch = uniform_batch(ForwardMode.TARGET_VERIFY, self.target_pool.req_to_token, rows,
                              st.seq_lens, ndt, st.seq_lens + ndt, mask, self._max_kv_len(ndt))
        positions = (st.seq_lens[:, None] + tree.depth).flatten()
        hidden = self._forward(self.target, self.verify_backend, batch, tree.tokens.flatten(), positions)
        logits = self.target.compute_logits(hidden)
        return logits.view(-1, ndt, logits.shape[-1]), hidden.view(-1, ndt, hidden.shape[-1])

    def accept(self, st: DecodeState, tree: VerifyTree, logits: torch.Tensor) -> AcceptResult:
        """Greedy verification, or tree rejection sampling when sampling is enabled (greedy rows
        reduce to the same result there)."""
        steps = self.config.num_steps
        if not self.config.enable_sampling:
            return (chain_accept if self.config.topk == 1 else greedy_accept)(tree, logits.argmax(-1), steps)
        ndt = logits.shape[1]
        per_node = [t.repeat_interleave(ndt) for t in (st.temperature, st.top_p, st.top_k)]
        probs = target_probs(logits.flatten(0, 1), *per_node).view(logits.shape)
        return tree_rejection_sample(tree, probs, st.seed, st.counter, steps, max_children=self.config.topk)

    def commit_kv(self, st: DecodeState, result: AcceptResult, rows: torch.Tensor) -> None:
        """Move the accepted path's KV rows to kv indices N..N+accept_len (trees only: a chain is in place)."""
        if self.config.topk == 1:
            return
        r2t = self.target_pool.req_to_token
        # accept_len < num_draft_tokens: the path's columns past that repeat its last node and
        # would land past the request's pages (N + num_draft_tokens) where that is < num_steps + 1.
        width = min(result.path.shape[1], self.config.num_draft_tokens)
        steps = torch.arange(width, device=self.device)
        src = r2t[rows[:, None], st.seq_lens[:, None] + result.path[:, :width]].flatten().long()
        dst = r2t[rows[:, None], st.seq_lens[:, None] + steps].flatten().long()
        for cache in self.target_pool.kv_buffers:
            flat = cache_rows(cache)
            flat.index_copy_(0, dst, flat[src])

    def draft_extend(
        self, st: DecodeState, result: AcceptResult, verify_hidden: torch.Tensor, rows: torch.Tensor
    ) -> DecodeState:
        """Draft over the accepted tokens + bonus (num_steps + 1 rows per request, the first
        accept_len + 1 real); returns the next state (root, N, draft hidden, first candidates)."""
        q_len = self.config.num_steps + 1
        draft_len = st.seq_lens + self.draft_offset
        batch = uniform_batch(ForwardMode.DRAFT_EXTEND, self.draft_pool.req_to_token, rows, draft_len, q_len,
                              draft_len + q_len, max_kv_len=self._max_kv_len(self.draft_offset + q_len))
        ids = result.emitted.clamp(min=0)
        positions = (draft_len[:, None] + const_arange(q_len, self.device)).flatten()
        # A chain's accepted path is nodes 0..accept_len in order, and the rows past it are never
        # read (the next draft overwrites their KV first), so the verify hidden states serve as is.
        hidden_in = verify_hidden
        if self.config.topk > 1:
            hidden_in = verify_hidden.gather(1, result.path[:, :, None].expand(-1, -1, verify_hidden.shape[-1]))
        out = self._forward(self.draft, self.draft_extend_backend, batch, ids.flatten(), positions, hidden_in.flatten(0, 1))
        dim = out.shape[-1]
        last = out.view(-1, q_len, dim).gather(1, result.accept_len[:, None, None].expand(-1, 1, dim)).squeeze(1)
        cand = topk_probs(self.draft.compute_logits(last), self.config.topk, self._temperatures(st, 1))
        return st.advance(result.bonus, st.seq_lens + result.accept_len + 1, last, cand)

    def _temperatures(self, st: DecodeState, repeat: int) -> Optional[torch.Tensor]:
        """Each request's temperature repeated per drafted row, or None (plain softmax) when
        sampling is off and every temperature is 0."""
        if not self.config.enable_sampling:
            return None
        return st.temperature if repeat == 1 else st.temperature.repeat_interleave(repeat)

    @on_device
    def finish_step(self, result: AcceptResult) -> StepStats:
        """Wait for the step's copy to the host (enqueued by launch_step, of ``result`` and its
        stops); then the host bookkeeping, and finished requests leave."""
        if self._in_flight is None:
            raise RuntimeError("finish_step: no step in flight (launch_step raised before launching one, or the "
                               "step was finished): nothing to finish; call launch_step or step")
        if result is not self._in_flight:
            raise RuntimeError("finish_step takes the result of the step in flight (what launch_step returned)")
        packed = self._emitted.wait()  # [B, num_steps + 4]: result.emitted, accept_len, take, done
        accept_len, take, done = packed[:, -3:].T
        finished = np.flatnonzero(done).tolist()
        # The step's one call that may fail (out of memory) comes before any change: a finish_step
        # that raised there or in the wait (an interrupt) may be called again.
        state = self._state_without(finished)
        self._emitted.release()
        self._in_flight = None
        h = self._batch_host()
        # N advances in the batch's array (the page checks') and in each request (what a rebuild of
        # the batch reads): all accept_len + 1 for each request that stays; only finishing ones are cut.
        h.seq_len += take
        for req, row, k in zip(h.requests, packed.tolist(), take.tolist()):
            req.output += row[:k]  # k <= num_steps + 1: emitted tokens only
            req.seq_len += k
        self._finish_rows(finished, state)
        return StepStats(accept_len.tolist(), int(take.sum()))
