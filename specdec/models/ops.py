"""The decode forward's fused elementwise steps: one kernel each on a GPU, plain torch elsewhere.

Triton kernels where they run (CUDA tensors, no autograd: training takes the torch path, which has
a backward); the torch path is the same arithmetic and is what CPU runs and tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate ++ up) -> silu(gate) * up ``[T, I]`` in the input dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
