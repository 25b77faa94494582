"""CUDA graphs of the spec step, one a batch-size bucket, of its three stages (GRAPH_KINDS): the
multi-step draft (ending in the verify tree), verify (+ accept, KV commit, the copy of the step's
report to the host and its event record) and draft-extend (+ the next state written back into the
static inputs).

The runner knows the step only through specdec.step.SpecStep's interface: its three stages
(draft, verify_and_accept, draft_extend), backends, state_template, kv_len_buckets and
plan_passes_on_host. A bucket's step is captured once more per kv bound its backends plan shorter
contexts for (e.g. triton_mla's latency-bound narrow tiles); a step replays the graphs of the
smallest bound holding its longest request, else those planned for the longest context.

A bucket's three stages are captured in order into one graph: a step is one launch, with no
driver calls of our own (three graphs joined as child nodes took the same device time:
docs/benchmarks.md, "The step's small kernels"). One set of static
inputs at the largest bucket; every bucket's graphs (captured largest first, in one memory pool)
read its first ``bs`` rows. A live batch is copied into the first rows of the next bucket up;
padded rows point at the pool's padding row with N = 0, so they touch no real KV or output.
While the batch runs unchanged the running state is a view of the static inputs: a step is one
launch. Backends that plan on the host (``needs_cpu_seq_lens``) are planned from host lengths
before each launch; those that cannot be captured are refused. Randomness comes from
counter-based hashes (specdec.sampling), not a torch generator, whose offsets a replay would
not advance.
"""

from __future__ import annotations

import bisect
import functools
import gc
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from attn.values import int_list
from specdec.accept import AcceptResult
from specdec.device import on_device
from specdec.guard import CallGuard, exclusive
from specdec.kv import PADDING_ROW
from specdec.state import DecodeState
from specdec.step import SpecStep
from specdec.step_kernels import copy_tensors
from specdec.tree import VerifyTree


def default_buckets(max_bs: int) -> list[int]:
    """``[1, 2, 4, 8] + range(16, max_bs + 1, 16)`` capped at max_bs, max_bs included."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    return sorted(set(sizes) | {max_bs})


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream every GraphRunner on ``device`` warms its captures up and captures them on.
    cuBLAS keeps a workspace for each stream it has run on (32 MiB on SM90) for the life of the
    process, so one stream holds one, however many graphs and runners there are
    (benchmarks/graph_capture.py)."""
    return torch.cuda.Stream(device)


def pick_bucket(buckets: list[int], batch_size: int) -> Optional[int]:
    """The smallest bucket holding ``batch_size`` rows, or None if it exceeds the largest."""
    i = bisect.bisect_left(buckets, batch_size)
    return buckets[i] if i < len(buckets) else None


@dataclass
class StaticInputs:
    """Largest-bucket input buffers: the DecodeState fields plus the request rows."""

    tensors: dict[str, torch.Tensor]

    def fill(self, live: dict[str, torch.Tensor], bucket: int) -> None:
        """Copy a live batch into rows [0, b) and make rows [b, bucket) harmless padding.

        Multi-tensor copies keep the launches per replay few: host time is the graph win.
        """
        b = next(iter(live.values())).shape[0]
        names = list(self.tensors)
        torch._foreach_copy_([self.tensors[n][:b] for n in names], [live[n] for n in names], non_blocking=True)
        if b < bucket:
            for name in names:
                self.tensors[name][b:bucket].fill_(PADDING_ROW if name.endswith("rows") else 0)

    def view(self, bs: int) -> dict[str, torch.Tensor]:
        return {name: t[:bs] for name, t in self.tensors.items()}


GRAPH_KINDS = ("draft", "verify", "draft_extend")  # SpecStep.draft, .verify_and_accept, .draft_extend


@dataclass
class _Captured:
    """A bucket's step for one kv bound (its GRAPH_KINDS stages in one graph) and the stages'
    outputs (``tree``; ``result``, ``hidden``), which live in graph memory."""

    graph: torch.cuda.CUDAGraph
    outputs: dict[str, object]


