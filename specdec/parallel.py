"""Tensor parallelism: which slice of the model this process holds, and the collectives that join them.

One process per GPU (or CPU process, over gloo), all in lockstep, torch.distributed as the
transport. A rank holds 1/tp of the attention heads, of each MLP's (and expert's) intermediate
and of the vocabulary; everything else is replicated. Every rank then computes the same hidden
states (an all-reduce hands every rank the same sum) and the same full-vocabulary logits, so the
worker above makes the same decisions on every rank without exchanging any.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallel:
    """size / rank of this process in its tensor-parallel group; ``group`` None: the default group.

    ``Parallel()`` is one process (no collective is ever called). Inside torchrun (or after
    ``torch.distributed.init_process_group``) ``Parallel.from_distributed()`` takes the world.
    """

    size: int = 1
    rank: int = 0
    group: Optional[Any] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and isinstance(self.rank, int) and self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"Parallel needs an int size >= 1 and a rank in [0, size); got size={self.size!r}, "
                             f"rank={self.rank!r}")
        if self.size > 1 and not dist.is_initialized():
            raise ValueError(f"Parallel(size={self.size}) needs torch.distributed initialised (torchrun, or "
                             "init_process_group) before the model is built")

    @classmethod
    def from_distributed(cls, group: Optional[Any] = None) -> "Parallel":
        """This process's place in ``group`` (default: the world) of an initialised torch.distributed."""
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: run under torchrun, or call "
                             "torch.distributed.init_process_group first")
        return cls(dist.get_world_size(group), dist.get_rank(group), group)

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal slice of ``total`` items, or ValueError naming
        ``what`` when tp does not divide it (e.g. "num_attention_heads")."""
        if total % self.size:
            raise ValueError(f"tensor parallelism over {self.size} ranks needs {what} divisible by {self.size}; "
                             f"got {total}")
        length = total // self.size
        return self.rank * length, length

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (in place), identical on every rank."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` per rank -> ``[..., size * n]``, rank r's slice at ``[r * n, (r + 1) * n)``."""
        return x if self.size == 1 else torch.cat(self._gather(x), dim=-1)

    def same_on_all_ranks(self, x: torch.Tensor) -> bool:
        """Whether every rank holds an equal ``x`` (a debug check: it gathers every rank's copy)."""
        parts = [x] if self.size == 1 else self._gather(x)
        return all(torch.equal(parts[0], p) for p in parts[1:])

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x``, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts


SINGLE = Parallel()


def launch_problem(tp: int, device: torch.device) -> Optional[str]:
    """Why this process cannot be one of ``tp`` tensor-parallel ranks on ``device`` (cpu or cuda),
    or None: tp is an int >= 1; above 1 the process runs under torchrun with WORLD_SIZE == tp and,
    on CUDA, its LOCAL_RANK names a device of this machine. Reads the environment only."""
    if not isinstance(tp, int) or tp < 1:
        return f"tensor parallelism needs an int >= 1 ranks, got {tp!r}"
    if tp == 1:
        return None
    world = os.environ.get("WORLD_SIZE")
    if world != str(tp):
        return f"tensor parallelism over {tp} ranks runs under torchrun --nproc-per-node {tp} (WORLD_SIZE is {world})"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.device(device).type == "cuda" and local >= torch.cuda.device_count():
        return (f"rank {local} of {tp} runs on cuda:{local}, and this machine has {torch.cuda.device_count()} CUDA "
                "device(s)")
    return None


def start_ranks(tp: int, device: torch.device) -> tuple[Parallel, torch.device]:
    """This process's rank of ``tp`` and its device: (SINGLE, device) at tp 1; above, the world
    group of a freshly initialised torch.distributed (NCCL over cuda:LOCAL_RANK, made the current
    device, or gloo on the CPU). ValueError with launch_problem's reason before anything starts."""
    problem = launch_problem(tp, device)
    if problem:
        raise ValueError(problem)
    device = torch.device(device)
    if tp == 1:
        return SINGLE, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Parallel.from_distributed(), device
