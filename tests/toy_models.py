"""A target and an EAGLE draft written from specdec.draft's TargetModel and DraftModel alone (no
specdec.models code): the smallest models an engine could hand the worker.

Each attention layer maps the hidden state straight to an absorbed query ``[T, H, 576]`` and a
latent kv row ``[T, 576]``; positions enter through an embedding (no rotary), which is all the
contract asks of them: they come from ``positions``, never from the batch.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from torch import nn

from attn.base import KV_DIM, KV_LORA_RANK, LayerSpec

MAX_POSITIONS = 256


class ToyAttention(nn.Module):
    """hidden ``[T, D]`` -> backend.forward(q, kv_new, layer_id) -> hidden ``[T, D]`` (residual)."""

    def __init__(self, hidden: int, heads: int, layer_id: int) -> None:
        super().__init__()
        self.heads, self.layer_id = heads, layer_id
        self.q = nn.Linear(hidden, heads * KV_DIM)
        self.kv = nn.Linear(hidden, KV_DIM)
        self.o = nn.Linear(heads * KV_LORA_RANK, hidden)

    def forward(self, x: torch.Tensor, backend, batch) -> torch.Tensor:
        out = backend.forward(self.q(x).view(-1, self.heads, KV_DIM), self.kv(x), self.layer_id, batch)
        return x + self.o(out.flatten(1))


class ToyTarget(nn.Module):
    """Token and position embeddings, ``layers`` ToyAttention layers, a head. Its weights are scaled
    up so that its logits have clear maxima (greedy decoding meets no near-ties)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 2, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(vocab_size=vocab, hidden_size=hidden)
        self.num_attention_layers = layers
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(MAX_POSITIONS, hidden)
        self.layers = nn.ModuleList(ToyAttention(hidden, heads, i) for i in range(layers))
        self.head = nn.Linear(hidden, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(3)
        self.eval()

    def attn_spec(self) -> LayerSpec:
        return LayerSpec(self.heads, KV_DIM ** -0.5)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, backend, batch) -> torch.Tensor:
        x = self.embed(ids) + self.pos(positions)
        for layer in self.layers:
            x = layer(x, backend, batch)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()


class ToyEagleDraft(nn.Module):
    """An EAGLE head over ``target``: [its token embedding; hidden_in] -> fc -> one ToyAttention
    layer -> the target's head (embedding and head shared, as DeepSeek's MTP shares them)."""

    needs_hidden_in = True
    num_attention_layers = 1

    def __init__(self, target: ToyTarget, seed: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.vocab_size, self.hidden_size = target.config.vocab_size, target.config.hidden_size
        self.embed, self.head = target.embed, target.head
        self.fc = nn.Linear(2 * self.hidden_size, self.hidden_size)
        self.layer = ToyAttention(self.hidden_size, target.heads, 0)
        self.heads = target.heads
        self.eval()

    def attn_spec(self) -> LayerSpec:
        return LayerSpec(self.heads, KV_DIM ** -0.5)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden_in: torch.Tensor, backend, batch) -> torch.Tensor:
        return self.layer(self.fc(torch.cat([self.embed(ids), hidden_in], dim=-1)), backend, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()


def noisy_twin(target: ToyTarget, noise: float = 0.3, seed: int = 9) -> ToyTarget:
    """A copy of ``target`` whose head weights carry Gaussian noise (``noise`` times their std): as
    a standalone draft it agrees with the target part of the time, so steps accept 0 to num_steps
    tokens."""
    twin = copy.deepcopy(target)
    weight = twin.head.weight
    with torch.no_grad():
        weight.add_(noise * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)))
    return twin