class GraphRunner:
    """Captures a SpecStep's three stages (GRAPH_KINDS) as one graph per batch-size bucket and kv
    bound and replays a step as one launch. Built by ``EagleWorker.capture_graphs``, which
    holds it and passes it each step's live inputs (run)."""

    def __init__(self, step: SpecStep, batch_sizes: Optional[list[int]] = None, eager_fallback: bool = False,
                 progress: bool = True, kv_bounds: bool = True) -> None:
        """batch_sizes: the buckets (default: the config's cuda_graph_batch_sizes, else
        default_buckets), at most max_batch_size; below it only with eager_fallback, which runs
        larger batches eagerly. kv_bounds: also capture each bucket's step per kv bound
        (step.kv_len_buckets); False: only the longest context's graphs."""
        for name, flag in (("eager_fallback", eager_fallback), ("progress", progress), ("kv_bounds", kv_bounds)):
            if not isinstance(flag, bool):  # "no" or [64] read as True
                raise ValueError(f"GraphRunner's {name} must be True or False, got {flag!r}")
        if not hasattr(step, "backends"):
            raise TypeError(f"GraphRunner takes a SpecStep, got {type(step).__name__}: build graphs with "
                            "worker.capture_graphs(), which keeps the runner")
        if getattr(step, "host_copy", None) is not None and step.host_copy.rows is not None:
            raise RuntimeError("GraphRunner while a step is in flight: its captures' warm-ups would run into that "
                               "step's copy to the host; finish_step(worker.in_flight) first")
        if step.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the worker runs on {step.device}")
        # Triton refused that allocator's pointers at the first capture. (A CPU-only torch, which
        # tests give a stand-in CUDA step, has no allocator to ask.)
        if torch.cuda.is_available() and torch.cuda.get_allocator_backend() == "cudaMallocAsync":
            raise ValueError("GraphRunner needs PyTorch's native CUDA allocator, not cudaMallocAsync: drop "
                             "backend:cudaMallocAsync from PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF")
        self.step = step
        self.device = step.device
        self._guard = CallGuard("GraphRunner")
        cfg = step.config
        sizes = [] if batch_sizes is None else int_list(batch_sizes, "batch_sizes must be a list of ints")
        if batch_sizes is not None and not sizes:
            raise ValueError("batch_sizes is empty: give at least one bucket, or None for the defaults")
        self.buckets = sorted(set(sizes or cfg.cuda_graph_batch_sizes or default_buckets(cfg.max_batch_size)))
        if self.buckets[0] < 1 or self.buckets[-1] > cfg.max_batch_size:
            raise ValueError(f"CUDA-graph batch sizes must lie in [1, max_batch_size={cfg.max_batch_size}], got {self.buckets}")
        if self.buckets[-1] < cfg.max_batch_size and not eager_fallback:
            raise ValueError(f"the largest CUDA-graph batch size ({self.buckets[-1]}) is below max_batch_size "
                             f"({cfg.max_batch_size}): larger batches would have no graph; add a bucket of "
                             f"{cfg.max_batch_size} or pass eager_fallback=True")
        backends = step.backends
        unsupported = sorted({b.name for b in backends if not b.supports_cuda_graph})
        if unsupported:
            raise ValueError(f"backends {unsupported} cannot be captured in CUDA graphs; "
                             "disable cuda graphs or pick triton_mla / flashinfer_mla / torch_ref / a Blackwell backend")
        self.host_planned = any(b.needs_cpu_seq_lens for b in backends)
        # The backends' static metadata holds every batch the worker admits: an eager_fallback batch
        # above the largest bucket builds its metadata there too.
        for backend in backends:
            backend.init_cuda_graph_state(cfg.max_batch_size, cfg.max_batch_size * cfg.num_draft_tokens)
        max_bs = self.buckets[-1]
        st = step.state_template(max_bs)
        self.static = StaticInputs({
            "target_rows": torch.full((max_bs,), PADDING_ROW, dtype=torch.long, device=self.device),
            "draft_rows": torch.full((max_bs,), PADDING_ROW, dtype=torch.long, device=self.device),
            **{name: t.zero_() for name, t in vars(st).items()},
        })
        # Per bucket: the bounds on N its steps are captured for, ascending; None: the longest context.
        self.kv_bounds = {bs: [*(step.kv_len_buckets(bs) if kv_bounds else []), None] for bs in self.buckets}
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: dict[tuple[int, Optional[int]], _Captured] = {}  # (bucket, kv bound)
        self._views: dict[tuple, tuple] = {}  # (batch size, bucket, kv bound) -> (result, state, tree) views
        # (state fields, target_rows, draft_rows) the static inputs hold: the last replay's views
        self._resident: Optional[tuple] = None
        self.capture_seconds = self._capture_all(progress)

    def _stages(self, inputs: dict[str, torch.Tensor], kv_bound: Optional[int]):
        """The graph bodies over static inputs, one per GRAPH_KINDS entry (the step's stages),
        and the dict their outputs go to; the last writes the next state back into the inputs."""
        step, out = self.step, {}
        st = DecodeState.of(inputs)
        target_rows, draft_rows = inputs["target_rows"], inputs["draft_rows"]

        def draft() -> None:
            out["tree"] = step.draft(st, draft_rows, kv_bound)

        def verify() -> None:
            out["result"], out["hidden"] = step.verify_and_accept(st, out["tree"], target_rows, kv_bound)

        def draft_extend() -> None:
            new = step.draft_extend(st, out["result"], out["hidden"], draft_rows, kv_bound)  # padding keeps N = 0
            pairs = [(old, t) for old, t in zip(vars(st).values(), vars(new).values()) if t is not old]
            copy_tensors(*map(list, zip(*pairs)))  # one launch for the six copies

        return dict(zip(GRAPH_KINDS, (draft, verify, draft_extend))), out

    @on_device  # captures, their warm-ups and the graphs' launches take the current device
    @torch.inference_mode()
    def _capture_all(self, progress: bool) -> float:
        gc.collect()  # garbage holding graphs or pinned memory must not be freed mid-capture
        start = time.perf_counter()
        # Largest first (later graphs reuse its pool memory), the longest context's bound first.
        keys = [(bs, bound) for bs in reversed(self.buckets) for bound in reversed(self.kv_bounds[bs])]
        stream = capture_stream(self.device)
        for i, (bs, bound) in enumerate(keys):
            if progress:
                print(f"\rcapturing CUDA graphs: batch size {bs:4d}, kv bound {bound or 'none':>6} "
                      f"({i + 1}/{len(keys)})", end="", file=sys.stderr)
            self.captured[bs, bound] = self._capture(bs, bound, stream)
        torch.cuda.synchronize()
        if progress:
            print(file=sys.stderr)
        return time.perf_counter() - start

    def _capture(self, bs: int, kv_bound: Optional[int], stream: torch.cuda.Stream) -> _Captured:
        """The step over the first ``bs`` rows of the static inputs, its passes planned for
        ``kv_bound``, its GRAPH_KINDS stages captured in order into one graph on the side stream
        ``stream``, after running it once there (lazy inits, autotuning, JIT)."""
        inputs = self.static.view(bs)
        stages, outputs = self._stages(inputs, kv_bound)
        if self.host_planned:
            self.step.plan_passes_on_host(inputs["seq_lens"].int().cpu())
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for body in stages.values():
                body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            for body in stages.values():
                body()
        return _Captured(graph, outputs)

    def kv_bound(self, bucket: int, longest: int) -> Optional[int]:
        """The kv bound whose graphs serve a batch in ``bucket`` whose longest request has N =
        ``longest``: the smallest bound that holds it, else None (the longest context's)."""
        bounds = self.kv_bounds[bucket]
        if len(bounds) == 1:
            return None
        return next(bound for bound in bounds if bound is None or longest <= bound)

    @exclusive
    def run(self, state: DecodeState, target_rows: torch.Tensor, draft_rows: torch.Tensor,
            seq_lens: np.ndarray) -> Optional[tuple[AcceptResult, DecodeState, VerifyTree]]:
        """Replay the step for a live batch (state: a DecodeState, rows ``[b]`` int64, seq_lens:
        the requests' N ``[b]`` int64 on the host); returns (result, next state, tree) as views of
        graph memory, valid until the next replay, or None when eager_fallback allows an
        oversized batch."""
        b = target_rows.shape[0]
        bucket = pick_bucket(self.buckets, b)
        if bucket is None:  # above the largest bucket: only with eager_fallback (checked at construction)
            return None
        inputs = (*vars(state).values(), target_rows, draft_rows)
        # The last step's own views need no copy, unless a field was replaced by another tensor.
        if self._resident is None or any(now is not then for now, then in zip(inputs, self._resident)):
            self.static.fill({"target_rows": target_rows, "draft_rows": draft_rows, **vars(state)}, bucket)
        if self.host_planned:
            padded = torch.zeros(bucket, dtype=torch.int32)
            padded[:b] = torch.from_numpy(seq_lens)
            self.step.plan_passes_on_host(padded)
        bound = self.kv_bound(bucket, int(seq_lens.max())) if len(self.kv_bounds[bucket]) > 1 else None
        self.replay(bucket, kv_bound=bound)
        result, state, tree = self._views.get((b, bucket, bound)) or self._make_views(b, bucket, bound)
        # New objects each step: a caller's edit of one stays its own, and finish_step tells a
        # stale result from the step's.
        result, state, tree = replace(result), replace(state), replace(tree)
        self._resident = (*vars(state).values(), target_rows, draft_rows)
        return result, state, tree

    @exclusive
    def replay(self, bucket: int, kv_bound: Optional[int] = None) -> None:
        """The bucket's step for ``kv_bound`` (one launch), on the static inputs as they are."""
        self.captured[bucket, kv_bound].graph.replay()

    def _make_views(self, b: int, bucket: int, kv_bound: Optional[int]) -> tuple:
        out, rows = self.captured[bucket, kv_bound].outputs, slice(0, b)
        views = (AcceptResult(*(None if t is None else t[rows] for t in vars(out["result"]).values())),
                 DecodeState.of(self.static.view(b)),
                 VerifyTree(*(t[rows] for t in vars(out["tree"]).values())))
        self._views[b, bucket, kv_bound] = views
        return views
