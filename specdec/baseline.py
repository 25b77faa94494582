"""Target-only greedy decoding: the output spec decoding must reproduce, and the speed it must beat."""

from __future__ import annotations

import gc
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
    cuda_graph: bool = False,
) -> list[list[int]]:
    """Prefill every prompt, then decode one token per request per forward (argmax).

    cuda_graph: run the first decode step eagerly (warm-up), capture one decode step and replay
    it for the rest: the fair baseline for a graphed spec step. Backends that plan on the host
    are planned from the host kv lengths before each replay.
    """
    param = next(model.parameters())
    device = param.device
    bs = len(prompts)
    context = page_size * math.ceil((max(map(len, prompts)) + max_new_tokens + 1) / page_size)
    pool = MLAKVPool(model.num_attention_layers, bs * context // page_size + 1, page_size, bs, context, kv_dtype or param.dtype, device)
    cls = get_backend_class(backend)
    attn = cls(pool.view(), model.attn_spec(), bs, 1)
    rows = [pool.alloc_request() for _ in prompts]
    pool.ensure_capacity_many(rows, [context] * bs)
    lens = [len(p) for p in prompts]

    batch = extend_batch(pool.req_to_token, rows, [0] * bs, lens)
    attn.init_forward_metadata(batch)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = ragged_arange(lens).to(device)
    hidden = model(ids, positions, attn, batch)
    token = model.compute_logits(hidden[batch.cu_seqlens_q[1:].long() - 1]).argmax(-1)
    out = [token.clone()]
    seq_lens = torch.tensor(lens, device=device)
    row_t = torch.tensor(rows, device=device)

    def decode() -> None:
        """One token per request, in place: token <- argmax, seq_lens += 1."""
        step = uniform_batch(ForwardMode.DECODE, pool.req_to_token, row_t, seq_lens, 1, seq_lens + 1)
        attn.init_forward_metadata(step)
        token.copy_(model.compute_logits(model(token, seq_lens, attn, step)).argmax(-1))
        seq_lens.add_(1)

    if cuda_graph:
        attn.init_cuda_graph_state(bs, bs)
    host_lens, graph = torch.tensor(lens, dtype=torch.int32), None
    for i in range(max_new_tokens - 1):
        if cuda_graph and attn.needs_cpu_seq_lens:
            attn.init_forward_metadata_replay_cuda_graph(bs, host_lens + i + 1, 1)
        if graph is not None:
            graph.replay()
        else:
            decode()
            if cuda_graph:
                gc.collect()  # garbage holding graphs or pinned memory must not be freed mid-capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    decode()
        out.append(token.clone())
    return torch.stack(out, dim=1).tolist()


@torch.inference_mode()
def sequence_logits(model: torch.nn.Module, ids: list[int], decode_steps: int = 0) -> torch.Tensor:
    """``[len(ids), vocab]`` logits of one sequence through the torch_ref backend, in the model's
    dtype and device: a prefill of all but the last ``decode_steps`` tokens, then one-token decodes."""
    param = next(model.parameters())
    device, page = param.device, 16
    pool = MLAKVPool(model.num_attention_layers, len(ids) // page + 2, page, 1, page * (len(ids) // page + 1), param.dtype, device)
    row = pool.alloc_request()
    pool.ensure_capacity(row, len(ids))
    attn = get_backend_class("torch_ref")(pool.view(), model.attn_spec(), 1, 1)
    n = len(ids) - decode_steps
    batch = extend_batch(pool.req_to_token, [row], [0], [n])
    attn.init_forward_metadata(batch)
    logits = [model.compute_logits(model(torch.tensor(ids[:n], device=device), torch.arange(n, device=device), attn, batch))]
    row_t = torch.tensor([row], device=device)
    for p in range(n, len(ids)):
        pos = torch.tensor([p], device=device)
        batch = uniform_batch(ForwardMode.DECODE, pool.req_to_token, row_t, pos, 1, pos + 1)
        attn.init_forward_metadata(batch)
        logits.append(model.compute_logits(model(torch.tensor([ids[p]], device=device), pos, attn, batch)))
    return torch.cat(logits)
