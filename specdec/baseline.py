"""Target-only greedy decoding: the output spec decoding must reproduce, and the speed it must beat."""

from __future__ import annotations

import gc
import math

import torch

from attn.base import ForwardMode
from attn.registry import BackendChoice, check_device, check_page_size, get_backend_class, resolve_backends
from specdec.batch import MAX_PREFILL_TOKENS, extend_pass, prefill_cap, prefill_pieces, uniform_batch
from specdec.kv import MLAKVPool
from specdec.tree import head_logits


class _Session:
    """A KV pool with one row of ``context`` positions per prompt (and a sparse model's indexer
    keys), the decode backend (``choice``'s target) and the one that prefills (the same, or its
    family's prefill fallback), and the prompts' prefill: what target-only decoding and
    full-sequence logits both start from."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], context: int, page_size: int,
                 choice: BackendChoice, kv_dtype: torch.dtype | None, kv_scale: float = 1.0) -> None:
        if len(prompts) == 0 or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("target-only decoding needs at least one prompt, and every prompt at least one token")
        param = next(model.parameters())
        self.model, self.device, bs, spec = model, param.device, len(prompts), model.attn_spec()
        self.pool = MLAKVPool(model.num_attention_layers, bs * context // page_size + 1, page_size, bs, context,
                              kv_dtype or param.dtype, self.device, kv_scale, spec.index_head_dim)
        self.attn = get_backend_class(choice.target)(self.pool.view(), spec, bs, 1)
        prefill_attn = self.attn
        if choice.prefill != choice.target:
            prefill_attn = get_backend_class(choice.prefill)(self.pool.view(), spec, bs, 1)
        rows = [self.pool.alloc_request() for _ in prompts]
        self.pool.ensure_capacity_many(rows, [context] * bs)
        self.rows = torch.tensor(rows, device=self.device)
        lens = [len(p) for p in prompts]
        self.last = torch.tensor(lens, device=self.device).cumsum(0) - 1  # [B] each prompt's last token
        hidden = []  # passes of at most MAX_PREFILL_TOKENS (or the backend's max) tokens, a long prompt over several
        for pieces in prefill_pieces(lens, prefill_cap(MAX_PREFILL_TOKENS, [prefill_attn])):
            batch, ids, positions = extend_pass(self.pool.req_to_token, [rows[i] for i, _, _ in pieces],
                                                [s for _, s, _ in pieces], [prompts[i][s:s + n] for i, s, n in pieces])
            prefill_attn.init_forward_metadata(batch)
            hidden.append(model(ids, positions, prefill_attn, batch))
        self.prefill_hidden = torch.cat(hidden)  # [T, D], the prompts' tokens in order

    def decode(self, tokens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One token per request (``[B]``) at kv index seq_lens (``[B]`` int64): hidden ``[B, D]``."""
        step, _ = uniform_batch(ForwardMode.DECODE, self.pool.req_to_token, self.rows, seq_lens, 1)
        self.attn.init_forward_metadata(step)
        return self.model(tokens, seq_lens, self.attn, step)


