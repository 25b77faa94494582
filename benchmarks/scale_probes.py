"""How benchmarks/scale.py observes a step: which experts its passes chose (RouterTap, PassTap),
the kernels a layer launches (LayerKernels), a step's device time (StepClock) and the device's
read bandwidth (read_bandwidth)."""


from __future__ import annotations

import json
import math
import os
import tempfile
import time
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from benchmarks.rank_slice import Pass
from specdec.models import DeepseekV3Config
from specdec.parallel import Parallel


# ----------------------------------------------------------------------------------------- the taps
def _first_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def expert_ids(gate_output) -> Optional[torch.Tensor]:
    """The expert ids in a router's output: the integer tensor of (weights, ids), or the output
    itself if it is one."""
    outs = gate_output if isinstance(gate_output, (tuple, list)) else (gate_output,)
    return next((t for t in outs if isinstance(t, torch.Tensor) and not t.is_floating_point()
                 and t.dtype != torch.bool), None)


class RouterTap:
    """While on, records every call of the MoE ``blocks`` (``layer.mlp``): its input, and the expert
    ids its router (``block.gate``) returned. A block whose router the forward did not call as a
    module (a fused path) is routed again here from the recorded input. ``distinct()``: per
    block, the distinct experts of each call."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self.blocks = list(blocks)
        self.calls: list[list[dict]] = [[] for _ in self.blocks]
        self._handles = []

    def __enter__(self) -> "RouterTap":
        for calls, block in zip(self.calls, self.blocks):
            def record_input(module, args, kwargs, calls=calls):
                calls.append({"x": _first_tensor(args, kwargs), "ids": None})

            def record_ids(module, args, output, calls=calls):
                if calls:
                    calls[-1]["ids"] = expert_ids(output)

            self._handles.append(block.register_forward_pre_hook(record_input, with_kwargs=True))
            self._handles.append(block.gate.register_forward_hook(record_ids))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @torch.inference_mode()
    def distinct(self) -> list[list[int]]:
        counts = []
        for calls, block in zip(self.calls, self.blocks):
            per_call = []
            for call in calls:
                ids = call["ids"] if call["ids"] is not None else expert_ids(block.gate(call["x"]))
                if ids is None:
                    raise RuntimeError(f"{type(block.gate).__name__} returned no integer expert ids")
                per_call.append(int(torch.unique(ids).numel()))
            counts.append(per_call)
        return counts


class PassTap:
    """While on, records the tokens of every forward of ``model`` (its first tensor argument)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.tokens, self._handle = model, [], None

    def __enter__(self) -> "PassTap":
        def record(module, args, kwargs):
            ids = _first_tensor(args, kwargs)
            self.tokens.append(int(ids.shape[0]) if ids is not None else 0)

        self._handle = self.model.register_forward_pre_hook(record, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def tapped_passes(name: str, passes: PassTap, routers: RouterTap, cfg: DeepseekV3Config) -> tuple[list[Pass], bool]:
    """The Pass of every forward ``passes`` saw, with the experts ``routers`` saw (one call of each
    block a forward). Where the calls do not line up with the forwards (the blocks were not
    called as modules), every MoE layer counts min(experts, tokens * experts a token) instead,
    the most a pass can choose; the flag says whether the counts were measured."""
    distinct = routers.distinct()
    measured = all(len(calls) == len(passes.tokens) for calls in distinct)
    out = []
    for i, tokens in enumerate(passes.tokens):
        if measured:
            experts = [calls[i] for calls in distinct]
        else:
            experts = [min(cfg.n_routed_experts, tokens * cfg.num_experts_per_tok)] * len(routers.blocks)
        out.append(Pass(name, tokens, experts))
    return out, measured


class LayerKernels:
    """While on, counts what each of ``layers`` (name -> module) launches in its first call:
    torch.profiler around that call alone, the device synchronised before and after it. CUDA:
    device kernels; CPU (--smoke): torch ops, nested ones included (a stand-in, no claim)."""

    def __init__(self, layers: dict[str, nn.Module], cuda: bool) -> None:
        self.layers, self.cuda = layers, cuda
        self.counts: dict[str, int] = {}
        self._active: Optional[tuple[str, object]] = None
        self._handles = []

    def __enter__(self) -> "LayerKernels":
        for name, layer in self.layers.items():
            self._handles.append(layer.register_forward_pre_hook(lambda m, a, name=name: self._start(name)))
            self._handles.append(layer.register_forward_hook(lambda m, a, o, name=name: self._stop(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._active is not None:
            self._active[1].stop()
            self._active = None

    def _activities(self) -> list:
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]

    def _start(self, name: str) -> None:
        if name in self.counts or self._active is not None:
            return
        from torch.profiler import profile

        if self.cuda:
            torch.cuda.synchronize()
        prof = profile(activities=self._activities())
        prof.start()
        self._active = (name, prof)

    def _stop(self, name: str) -> None:
        if self._active is None or self._active[0] != name:
            return
        prof = self._active[1]
        if self.cuda:
            torch.cuda.synchronize()
        prof.stop()
        self._active = None
        self.counts[name] = count_trace_events(trace_events(prof), "kernel" if self.cuda else "cpu_op")


def trace_events(prof) -> list[dict]:
    """A profile's events, through its Chrome trace (a format stable across torch releases)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])


def count_trace_events(events: list[dict], category: str) -> int:
    """Events of ``category`` ("kernel": CUDA kernels; "cpu_op": torch ops)."""
    return sum(1 for e in events if str(e.get("cat", "")).lower() == category)


# ----------------------------------------------------------------------------------------- timing
class StepClock:
    """Times a step's device work. CUDA: events recorded just before and after the step is
    launched, the stream first held busy by a spin kernel (torch.cuda._sleep) that outlasts the
    host's launch, so the start event fires once the step is queued and the time is the device's
    (no launch latency, no host bookkeeping). Where a launch outlasted its spin (the spin is timed
    too) the time includes idle device time: counted in ``short_pads``, and the spin doubles. CPU
    (--smoke): the wall time of the call."""

    MIN_PAD_US = 1000.0
    MAX_PAD_US = 50_000.0

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.short_pads = 0
        self._cycles_per_us = self._calibrate() if cuda else 0.0

    @staticmethod
    def _calibrate() -> float:
        """The spin's cycles per us: the fastest of a few 2 ms spins after a 50 ms one (clocks up)."""
        if not hasattr(torch.cuda, "_sleep"):
            print("# torch.cuda._sleep is missing: steps are timed without a spin before them")
            return 0.0
        torch.cuda._sleep(100_000_000)
        rates = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(4_000_000)
            end.record()
            end.synchronize()
            rates.append(4_000_000 / (start.elapsed_time(end) * 1e3))
        return max(rates)

    def times_us(self, launch: Callable[[], object], finish: Optional[Callable[[object], object]],
                 iters: int, warmup: int) -> list[float]:
        """``iters`` times of ``launch()`` after ``warmup`` untimed ones, us; ``finish(result)``
        follows each, untimed (a worker's finish_step)."""
        times, host_us = [], []
        pad_us = self.MIN_PAD_US
        for i in range(warmup + iters):
            if i == warmup and host_us:  # three times the slowest warm-up launch
                pad_us = min(self.MAX_PAD_US, max(pad_us, 3 * max(host_us)))
            if not self.cuda:
                t0 = time.perf_counter()
                out = launch()
                times.append((time.perf_counter() - t0) * 1e6)
            else:
                spin, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                spin.record()
                if self._cycles_per_us:
                    torch.cuda._sleep(int(pad_us * self._cycles_per_us))
                start.record()
                t0 = time.perf_counter()
                out = launch()
                host_us.append((time.perf_counter() - t0) * 1e6)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
                if host_us[-1] > spin.elapsed_time(start) * 1e3:
                    self.short_pads += i >= warmup
                    pad_us = min(self.MAX_PAD_US, 2 * pad_us)
            if finish is not None:
                finish(out)
        return times[warmup:]


# ----------------------------------------------------------------------------------- collectives
class CollectiveTap:
    """Records the tensor-parallel collectives (Parallel.all_reduce, all_gather) called while
    active, as (op, shape, dtype) in call order; nothing at tp 1, which calls none."""

    OPS = ("all_reduce", "all_gather")

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> "CollectiveTap":
        for op in self.OPS:
            real = self._saved[op] = getattr(Parallel, op)

            def recorded(parallel: Parallel, x: torch.Tensor, _op=op, _real=real) -> torch.Tensor:
                if parallel.size > 1:
                    self.calls.append((_op, tuple(x.shape), x.dtype))
                return _real(parallel, x)

            setattr(Parallel, op, recorded)
        return self

    def __exit__(self, *exc) -> None:
        for op, real in self._saved.items():
            setattr(Parallel, op, real)


def collectives_us(parallel: Parallel, calls: Sequence[tuple[str, tuple[int, ...], torch.dtype]], device: str,
                   reps: int = 20) -> float:
    """The time of ``calls`` (CollectiveTap's), each kind timed alone on zeros of its shape (the
    fastest of ``reps``, every rank in the same order) and counted as often as it was called, us."""
    total = 0.0
    for op, shape, dtype in dict.fromkeys(calls):
        x = torch.zeros(shape, dtype=dtype, device=device)
        one = fastest_s(lambda: getattr(parallel, op)(x), device != "cpu", reps)
        total += one * 1e6 * calls.count((op, shape, dtype))
    return total


# ------------------------------------------------------------------------------------- bandwidth
def fastest_s(fn: Callable[[], object], cuda: bool, reps: int) -> float:
    """The fastest of ``reps`` calls of ``fn`` after one untimed, s (CUDA events, else wall)."""
    fn()
    best = math.inf
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(device: str, num_bytes: int, reps: int) -> dict[str, float]:
    """Read bandwidths in bytes/s: a bf16 tensor's sum, a GEMV over a bf16 matrix of that size (a
    decode GEMM's access pattern) and, on CUDA, the fastest copy (benchmarks.mla_kernels'
    copy_bandwidth, read + write). ``floor``: the fastest of them, the ceiling a floor assumes."""
    cuda, cols = device == "cuda", 1 << 14
    matrix = torch.ones(num_bytes // 2 // cols, cols, dtype=torch.bfloat16, device=device)
    vector = torch.ones(1, cols, dtype=torch.bfloat16, device=device)
    size = matrix.numel() * matrix.element_size()
    out = {"sum": size / fastest_s(lambda: matrix.sum(dtype=torch.float32), cuda, reps),
           "gemv": size / fastest_s(lambda: torch.nn.functional.linear(vector, matrix), cuda, reps)}
    matrix = vector = None  # freed before the copy takes its own 2 x num_bytes
    if cuda:
        try:
            from benchmarks.mla_kernels import copy_bandwidth

            out["copy"] = copy_bandwidth(num_bytes)
        except ImportError as err:
            print(f"# copy bandwidth skipped: {err}")
    out["floor"] = max(out.values())
    return out
