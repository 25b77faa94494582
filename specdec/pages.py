"""The worker's KV pages over its target and draft pools: what a request holds from admission on,
what a step needs, growth ahead of need, and taking that growth back when pages run short.

A step at N writes the target's kv up to N + num_draft_tokens (the verify tree) and the draft's up
to N + the draft's offset (standalone: 1) + the draft region: a pool's ``extra``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from specdec.kv import MLAKVPool, OutOfPagesError
from specdec.state import BatchHost, Request, last_step_n


class BatchPages:
    """Page bookkeeping of the running batch in both pools; the host arrays it reads and updates
    are the worker's BatchHost (seq_len, last_n, rows, room)."""

    def __init__(self, target_pool: MLAKVPool, draft_pool: MLAKVPool, num_draft_tokens: int, draft_offset: int,
                 draft_region_len: int) -> None:
        self.pools = (target_pool, draft_pool)
        self.extras = (num_draft_tokens, draft_offset + draft_region_len)
        self.prefill_extras = (0, draft_offset)  # the draft's pool also holds the first output when standalone

    def admission(self, prompt_len: int, max_new_tokens: int) -> list[tuple[MLAKVPool, int, int]]:
        """(pool, first, longest) of each pool for a new request: the positions its pages hold from
        admission on (its prefill and, if it takes spec steps, its first step, so an admitted
        request's first step never runs short) and at its last possible step."""
        if max_new_tokens == 1:  # the prefill's token is its only one
            return [(pool, prompt_len + extra, prompt_len + extra) for pool, extra in zip(self.pools, self.prefill_extras)]
        last_n = last_step_n(prompt_len, max_new_tokens)
        return [(pool, prompt_len + extra, last_n + extra) for pool, extra in zip(self.pools, self.extras)]

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """ValueError where a pool could not hold the request's last step even with nothing else
        running: it could never finish."""
        for (pool, _, longest), name in zip(self.admission(prompt_len, max_new_tokens), ("target", "draft")):
            if pool.pages_for(longest) > pool.num_pages - 1:  # page 0 is the padding sink
                raise ValueError(
                    f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} needs {pool.pages_for(longest)} "
                    f"KV pages of the {name} pool at its last step, which has {pool.num_pages - 1}; raise "
                    f"SpecConfig.num_pages or shorten the request"
                )

    def rows_held(self) -> tuple[frozenset[int], frozenset[int]]:
        """The rows each pool has handed out (MLAKVPool.rows_held)."""
        return tuple(pool.rows_held() for pool in self.pools)

    def free_rows_since(self, held: tuple[frozenset[int], frozenset[int]]) -> None:
        """Free the rows (and their pages) taken since rows_held() gave ``held``: what a failed or
        interrupted admission took, whether or not its requests received them."""
        for pool, rows in zip(self.pools, held):
            pool.free_rows_since(rows)

    def release(self, req: Request) -> None:
        """Return a request's rows, and with them its pages, to both pools (those it holds)."""
        for pool, row in zip(self.pools, (req.target_row, req.draft_row)):
            if row >= 0:
                pool.free_request(row)
        req.target_row = req.draft_row = -1

    def take(self, rows: tuple[int, int], prompt_len: int, max_new_tokens: int) -> None:
        """Give a new request (its target and draft rows) its admission pages; OutOfPagesError
        where a pool has too few free."""
        for (pool, first, _), row in zip(self.admission(prompt_len, max_new_tokens), rows):
            pool.ensure_capacity(row, first)

    def room(self, h: BatchHost) -> np.ndarray:
        """``[B]`` the largest N at which each request's pages in both pools still hold a step."""
        (target, draft), (target_extra, draft_extra) = self.pools, self.extras
        return np.minimum(target.capacity[h.target_row] - target_extra, draft.capacity[h.draft_row] - draft_extra)

    def needs(self, h: BatchHost) -> Iterator[tuple[MLAKVPool, np.ndarray, np.ndarray, np.ndarray]]:
        """(pool, rows, need, most) of each pool: each running request's row, the positions its
        pages must hold for its next step (``[B]``), and for its last possible one."""
        for pool, rows, extra in zip(self.pools, (h.target_row, h.draft_row), self.extras):
            yield pool, rows, h.seq_len + extra, h.last_n + extra

    def reserve(self, h: BatchHost) -> None:
        """Pages for the next step of every running request. A step that crosses no page costs one
        comparison against the batch's room; pool work is only for the requests that cross one.
        A request that grows gets kv.GROW_AHEAD_PAGES more pages while the pool has them, so the
        pool's req_to_token write (host work and a copy) comes every few pages, not every page."""
        if not (h.seq_len > h.room).any():
            return
        needs = list(self.needs(h))
        # Both pools are checked before either grows: a refused step changes neither.
        for (pool, rows, need, _), name in zip(needs, ("target", "draft")):
            missing = pool.shortfall(rows, need)
            if missing:
                raise OutOfPagesError(f"the next step needs {missing} more KV pages of the {name} pool than are free "
                                      "or held ahead of need; abort a request or raise SpecConfig.num_pages")
        for pool, rows, need, most in needs:
            pool.grow(rows, need, most)
        h.room = self.room(h)

    def trim_for(self, h: BatchHost, prompt_lens: list[int], max_new_tokens: int) -> None:
        """Where the pages the running requests hold past their next step (grow-ahead) would make
        room for new requests of ``prompt_lens`` (their admission pages) in both pools, take them
        back; else change nothing and raise OutOfPagesError naming each short pool's numbers."""
        needs = list(self.needs(h))
        wanted = np.zeros(len(self.pools), dtype=np.int64)
        for prompt_len in prompt_lens:
            wanted += [pool.pages_for(first) for pool, first, _ in self.admission(prompt_len, max_new_tokens)]
        short = []
        for (pool, rows, need, _), want, name in zip(needs, wanted.tolist(), ("target", "draft")):
            spare = pool.spare_pages(rows, need)
            if pool.num_free_pages + spare < want:
                short.append(f"the {name} pool {want} pages, {pool.num_free_pages} free and {spare} held ahead of need")
        if short:
            raise OutOfPagesError(f"admitting {len(prompt_lens)} request(s) needs {' and '.join(short)}; abort a "
                                  "running request, add fewer, or raise SpecConfig.num_pages")
        for pool, rows, need, _ in needs:
            pool.trim_many(rows, need)
        h.room = self.room(h)
