"""Worker calls run with the worker's CUDA device current.

Torch runs tensor ops on their tensors' device, but other launches and records take the current
device: Triton launches its kernels on the current device's stream, an event records on the
current device's stream, a CUDA graph captures and replays there. A worker on another device
than the current one (an engine driving several GPUs from one process) would send those to the
wrong GPU; its entry points therefore make its device current for the call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

Method = TypeVar("Method", bound=Callable)


def on_device(method: Method) -> Method:
    """Wrap a method of an object with a ``device`` so that it runs with that device current
    (a CUDA device; others run as they are)."""

    @functools.wraps(method)
    def run(self, *args: Any, **kwargs: Any) -> Any:
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)

    return run
