"""The SwiGLU MLP, its gate and up projections packed into one GEMM."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from specdec.models import gemv, ops
from specdec.models.packing import CheckpointViews, row_views


class MLP(CheckpointViews, nn.Module):
    """down(silu(gate(x)) * up(x)); ``gate_up`` ``[2I, D]`` stacks the checkpoint's gate_proj and
    up_proj weights: one GEMM whose epilogue pairs gate and up into silu(gate) * up
    (gemv.linear_silu), then down's."""

    _packed = ("gate_up",)

    def __init__(self, hidden: int, inter: int, dtype: Optional[torch.dtype] = None, device: Any = None) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up = nn.Parameter(torch.empty(2 * inter, hidden, dtype=dtype, device=device))
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)
        for w in row_views(self.gate_up.data, {"gate": inter, "up": inter}).values():  # as two nn.Linear would
            nn.init.kaiming_uniform_(w, a=5 ** 0.5)

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        return row_views(self.gate_up, {"gate_proj.weight": self.inter, "up_proj.weight": self.inter})

    def forward(self, x: torch.Tensor, then: Optional[ops.AddNorm] = None):
        """x ``[T, D]`` -> ``[T, D]``; given ``then``, then(that): (norm, h) ``[T, D]`` each."""
        out = gemv.linear(gemv.linear_silu(x, self.gate_up), self.down_proj.weight)
        return out if then is None else then(out)
