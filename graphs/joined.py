"""Several captured CUDA graphs run as one: each is a child-graph node of one executable graph.

Every kind of graph of a step stays a graph of its own (replayable alone), and a whole step is
still one launch: the CUDA driver clones each ``torch.cuda.CUDAGraph(keep_graph=True)`` into a
child node of a new graph, chained in order, and instantiates that graph once. The clones use the
captures' memory, which the torch graphs keep alive. Driver API through ctypes (libcuda ships
with the driver; torch exposes no graph composition). A driver call needs a context current on
the calling thread, which torch's runtime calls make lazily: a thread whose first GPU work is
this launch (an engine's scheduler thread, in a step of an unchanged batch) has none, so the
graph holds its device's primary context and makes it current around each call where another
(or none) is.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch

_CUDA: Optional[ctypes.CDLL] = None


def _driver() -> ctypes.CDLL:
    global _CUDA
    if _CUDA is None:
        cu = ctypes.CDLL("libcuda.so.1")
        p, pp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        signatures = {  # handles are pointers: 64-bit arguments, never C ints
            "cuGraphCreate": [pp, ctypes.c_uint],
            "cuGraphAddChildGraphNode": [pp, p, pp, ctypes.c_size_t, p],
            "cuGraphInstantiateWithFlags": [pp, p, ctypes.c_ulonglong],
            "cuGraphUpload": [p, p],
            "cuGraphLaunch": [p, p],
            "cuGraphExecDestroy": [p],
            "cuGraphDestroy": [p],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [pp, ctypes.c_int],
            "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
            "cuCtxGetCurrent": [pp],
            "cuCtxPushCurrent_v2": [p],
            "cuCtxPopCurrent_v2": [pp],
        }
        for name, args in signatures.items():
            getattr(cu, name).argtypes = args
            getattr(cu, name).restype = ctypes.c_int
        _CUDA = cu
    return _CUDA


def _check(result: int, call: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{call} failed: CUresult {result} ({(text.value or b'?').decode()})")


class JoinedGraph:
    """``graphs`` (captured with keep_graph=True on ``device``) as one executable graph, run in the
    given order."""

    def __init__(self, graphs: Sequence[torch.cuda.CUDAGraph], device: torch.device) -> None:
        self._graph, self._exec, self._ctx = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._children = tuple(graphs)  # their memory pool must outlive the clones
        self._device = torch.device(device)
        cu = _driver()
        self._cu_device = ctypes.c_int()
        index = torch.cuda.current_device() if self._device.index is None else self._device.index
        _check(cu.cuDeviceGet(ctypes.byref(self._cu_device), index), "cuDeviceGet")
        _check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), self._cu_device), "cuDevicePrimaryCtxRetain")
        pushed = self._make_current()
        try:
            _check(cu.cuGraphCreate(ctypes.byref(self._graph), 0), "cuGraphCreate")
            previous = None
            for g in graphs:
                node = ctypes.c_void_p()
                deps = ctypes.byref(previous) if previous is not None else None
                _check(cu.cuGraphAddChildGraphNode(ctypes.byref(node), self._graph, deps, int(previous is not None),
                                                   g.raw_cuda_graph()), "cuGraphAddChildGraphNode")
                previous = node
            _check(cu.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), self._graph, 0),
                   "cuGraphInstantiateWithFlags")
            _check(cu.cuGraphUpload(self._exec, torch.cuda.current_stream(self._device).cuda_stream),
                   "cuGraphUpload")  # the first launch is not slower
        finally:
            self._restore(pushed)

    def launch(self) -> None:
        """Enqueue the joined graph on the device's current stream."""
        stream = torch.cuda.current_stream(self._device).cuda_stream
        pushed = self._make_current()
        try:
            _check(_driver().cuGraphLaunch(self._exec, stream), "cuGraphLaunch")
        finally:
            self._restore(pushed)

    def _make_current(self) -> bool:
        """Push the device's primary context where the thread has another or none current; True
        if pushed (the caller pops it with _restore, leaving the thread as it was)."""
        cu, current = _driver(), ctypes.c_void_p()
        _check(cu.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value == self._ctx.value:
            return False
        _check(cu.cuCtxPushCurrent_v2(self._ctx), "cuCtxPushCurrent")
        return True

    @staticmethod
    def _restore(pushed: bool) -> None:
        if pushed:
            _driver().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def __del__(self) -> None:
        cu = _CUDA
        if cu is None or not self._ctx.value:
            return
        try:
            try:
                pushed = self._make_current()  # destruction may run on any thread (garbage collection)
            except RuntimeError:  # a driver shutting down: nothing left to destroy in
                return
            try:
                if self._exec.value:
                    cu.cuGraphExecDestroy(self._exec)
                if self._graph.value:
                    cu.cuGraphDestroy(self._graph)
            finally:
                self._restore(pushed)
        finally:
            cu.cuDevicePrimaryCtxRelease_v2(self._cu_device)
