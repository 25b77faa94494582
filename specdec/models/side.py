"""Work beside the current stream: a chain of kernels that needs nothing queued after it starts
runs on a second stream of the device and is joined before its result is read.

Why: at decode, chains of latency-bound kernels leave most of the GPU idle; two independent ones
on two streams overlap (in a captured CUDA graph, two branches). MoE runs its shared expert beside
the router, its choice and the block layout.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

import torch

T = TypeVar("T")
_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream, one a process (cuBLAS keeps a workspace for each stream it runs on)."""
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


class Beside(Generic[T]):
    """``fn(x)`` queued on the side stream after everything queued so far on the current stream
    (CUDA x), or run right away (any other device); :meth:`join` makes the current stream wait for
    it and returns its result. x must stay alive until the join (the caller holds it), so the
    current stream cannot reuse its memory while the side stream reads it.

    E.g. ``shared = Beside(mlp, x); routed = experts(x); out = routed + shared.join()``.
    """

    def __init__(self, fn: Callable[[torch.Tensor], T], x: torch.Tensor) -> None:
        self._main = torch.cuda.current_stream(x.device) if x.is_cuda else None
        if self._main is None:
            self._result = fn(x)
            return
        side = side_stream(x.device)
        side.wait_stream(self._main)
        with torch.cuda.stream(side):
            self._result = fn(x)
        self._side = side

    def join(self) -> T:
        if self._main is not None:
            self._main.wait_stream(self._side)
        return self._result
