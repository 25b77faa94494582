"""One workspace buffer per kernel family and device.

Families never share a buffer: cute-dsl's split-KV partials would overwrite trtllm-gen's
zero-initialised multi-CTA counters where FlashInfer keeps those in the workspace (upstream saw a
deadlock when the two shared one; FlashInfer 0.7.2 keeps them in a buffer of their own, which
trtllm_mla allocates per backend).
"""

from __future__ import annotations

import torch

_WORKSPACES: dict[tuple[str, str], torch.Tensor] = {}


def get_workspace(family: str, num_bytes: int, device: torch.device) -> torch.Tensor:
    """The zero-initialised ``[num_bytes]`` uint8 workspace of ``family`` on ``device``: the same
    buffer for every user of the family, unless a later user needs more, which gets a new, larger
    (zeroed) buffer that the users after it share; earlier users keep theirs."""
    key = (family, str(torch.device(device)))
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < num_bytes:
        buf = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        _WORKSPACES[key] = buf
    return buf