class GreedyDecoder:
    """Target-only greedy decoding of a batch: the prompts' prefill gives each request its first
    token, then every ``step()`` decodes one more token per request (argmax), in place on the
    device.

    cuda_graph: the first step runs eagerly (warm-up), the second captures one decode step and
    runs it, later steps replay it: the fair baseline for a graphed spec step, and steps from the
    third on are the steady state to time. Backends that plan on the host are planned from the
    host kv lengths before the capture and each replay.
    """

    @torch.inference_mode()
    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, backend: str = "torch_ref",
                 page_size: int = 16, kv_dtype: torch.dtype | None = None, cuda_graph: bool = False,
                 kv_scale: float = 1.0) -> None:
        """Room for ``max_new_tokens`` tokens a request (the first and max_new_tokens - 1 steps);
        kv_scale: an fp8 cache's per-tensor scale (SpecConfig.kv_scale)."""
        bs = len(prompts)
        # (no prompts: _Session refuses them)
        # As the worker's config settles them: kernels the device cannot run refused before any kernel
        # library is touched, and the page size the backends take.
        choice = resolve_backends(backend)
        check_device(choice, next(model.parameters()).device)
        page_size = check_page_size(choice, page_size)
        # Pages, and whole block-table widths where a backend needs them (cutedsl_mla: 128 tokens).
        step = math.lcm(page_size, *(cls.table_tokens_multiple for cls in choice.classes().values()))
        context = step * math.ceil((max(map(len, prompts), default=0) + max_new_tokens + 1) / step)
        self.model, self.cuda_graph, self.max_new_tokens = model, cuda_graph, max_new_tokens
        self.run = _Session(model, prompts, context, page_size, choice, kv_dtype, kv_scale)
        self.token = model.compute_logits(self.run.prefill_hidden[self.run.last]).argmax(-1)
        self.tokens = [self.token.clone()]  # [B] int64 each, on the device
        lens = [len(p) for p in prompts]
        self.seq_lens = torch.tensor(lens, device=self.run.device)
        self.host_lens = torch.tensor(lens, dtype=torch.int32)
        self.graph: torch.cuda.CUDAGraph | None = None
        if cuda_graph:
            self.run.attn.init_cuda_graph_state(bs, bs)

    def _decode(self) -> None:
        """One token per request, in place: token <- argmax (the head's greedy picks where the
        model gives them: tree.head_logits), seq_lens += 1."""
        logits, pick = head_logits(self.model, self.run.decode(self.token, self.seq_lens))
        if pick is None:
            self.token.copy_(logits.argmax(-1))
        else:
            pick.argmax(out=self.token)
        self.seq_lens.add_(1)

    @torch.inference_mode()
    def step(self) -> None:
        """Decode the next token of every request; at most max_new_tokens - 1 steps (the room the
        KV pool has)."""
        if len(self.tokens) >= self.max_new_tokens:
            raise RuntimeError(f"GreedyDecoder has decoded its max_new_tokens ({self.max_new_tokens}); "
                               "build it with more to decode further")
        attn = self.run.attn
        if self.cuda_graph and attn.needs_cpu_seq_lens:
            attn.init_forward_metadata_replay_cuda_graph(len(self.host_lens), self.host_lens + len(self.tokens), 1)
        if self.cuda_graph and self.graph is None and len(self.tokens) > 1:
            gc.collect()  # garbage holding graphs or pinned memory must not be freed mid-capture
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._decode()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._decode()
        self.tokens.append(self.token.clone())

    def outputs(self) -> list[list[int]]:
        """Every request's tokens so far (one host copy)."""
        return torch.stack(self.tokens, dim=1).tolist()


@torch.inference_mode()
def greedy_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    backend: str = "torch_ref",
    page_size: int = 16,
    kv_dtype: torch.dtype | None = None,
    cuda_graph: bool = False,
    kv_scale: float = 1.0,
) -> list[list[int]]:
    """Prefill every prompt, then decode one token per request per forward (argmax): the
    max_new_tokens tokens of each request (GreedyDecoder, whose ``cuda_graph`` and ``kv_scale``
    these are)."""
    decoder = GreedyDecoder(model, prompts, max_new_tokens, backend, page_size, kv_dtype, cuda_graph, kv_scale)
    for _ in range(max_new_tokens - 1):
        decoder.step()
    return decoder.outputs()


@torch.inference_mode()
def sequence_logits(model: torch.nn.Module, ids: list[int], decode_steps: int = 0) -> torch.Tensor:
    """``[len(ids), vocab]`` logits of one sequence through the torch_ref backend, in the model's
    dtype and device: a prefill of all but the last ``decode_steps`` tokens, then one-token decodes."""
    page, n = 16, len(ids) - decode_steps
    run = _Session(model, [ids[:n]], page * (len(ids) // page + 1), page, resolve_backends("torch_ref"), None)
    logits = [model.compute_logits(run.prefill_hidden)]
    for p in range(n, len(ids)):
        pos = torch.tensor([p], device=run.device)
        logits.append(model.compute_logits(run.decode(torch.tensor([ids[p]], device=run.device), pos)))
    return torch.cat(logits)
