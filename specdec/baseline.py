"""Target-only greedy decoding: the output spec decoding must reproduce, and the speed it must beat."""

from __future__ import annotations

import math

import torch

from attn.base import ForwardMode
from attn.registry import get_backend_class
from specdec.batch import extend_batch, ragged_arange, uniform_batch
from specdec.kv import MLAKVPool


@torch.inference_mode()
def greedy_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    backend: str = "torch_ref",
    page_size: int = 16,
    kv_dtype: torch.dtype | None = None,
) -> list[list[int]]:
    """Prefill every prompt, then decode one token per request per forward (argmax)."""
    param = next(model.parameters())
    device = param.device
    context = page_size * math.ceil((max(map(len, prompts)) + max_new_tokens + 1) / page_size)
    pool = MLAKVPool(model.num_attention_layers, len(prompts) * context // page_size + 1, page_size, len(prompts),
                     context, kv_dtype or param.dtype, device)
    cls = get_backend_class(backend)
    attn = cls(pool.view(), model.attn_spec(), len(prompts), 1)
    rows = [pool.alloc_request() for _ in prompts]
    for row in rows:
        pool.ensure_capacity(row, context)
    lens = [len(p) for p in prompts]

    batch = extend_batch(pool.req_to_token, rows, [0] * len(prompts), lens)
    attn.init_forward_metadata(batch)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = ragged_arange(lens).to(device)
    hidden = model(ids, positions, attn, batch)
    token = model.compute_logits(hidden[batch.cu_seqlens_q[1:].long() - 1]).argmax(-1)
    out = [token]
    seq_lens = torch.tensor(lens, device=device)
    row_t = torch.tensor(rows, device=device)
    for _ in range(max_new_tokens - 1):
        batch = uniform_batch(ForwardMode.DECODE, pool.req_to_token, row_t, seq_lens, 1, seq_lens + 1)
        attn.init_forward_metadata(batch)
        hidden = model(token, seq_lens, attn, batch)
        token = model.compute_logits(hidden).argmax(-1)
        seq_lens = seq_lens + 1
        out.append(token)
    return torch.stack(out, dim=1).tolist()
