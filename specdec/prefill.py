"""Prefill: new requests' prompts through the target, then the draft, in passes of at most
max_prefill_tokens tokens (chunked prefill: each piece attends to the kv cached before it).

A prompt's last pass also samples its first token (as a verify would: target_probs and the
request's stream at draw -1) and the draft's first candidates, which start its DecodeState.
"""

from __future__ import annotations

from typing import Optional

import torch

from specdec.accept import target_probs
from specdec.batch import extend_pass, prefill_cap, prefill_pieces, run_pass
from specdec.config import SpecConfig
from specdec.kv import MLAKVPool
from specdec.sampling import hash_uniform, sample_from
from specdec.state import DecodeState, Request
from specdec.tree import topk_probs


class Prefill:
    """The prefill passes of a worker: its models, pools and prefill backends (target, draft)."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module, config: SpecConfig,
                 pools: tuple[MLAKVPool, MLAKVPool], target_backend, draft_backend, dtype: torch.dtype) -> None:
        self.target, self.draft, self.config = target, draft, config
        self.target_pool, self.draft_pool = pools
        self.target_backend, self.draft_backend = target_backend, draft_backend
        self.dtype = dtype
        self.draft_offset = config.draft_offset

    def run(self, new: list[Request]) -> DecodeState:
        """Prefill every prompt of ``new`` (their pages taken): the DecodeState of all of them, in
        new's order (every prompt ends in one pass, in order)."""
        ended = (self._pass(pieces) for pieces in self.passes(new))
        return DecodeState.concat([state for state in ended if state is not None])

    def passes(self, new: list[Request]) -> list[list[tuple[Request, int, int]]]:
        """new's prompts in passes of at most max_prefill_tokens tokens (the config's, or fewer
        where a prefill backend takes fewer): (request, start, length) pieces
        (specdec.batch.prefill_pieces); the draft's pass is the longer, by draft_offset a finished
        prompt."""
        cap = prefill_cap(self.config.max_prefill_tokens, [self.target_backend, self.draft_backend])
        cuts = prefill_pieces([len(r.prompt) for r in new], cap, self.draft_offset)
        return [[(new[i], start, n) for i, start, n in pieces] for pieces in cuts]

    def _pass(self, pieces: list[tuple[Request, int, int]]) -> Optional[DecodeState]:
        """One prefill pass over prompt pieces ``(request, start, length)``, the kv before each
        start already cached: target pass; for the requests whose prompt ends here, the first token
        (sampled as a verify would); draft pass; their first draft candidates. Returns their
        DecodeState (None when no prompt ends in this pass)."""
        dev, off = self.target_pool.device, self.draft_offset
        starts = [s for _, s, _ in pieces]
        batch, ids, positions = extend_pass(self.target_pool.req_to_token, [r.target_row for r, _, _ in pieces], starts,
                                            [r.prompt[s:s + n] for r, s, n in pieces])
        hidden = run_pass(self.target, self.target_backend, batch, ids, positions)
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
        dhidden = run_pass(self.draft, self.draft_backend, dbatch, draft_ids, dpositions,
                                hidden if off == 0 else None)
        if not done:
            return None
        dlast = dbatch.cu_seqlens_q[1:].long()[ending] - 1
        cand = topk_probs(self.draft.compute_logits(dhidden[dlast]), self.config.topk, params[0])
        seq_lens = torch.tensor([len(r.prompt) for r in done], device=dev)
        stops = torch.tensor([[len(r.prompt) + r.max_new_tokens - 1 for r in done],
                              [-1 if r.eos_token_id is None else r.eos_token_id for r in done]], device=dev)
        return DecodeState(root, seq_lens, dhidden[dlast], *cand, *params, torch.ones_like(params[3]), *stops.unbind(0))
