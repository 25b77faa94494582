"""Building the AttnBatch of each pass from request rows and kv indices, on the device, and
running a pass over it."""

from __future__ import annotations

from typing import Optional

import torch

from attn.base import AttnBatch, ForwardMode, const_arange
from specdec.step_kernels import pass_slots

# Prompt tokens a prefill pass takes by default (bounds its activations); a backend whose kernel takes
# fewer says so (max_prefill_tokens) and gets passes of that size.
MAX_PREFILL_TOKENS = 16384


def extend_positions(starts: list[int], lengths: list[int]) -> torch.Tensor:
    """``[starts[0]..starts[0] + lengths[0]), ...`` concatenated (host int64): the kv positions of
    a prefill pass's packed tokens."""
    return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])


def host_to_device(values: list[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list on the device without a synchronising copy (pinned staging, non-blocking)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def uniform_batch(
    mode: ForwardMode,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    q_len: int,
    first: int = 0,
    custom_mask: Optional[torch.Tensor] = None,
    max_kv_len: Optional[int] = None,
) -> tuple[AttnBatch, torch.Tensor]:
    """A pass with ``q_len`` new tokens per request, stored at kv indices
    ``lens + first .. lens + first + q_len - 1`` of each request, which then holds
    ``lens + first + q_len`` kv rows: (its AttnBatch, those kv indices ``[B * q_len]`` int64,
    request-major: the positions of a pass whose tokens sit at their own, a chain's), from one
    kernel on a GPU (step_kernels.pass_slots).

    rows / lens: ``[B]`` int64 req_to_token rows and kv lengths (device); max_kv_len: host bound
    of the pass's kv lengths (AttnBatch.max_kv_len).
    """
    out_cache_loc, seq_lens, index = pass_slots(req_to_token, rows, lens, first, q_len)
    cu = const_arange((rows.shape[0] + 1) * q_len, rows.device, q_len, torch.int32)
    return AttnBatch(mode, rows, seq_lens, out_cache_loc, cu, q_len, True, custom_mask, max_kv_len), index


def run_pass(model: torch.nn.Module, backend, batch: AttnBatch, *inputs: Optional[torch.Tensor]) -> torch.Tensor:
    """Build the pass's attention metadata, then run ``model(*inputs, backend, batch)``."""
    backend.init_forward_metadata(batch)
    return model(*inputs, backend, batch)


def extend_batch(req_to_token: torch.Tensor, rows: list[int], starts: list[int], lengths: list[int],
                 positions: Optional[torch.Tensor] = None) -> AttnBatch:
    """A prefill pass: request ``rows[i]`` gets ``lengths[i]`` new tokens from kv index ``starts[i]``.

    Host lists (prefill sizes are known on the host); tensors are built on req_to_token's device.
    positions: the tokens' kv indices ``[T]`` int64 there (extend_positions), where the caller has them.
    """
    device = req_to_token.device
    row_t = torch.tensor(rows, dtype=torch.long, device=device)
    index = extend_positions(starts, lengths).to(device) if positions is None else positions
    row_of_token = torch.repeat_interleave(row_t, torch.tensor(lengths, device=device))
    out_cache_loc = req_to_token[row_of_token, index].long()
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    seq_lens = torch.tensor([s + n for s, n in zip(starts, lengths)], dtype=torch.int32)
    return AttnBatch(
        ForwardMode.EXTEND, row_t, seq_lens.to(device), out_cache_loc, cu, max(lengths), False,
    )


def extend_pass(req_to_token: torch.Tensor, rows: list[int], starts: list[int],
                tokens: list[list[int]]) -> tuple[AttnBatch, torch.Tensor, torch.Tensor]:
    """A prefill pass that stores ``tokens[i]`` at kv indices ``starts[i]..`` of request ``rows[i]``:
    its batch (extend_batch), token ids and positions (``[T]`` int64 each, packed in order), on
    req_to_token's device."""
    device = req_to_token.device
    lengths = [len(piece) for piece in tokens]
    positions = extend_positions(starts, lengths).to(device)
    ids = torch.tensor([t for piece in tokens for t in piece], dtype=torch.long, device=device)
    return extend_batch(req_to_token, rows, starts, lengths, positions), ids, positions


def prefill_cap(max_tokens: int, backends: list) -> int:
    """Tokens a prefill pass may take: max_tokens, or fewer where one of the passes' attention
    backends takes fewer (its ``max_prefill_tokens``; None: any)."""
    return min([max_tokens, *(b.max_prefill_tokens for b in backends if b.max_prefill_tokens is not None)])


def prefill_pieces(lengths: list[int], max_tokens: int, extra_last: int = 0) -> list[list[tuple[int, int, int]]]:
    """Prompts of ``lengths`` tokens cut into consecutive prefill passes of at most ``max_tokens``
    tokens (chunked prefill): each pass a list of ``(prompt index, start, length)`` pieces. The
    prompts' tokens go in order, so a long prompt spans passes (never two pieces of one prompt in
    one pass). extra_last: tokens a prompt's last piece costs beyond its own (a standalone draft's
    pass also takes the prompt's first output); a last piece that fits no pass goes alone.
    """
    passes: list[list[tuple[int, int, int]]] = [[]]
    room = max_tokens
    for i, n in enumerate(lengths):
        start = 0
        while start < n:
            rest = n - start
            take = rest if rest + extra_last <= room else min(room, rest - 1)
            if take <= 0:
                if passes[-1]:
                    passes.append([])
                    room = max_tokens
                    continue
                take = rest  # max_tokens < 1 + extra_last: the last token alone
            passes[-1].append((i, start, take))
            room -= take + (extra_last if start + take == n else 0)
            start += take
    return passes
