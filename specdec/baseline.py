"""Target-only greedy decoding: the output spec decoding must reproduce, and the speed it must beat."""

from __future__ import annotations

import gc
import math

import torch

from attn.base import ForwardMode
from attn.registry import get_backend_class
from specdec.batch import extend_batch, ragged_arange, uniform_batch
from specdec.kv import MLAKVPool


class _Session:
    """A KV pool with one row of ``context`` positions per prompt, an attention backend, and
    the prompts' prefill: what target-only decoding and full-sequence logits both start from."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], context: int, page_size: int,
                 backend: str, kv_dtype: torch.dtype | None) -> None:
        param = next(model.parameters())
        self.model, self.device, bs = model, param.device, len(prompts)
        self.pool = MLAKVPool(model.num_attention_layers, bs * context // page_size + 1, page_size, bs, context,
                              kv_dtype or param.dtype, self.device)
        self.attn = get_backend_class(backend)(self.pool.view(), model.attn_spec(), bs, 1)
        rows = [self.pool.alloc_request() for _ in prompts]
        self.pool.ensure_capacity_many(rows, [context] * bs)
        self.rows = torch.tensor(rows, device=self.device)
        lens = [len(p) for p in prompts]
        self.prefill = extend_batch(self.pool.req_to_token, rows, [0] * bs, lens)
        self.attn.init_forward_metadata(self.prefill)
        ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        self.prefill_hidden = model(ids, ragged_arange(lens).to(self.device), self.attn, self.prefill)  # [T, D]

    def decode(self, tokens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One token per request (``[B]``) at kv index seq_lens (``[B]`` int64): hidden ``[B, D]``."""
        step = uniform_batch(ForwardMode.DECODE, self.pool.req_to_token, self.rows, seq_lens, 1, seq_lens + 1)
        self.attn.init_forward_metadata(step)
        return self.model(tokens, seq_lens, self.attn, step)


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
    bs = len(prompts)
    context = page_size * math.ceil((max(map(len, prompts)) + max_new_tokens + 1) / page_size)
    run = _Session(model, prompts, context, page_size, backend, kv_dtype)
    attn = run.attn
    token = model.compute_logits(run.prefill_hidden[run.prefill.cu_seqlens_q[1:].long() - 1]).argmax(-1)
    out = [token.clone()]
    lens = [len(p) for p in prompts]
    seq_lens = torch.tensor(lens, device=run.device)

    def decode() -> None:
        """One token per request, in place: token <- argmax, seq_lens += 1."""
        token.copy_(model.compute_logits(run.decode(token, seq_lens)).argmax(-1))
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
    page, n = 16, len(ids) - decode_steps
    run = _Session(model, [ids[:n]], page * (len(ids) // page + 1), page, "torch_ref", None)
    logits = [model.compute_logits(run.prefill_hidden)]
    for p in range(n, len(ids)):
        pos = torch.tensor([p], device=run.device)
        logits.append(model.compute_logits(run.decode(torch.tensor([ids[p]], device=run.device), pos)))
    return torch.cat(logits)
