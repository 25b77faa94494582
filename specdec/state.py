"""The running batch's state: the requests on the host (Request, and BatchHost, their arrays),
the device state a spec step advances (DecodeState), what a step reports (StepStats), and the
pinned copy that brings a step's results to the host (HostCopy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from specdec.batch import host_to_device
from specdec.sampling import SamplingParams
from specdec.step_kernels import rows_to_host
from specdec.triton_lang import on_triton


def last_step_n(prompt_len: int, max_new_tokens: int) -> int:
    """The N of a request's last possible step, which emits its last token (the prefill emits the
    first)."""
    return prompt_len + max_new_tokens - 2


@dataclass(eq=False)
class Request:
    """Host-side view of one request: its prompt, the tokens emitted so far (``output``, the
    prefill's token first) and its KV rows. Compared and hashed by identity, as abort takes them:
    an engine can key its own tables by the objects add_requests returns.

    seq_len (N, the target's KV length while it runs: prompt and every output but the last) and
    last_n (the N of its last possible step) are the worker's record, kept apart from output and
    max_new_tokens: an engine may clear or trim ``output`` once it has streamed it, and editing
    prompt, max_new_tokens, eos_token_id or sampling changes no decode (taken at admission). The
    rows, seq_len and last_n are the worker's alone."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: Optional[int]
    target_row: int
    draft_row: int
    sampling: SamplingParams = SamplingParams()
    output: list[int] = field(default_factory=list)
    finished: bool = False
    seq_len: int = 0
    last_n: int = 0


@dataclass
class BatchHost:
    """Host arrays of the running batch, aligned with ``EagleWorker.requests`` and rebuilt when
    the batch changes, so the per-step bookkeeping is a few numpy calls, not a loop per request.

    seq_len (N), target_row, draft_row: ``[B]`` int64. last_n ``[B]`` int64: the N of each
    request's last possible step (len(prompt) + max_new_tokens - 2; it emits the last token).
    requests: the running requests; device_rows: target and draft rows ``[B]`` int64 on the
    device. room ``[B]`` int64: the largest N at which both pools' pages hold a step (set by the
    worker).
    """

    seq_len: np.ndarray
    target_row: np.ndarray
    draft_row: np.ndarray
    last_n: np.ndarray
    requests: list[Request]
    device_rows: tuple[torch.Tensor, torch.Tensor]
    room: Optional[np.ndarray] = None

    @staticmethod
    def of(requests: list[Request], device: torch.device) -> "BatchHost":
        table = np.array([(r.seq_len, r.target_row, r.draft_row, r.last_n) for r in requests],
                         dtype=np.int64).reshape(len(requests), 4)
        seq_len, target_row, draft_row, last_n = table.T.copy()
        rows = host_to_device([target_row.tolist(), draft_row.tolist()], device)
        return BatchHost(seq_len, target_row, draft_row, last_n, list(requests), (rows[0], rows[1]))


@dataclass
class DecodeState:
    """Device state of the running batch, aligned with ``EagleWorker.requests``.

    root ``[B]`` int64; seq_lens ``[B]`` int64 (N); hidden ``[B, D]`` the draft's last hidden state;
    cand_probs / cand_ids ``[B, topk]``: the first draft step's candidates;
    temperature / top_p ``[B]`` fp32, top_k / seed ``[B]`` int64: sampling parameters;
    counter ``[B]`` int64: the position in the request's random stream, spec steps taken + 1 (the
        prefill's draw is position 0);
    limit ``[B]`` int64: the N at which max_new_tokens run out (len(prompt) + max_new_tokens - 1);
    eos ``[B]`` int64: the eos token id, -1 for none.
    """

    root: torch.Tensor
    seq_lens: torch.Tensor
    hidden: torch.Tensor
    cand_probs: torch.Tensor
    cand_ids: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    counter: torch.Tensor
    limit: torch.Tensor
    eos: torch.Tensor

    def advance(self, root: torch.Tensor, seq_lens: torch.Tensor, hidden: torch.Tensor, cand: tuple[torch.Tensor, torch.Tensor],
                counter: torch.Tensor) -> "DecodeState":
        """The next step's state: same sampling parameters and stops; counter: this one's + 1."""
        return DecodeState(root, seq_lens, hidden, *cand, self.temperature, self.top_p, self.top_k, self.seed,
                           counter, self.limit, self.eos)

    def select(self, keep: torch.Tensor) -> "DecodeState":
        return DecodeState(*(t.index_select(0, keep) for t in vars(self).values()))

    @staticmethod
    def empty(batch_size: int, topk: int, hidden_size: int, hidden_dtype: torch.dtype,
              device: torch.device) -> "DecodeState":
        """An uninitialised state of ``batch_size`` rows (hidden ``[B, hidden_size]`` hidden_dtype)."""
        def new(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.empty(batch_size, *shape, dtype=dtype, device=device)

        f32 = torch.float32
        return DecodeState(root=new(), seq_lens=new(), hidden=new(hidden_size, dtype=hidden_dtype),
                           cand_probs=new(topk, dtype=f32), cand_ids=new(topk), temperature=new(dtype=f32),
                           top_p=new(dtype=f32), top_k=new(), seed=new(), counter=new(), limit=new(), eos=new())

    @staticmethod
    def of(tensors: dict[str, torch.Tensor]) -> "DecodeState":
        """The state whose fields are ``tensors``' entries of their names (others ignored)."""
        return DecodeState(**{name: tensors[name] for name in DecodeState.__dataclass_fields__})

    @staticmethod
    def sampling_tensors(requests: list[Request], device: torch.device) -> tuple[torch.Tensor, ...]:
        """The requests' temperature, top_p (fp32), top_k, seed (int64), each ``[B]`` on ``device``."""
        return (
            torch.tensor([r.sampling.temperature for r in requests], dtype=torch.float32, device=device),
            torch.tensor([r.sampling.top_p for r in requests], dtype=torch.float32, device=device),
            torch.tensor([r.sampling.top_k for r in requests], dtype=torch.long, device=device),
            torch.tensor([r.sampling.seed for r in requests], dtype=torch.long, device=device),
        )

    @staticmethod
    def concat(states: list["DecodeState"]) -> "DecodeState":
        return DecodeState(*(torch.cat(ts) for ts in zip(*(vars(s).values() for s in states))))


@dataclass
class StepStats:
    """Per step: accept_len of each request that ran (host list), and the tokens emitted."""

    accept_lens: list[int]
    num_emitted: int


class HostCopy:
    """A reusable pinned int64 host buffer and event: a non-blocking copy of a device tensor's
    leading rows, then the event's record (enqueue; a CUDA graph captures both, the event as an
    external record node, so a replayed step launches neither), then a wait on the event, not
    on the whole device (wait)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self.buffer = torch.empty(shape, dtype=torch.long, pin_memory=self.on_cuda)
        self.array = self.buffer.numpy()  # made once: a tensor's .numpy() costs microseconds
        self.event = torch.cuda.Event(external=True) if self.on_cuda else None
        self.rows: Optional[int] = None

    def enqueue(self, t: torch.Tensor) -> None:
        """Copy t ``[b, *shape[1:]]`` int64 (b <= shape[0]) into the buffer's first b rows, in
        stream order, and record the event after it. Rows of a CUDA tensor ``[b, w]`` are
        written by a kernel (step_kernels.rows_to_host), not a copy-engine transfer."""
        if self.on_cuda and on_triton(t) and t.dim() == 2 and t.stride(1) == 1:
            rows_to_host(t, self.buffer)
        else:
            self.buffer[: t.shape[0]].copy_(t, non_blocking=self.on_cuda)
        if self.on_cuda:
            self.event.record()

    def start(self, rows: int) -> None:
        """A copy of ``rows`` rows is enqueued (eagerly or by a replayed graph): wait may come."""
        self.rows = rows

    def wait(self) -> np.ndarray:
        """The started copy: a numpy view of the buffer's first rows, valid until the next start.
        It may be waited for again (a reader interrupted before it was done) until release."""
        if self.rows is None:
            raise RuntimeError("no copy in flight: finish_step needs the result of launch_step")
        if self.on_cuda:
            self.event.synchronize()
        return self.array[: self.rows]

    def release(self) -> None:
        """The started copy is read: the next wait needs another start."""
        self.rows = None

    def fetch(self, t: torch.Tensor) -> np.ndarray:
        """enqueue, start, wait and release: a synchronous copy of t."""
        self.enqueue(t)
        self.start(t.shape[0])
        rows = self.wait()
        self.release()
        return rows
