"""Several captured CUDA graphs run as one: each is a child-graph node of one executable graph.

Every kind of graph of a step stays a graph of its own (replayable alone), and a whole step is
still one launch: the CUDA driver clones each ``torch.cuda.CUDAGraph(keep_graph=True)`` into a
child node of a new graph, chained in order, and instantiates that graph once. The clones use the
captures' memory, which the torch graphs keep alive. Driver API through ctypes (libcuda ships
with the driver; torch exposes no graph composition).
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch

_CUDA: Optional[ctypes.CDLL] = None


def _driver() -> ctypes.CDLL:
    global _CUDA
    if _CUDA is None:
        _CUDA = ctypes.CDLL("libcuda.so.1")
    return _CUDA


def _check(result: int, call: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{call} failed: CUresult {result} ({(text.value or b'?').decode()})")


class JoinedGraph:
    """``graphs`` (captured with keep_graph=True) as one executable graph, run in the given order."""

    def __init__(self, graphs: Sequence[torch.cuda.CUDAGraph]) -> None:
        cu = _driver()
        self._graph, self._exec = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cu.cuGraphCreate(ctypes.byref(self._graph), 0), "cuGraphCreate")
        previous = None
        for g in graphs:
            node = ctypes.c_void_p()
            deps = (ctypes.c_void_p * 1)(previous) if previous is not None else None
            _check(cu.cuGraphAddChildGraphNode(ctypes.byref(node), self._graph, deps, int(previous is not None),
                                               ctypes.c_void_p(g.raw_cuda_graph())), "cuGraphAddChildGraphNode")
            previous = node
        _check(cu.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), self._graph, ctypes.c_ulonglong(0)),
               "cuGraphInstantiateWithFlags")
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(cu.cuGraphUpload(self._exec, stream), "cuGraphUpload")  # the first launch is not slower

    def launch(self) -> None:
        """Enqueue the joined graph on the current stream."""
        _check(_driver().cuGraphLaunch(self._exec, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "cuGraphLaunch")

    def __del__(self) -> None:
        cu = _CUDA
        if cu is None:
            return
        if self._exec.value:
            cu.cuGraphExecDestroy(self._exec)
        if self._graph.value:
            cu.cuGraphDestroy(self._graph)
