"""The spec step: draft -> tree -> verify -> accept -> commit KV -> host copy -> draft-extend.

:class:`SpecStep` holds what a step runs on (models, pools, backends) and its methods appear in
the order they run. Conventions: a request's target has KV for positions ``[0, N)``; its root
token t_N (the last emitted) is not yet cached. The EAGLE draft processes t_{p+1} with the target
hidden state h_p at draft position p, so its cache covers ``[0, N)`` too; a standalone draft
processes t_p at position p and covers ``[0, N]``: ``draft_offset`` (0 or 1) is that shift.

Nothing in a step reads a device value on the host. The emitted tokens, accept lengths and stops
reach the host in one non-blocking copy (:class:`StepReport`) enqueued before draft-extend, so
the host's bookkeeping overlaps that last pass. The graph runner captures the step's three
stages in order into one graph: ``draft``, ``verify_and_accept`` (with the copy) and
``draft_extend``; a kv bound (a bound on N the passes plan their kernels for) is an argument of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from attn.base import ForwardMode
from attn.multistep import MultiStepDraftBackend
from specdec.accept import (AcceptResult, chain_accept, greedy_accept, stop_at_limits, target_probs,
                            tree_rejection_sample)
from specdec.batch import run_pass, uniform_batch
from specdec.config import SpecConfig
from specdec.kv import PADDING_ROW, MLAKVPool
from specdec.state import DecodeState, HostCopy
from specdec.step_kernels import chain_report, next_counts, row_of_each, serves_chain_report
from specdec.tree import VerifyTree, candidates, head_logits, start_tree

KV_BOUND_GAP = 64  # kv rows within which SpecStep.kv_len_buckets keeps one bound


@dataclass
class StepReport:
    """What a step sends the host, one int64 row a request: ``[emitted (num_steps + 1) |
    accept_len | take | done]``. E.g. num_steps 3, two drafts accepted, eos at the bonus:
    ``[11, 12, 2, -1 | 2 | 3 | 1]``. take: how many leading emitted tokens join the output.

    emitted ``[B, num_steps + 1]``, accept_len / take / done ``[B]``: views of the packed rows."""

    emitted: np.ndarray
    accept_len: np.ndarray
    take: np.ndarray
    done: np.ndarray

    @staticmethod
    def width(num_steps: int) -> int:
        return num_steps + 4

    @staticmethod
    def pack(result: AcceptResult, take: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """``[B, num_steps + 4]`` int64 on the device."""
        return torch.cat([result.emitted, result.accept_len[:, None], take[:, None], done[:, None]], dim=1)

    @staticmethod
    def unpack(packed: np.ndarray) -> "StepReport":
        return StepReport(packed[:, :-3], *packed[:, -3:].T)


class SpecStep:
    """One spec-decode iteration over a batch, device work only.

    target / draft: the models; pools: the target's and the draft's MLAKVPool; verify_backend,
    draft_backend (one backend per draft step), draft_extend_backend: the passes' attention;
    host_copy: the pinned buffer ``[max_bs, StepReport.width(num_steps)]`` the report lands in.
    Inputs of every stage: st (DecodeState ``[B]``), rows (pool rows ``[B]`` int64) and kv_bound
    (None, or a bound on N every request of the batch keeps)."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module, config: SpecConfig,
                 pools: tuple[MLAKVPool, MLAKVPool], verify_backend, draft_backend: MultiStepDraftBackend,
                 draft_extend_backend, host_copy: HostCopy) -> None:
        self.target, self.draft_model, self.config = target, draft, config
        self.target_pool, self.draft_pool = pools
        self.verify_backend, self.draft_backend, self.draft_extend_backend = verify_backend, draft_backend, draft_extend_backend
        self.host_copy = host_copy
        self.device = self.target_pool.device
        self.draft_offset = config.draft_offset

    @torch.inference_mode()
    def run(self, st: DecodeState, target_rows: torch.Tensor, draft_rows: torch.Tensor,
            kv_bound: Optional[int] = None) -> tuple[AcceptResult, DecodeState, VerifyTree]:
        """The whole step, eagerly: (accept result, next state, verify tree)."""
        tree = self.draft(st, draft_rows, kv_bound)
        result, hidden = self.verify_and_accept(st, tree, target_rows, kv_bound)
        return result, self.draft_extend(st, result, hidden, draft_rows, kv_bound), tree

    def draft(self, st: DecodeState, rows: torch.Tensor, kv_bound: Optional[int] = None) -> VerifyTree:
        """num_steps - 1 draft forwards from the first candidates, then the verify tree, its mask
        written into the verify backend's buffer.

        Forward j feeds the ``topk`` frontier tokens (depth j) at draft position N + off + j - 1,
        stores their KV at draft kv index N + off + (j - 1) * topk + f and, for topk > 1, attends
        to the prefix plus the frontier's ancestors through a tree mask.
        """
        cfg, off = self.config, self.draft_offset
        topk, bs = cfg.topk, st.root.shape[0]
        tree = start_tree(st.cand_probs, st.cand_ids)
        passes = [
            uniform_batch(ForwardMode.DECODE, self.draft_pool.req_to_token, rows, st.seq_lens, topk,
                          off + (j - 1) * topk, None if topk == 1 else mask[:bs], _bound(kv_bound, off + j * topk))
            for j, mask in zip(range(1, cfg.num_steps), self.draft_backend.tree_masks())
        ]
        batches = [batch for batch, _ in passes]
        if batches:
            self.draft_backend.init_forward_metadata(batches)
        temperature = self._temperatures(st, topk)
        hidden = st.hidden[:, None, :].expand(-1, topk, -1)
        if topk > 1:
            eye = torch.eye(topk, dtype=torch.bool, device=self.device).expand(bs, -1, -1)
            ancestors = eye[:, :, :0]  # [B, topk, j * topk]: which drafted kv rows each frontier node sees
        for j, ((batch, kv_index), backend) in enumerate(zip(passes, self.draft_backend.steps), start=1):
            if topk > 1:  # each frontier node continues its parent's hidden state and sees its ancestors
                parent_slot = tree.frontier_parent[:, :, None]
                if j > 1:
                    ancestors = ancestors.gather(1, parent_slot.expand(-1, -1, ancestors.shape[2]))
                    hidden = hidden.gather(1, parent_slot.expand(-1, -1, hidden.shape[2]))
                ancestors = torch.cat([ancestors, eye], dim=2)
                batch.custom_mask.copy_(ancestors)
            # a chain's token sits at its position; a tree's topk frontier nodes share theirs
            positions = kv_index if topk == 1 else (st.seq_lens + (off + j - 1))[:, None].expand(-1, topk).flatten()
            out = self.draft_model(tree.frontier_tokens.flatten(), positions, hidden.flatten(0, 1), backend, batch)
            probs, ids = candidates(self.draft_model, out, topk, temperature)
            hidden = out.view(bs, topk, -1)
            tree.grow(probs.view(bs, topk, topk), ids.view(bs, topk, topk))
        mask_buf = self.verify_backend.get_verify_buffers_to_fill_after_draft()[0]
        return tree.build(st.root, cfg.num_draft_tokens, cfg.num_steps, mask_buf)

    def verify_and_accept(self, st: DecodeState, tree: VerifyTree, rows: torch.Tensor,
                          kv_bound: Optional[int] = None) -> tuple[AcceptResult, torch.Tensor]:
        """verify -> accept -> commit KV -> host copy. Returns the accept result and the target's
        hidden states ``[B, ndt, D]`` (draft-extend's input)."""
        logits, hidden, pick = self.verify(st, tree, rows, kv_bound)
        result, report = self.accept(st, tree, logits, pick)
        self.commit_kv(st, result, rows)
        self.host_copy.enqueue(report)
        return result, hidden

    def verify(self, st: DecodeState, tree: VerifyTree, rows: torch.Tensor,
               kv_bound: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[object]]:
        """Target forward over the tree at kv indices N..N+ndt-1. Returns (logits ``[B, ndt, V]``
        fp32, hidden ``[B, ndt, D]``, the head's greedy picks of the ``B * ndt`` rows or None:
        tree.head_logits, asked for when sampling is off)."""
        ndt = self.config.num_draft_tokens
        mask = tree.mask if self.config.topk > 1 else None
        batch, kv_index = uniform_batch(ForwardMode.TARGET_VERIFY, self.target_pool.req_to_token, rows, st.seq_lens,
                                        ndt, 0, mask, _bound(kv_bound, ndt))
        # a chain's node i sits at depth i; a tree's at its depth
        positions = kv_index if self.config.topk == 1 else (st.seq_lens[:, None] + tree.depth).flatten()
        hidden = run_pass(self.target, self.verify_backend, batch, tree.tokens.flatten(), positions)
        logits, pick = head_logits(self.target, hidden, not self.config.enable_sampling)
        return logits.view(-1, ndt, logits.shape[-1]), hidden.view(-1, ndt, hidden.shape[-1]), pick

    def accept(self, st: DecodeState, tree: VerifyTree, logits: torch.Tensor,
               pick: Optional[object] = None) -> tuple[AcceptResult, torch.Tensor]:
        """Greedy verification, or tree rejection sampling when sampling is enabled (greedy rows
        reduce to the same result there); with the StepReport the host gets (packed, on the
        device). A greedy chain on a GPU takes both from one kernel (step_kernels.chain_report).
        pick: the head's greedy picks of the logits' rows (verify), which give the argmax."""
        steps = self.config.num_steps
        if not self.config.enable_sampling:
            pred = logits.argmax(-1) if pick is None else pick.argmax().view(logits.shape[:2])
            if self.config.topk == 1 and serves_chain_report(tree.tokens, pred):
                return chain_report(tree.tokens, pred, st.seq_lens, st.limit, st.eos)
            result = (chain_accept if self.config.topk == 1 else greedy_accept)(tree, pred, steps)
        else:
            ndt = logits.shape[1]
            per_node = [t.repeat_interleave(ndt) for t in (st.temperature, st.top_p, st.top_k)]
            probs = target_probs(logits.flatten(0, 1), *per_node).view(logits.shape)
            result = tree_rejection_sample(tree, probs, st.seed, st.counter, steps, max_children=self.config.topk)
        take, done = stop_at_limits(result, st.seq_lens, st.limit, st.eos)
        return result, StepReport.pack(result, take, done)

    def commit_kv(self, st: DecodeState, result: AcceptResult, rows: torch.Tensor) -> None:
        """Move the accepted path's KV rows (and a sparse target's indexer keys) to kv indices
        N..N+accept_len (trees only: a chain is in place)."""
        if self.config.topk == 1:
            return
        r2t = self.target_pool.req_to_token
        # accept_len < num_draft_tokens: the path's columns past that repeat its last node and
        # would land past the request's pages (N + num_draft_tokens) where that is < num_steps + 1.
        width = min(result.path.shape[1], self.config.num_draft_tokens)
        steps = torch.arange(width, device=self.device)
        src = r2t[rows[:, None], st.seq_lens[:, None] + result.path[:, :width]].flatten().long()
        dst = r2t[rows[:, None], st.seq_lens[:, None] + steps].flatten().long()
        self.target_pool.copy_slots(src, dst)  # (a sparse target's indexer keys move with their rows)

    def draft_extend(self, st: DecodeState, result: AcceptResult, verify_hidden: torch.Tensor, rows: torch.Tensor,
                     kv_bound: Optional[int] = None) -> DecodeState:
        """Draft over the accepted tokens + bonus (num_steps + 1 rows per request, the first
        accept_len + 1 real); returns the next state (root, N, draft hidden, first candidates).
        A request on the pools' PADDING_ROW (a graph bucket's padding: no request owns that row)
        stays at N = 0."""
        q_len = self.config.num_steps + 1
        # the rows sit at draft positions N + draft_offset + [0, q_len): their kv indices
        batch, positions = uniform_batch(ForwardMode.DRAFT_EXTEND, self.draft_pool.req_to_token, rows, st.seq_lens,
                                         q_len, self.draft_offset, max_kv_len=_bound(kv_bound, self.draft_offset + q_len))
        ids = result.emitted.clamp(min=0) if result.extend_ids is None else result.extend_ids
        # A chain's accepted path is nodes 0..accept_len in order, and the rows past it are never
        # read (the next draft overwrites their KV first), so the verify hidden states serve as is.
        hidden_in = verify_hidden
        if self.config.topk > 1:
            hidden_in = verify_hidden.gather(1, result.path[:, :, None].expand(-1, -1, verify_hidden.shape[-1]))
        out = run_pass(self.draft_model, self.draft_extend_backend, batch, ids.flatten(), positions,
                       hidden_in.flatten(0, 1))
        last = row_of_each(out, q_len, result.accept_len)
        cand = candidates(self.draft_model, last, self.config.topk, self._temperatures(st, 1))
        seq_lens, counter = next_counts(st.seq_lens, result.accept_len, st.counter, rows, PADDING_ROW)
        return st.advance(result.bonus, seq_lens, last, cand, counter)

    def _temperatures(self, st: DecodeState, repeat: int) -> Optional[torch.Tensor]:
        """Each request's temperature repeated per drafted row, or None (plain softmax) when
        sampling is off and every temperature is 0."""
        if not self.config.enable_sampling:
            return None
        return st.temperature if repeat == 1 else st.temperature.repeat_interleave(repeat)

    # ------------------------------------------------ what the graph runner captures through
    @property
    def backends(self) -> list:
        """Every backend a step's passes run on (verify, draft-extend, each draft step)."""
        return [self.verify_backend, self.draft_extend_backend, *self.draft_backend.steps]

    def state_template(self, batch_size: int) -> DecodeState:
        """An uninitialised DecodeState of ``batch_size`` rows, hidden states as the draft gives
        them: the graph runner's static inputs."""
        return DecodeState.empty(batch_size, self.config.topk, self.draft_model.hidden_size,
                                 next(self.draft_model.parameters()).dtype, self.device)

    def pass_shapes(self) -> list[tuple[object, int, int]]:
        """(backend, extra kv rows, query tokens) of every pass of a step, in order: a pass over a
        request of length N attends N + extra kv rows, as draft / verify / draft_extend build it."""
        cfg, off = self.config, self.draft_offset
        shapes = [(backend, off + j * cfg.topk, cfg.topk) for j, backend in enumerate(self.draft_backend.steps, start=1)]
        shapes += [(self.verify_backend, cfg.num_draft_tokens, cfg.num_draft_tokens),
                   (self.draft_extend_backend, off + cfg.num_steps + 1, cfg.num_steps + 1)]
        return shapes

    def kv_len_buckets(self, batch_size: int) -> list[int]:
        """Bounds on N (ascending) up to which some pass of a step over ``batch_size`` requests
        launches another kernel plan than for the longest context (its backend's kv_len_bounds):
        a graph of the step per bound serves the batches whose requests are all that short. Of
        bounds within KV_BOUND_GAP rows of each other only the smallest. E.g. a verify bound of
        100 kv rows at ndt 6 and draft bounds 97 - 2 and 97 - 4 on N: [93] (not [93, 94, 95])."""
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


def _bound(kv_bound: Optional[int], extra: int) -> Optional[int]:
    """A pass's AttnBatch.max_kv_len under a bound on N: N + extra kv rows (None: no bound)."""
    return None if kv_bound is None else kv_bound + extra
