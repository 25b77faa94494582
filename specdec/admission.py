"""Admission: what a new request must satisfy before anything changes, and what it takes.

A request is admitted when its arguments are well typed, its token ids in the vocabulary, prompt +
max_new_tokens + SpecConfig.spec_headroom (the tree's positions past the last step) fit
max_context_len and its last step's pages fit a pool; one of a single new token needs only its
prompt (a standalone draft's, one position more). Else ValueError naming what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from attn.values import int_list, item_list, require_int
from specdec.config import SpecConfig
from specdec.models import validate_token_ids
from specdec.pages import BatchPages
from specdec.sampling import SamplingParams, with_seeds
from specdec.state import Request, last_step_n


@dataclass
class NewRequests:
    """add_requests' arguments once checked: prompts as lists of ints, every request's sampling
    parameters with a seed."""

    prompts: list[list[int]]
    max_new_tokens: int
    eos_token_id: Optional[int]
    sampling: list[SamplingParams]


class Admission:
    """The checks and the allocation of a worker's new requests (its config, vocabulary, pages)."""

    def __init__(self, config: SpecConfig, vocab_size: int, pages: BatchPages, draft_offset: int) -> None:
        self.config, self.vocab_size, self.pages, self.draft_offset = config, vocab_size, pages, draft_offset

    def check(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: Optional[int],
              sampling: Optional[list[SamplingParams]], running: int) -> Optional[NewRequests]:
        """add_requests' arguments checked, ``running`` requests already in the batch; None when
        there are no prompts. Raises ValueError naming the argument and the rule."""
        cfg = self.config
        max_new_tokens = require_int(max_new_tokens, "max_new_tokens must be an int")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (the prefill emits the first token), got {max_new_tokens}")
        vocab = self.vocab_size
        if eos_token_id is not None:
            eos_token_id = require_int(eos_token_id, "eos_token_id must be one int or None")
            validate_token_ids([eos_token_id], vocab, "eos_token_id")
        prompts = item_list(prompts, "prompts must be a list of token-id lists, one per request")
        if not prompts:
            return None
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
        if running + len(prompts) > cfg.max_batch_size:
            raise ValueError(f"{running} running + {len(prompts)} new requests exceed max_batch_size {cfg.max_batch_size}")
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
        return NewRequests(prompts, max_new_tokens, eos_token_id, sampling)

    def allocate(self, new: NewRequests, first_rid: int) -> list[Request]:
        """A Request per prompt, ids from ``first_rid``, with its rows and admission pages
        (BatchPages.take); OutOfPagesError where a pool runs short. What it took stays taken when
        it raises: the caller frees it (BatchPages.free_rows_since)."""
        prompts, max_new_tokens, eos, sampling = new.prompts, new.max_new_tokens, new.eos_token_id, new.sampling
        made: list[Request] = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling)):
            # Ids are taken once add_requests succeeds: a refused or failed admission uses none.
            req = Request(first_rid + i, list(prompt), max_new_tokens, eos, -1, -1, params, seq_len=len(prompt),
                          last_n=last_step_n(len(prompt), max_new_tokens))
            made.append(req)
            req.target_row = self.pages.pools[0].alloc_request()
            req.draft_row = self.pages.pools[1].alloc_request()
            self.pages.take((req.target_row, req.draft_row), len(prompt), max_new_tokens)
        return made
