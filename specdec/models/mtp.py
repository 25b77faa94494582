"""DeepSeek's MTP layer used as the EAGLE draft model."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from attn.base import AttnBatch, LayerSpec
from specdec.models import gemv, ops
from specdec.models.config import DeepseekV3Config
from specdec.models.deepseek import (
    DecoderLayer, DeepseekV3ForCausalLM, MLAttention, RMSNorm, RotaryEmbedding, VocabEmbedding, check_inputs,
    local_heads, logits_and_picks, softmax_scale,
)
from specdec.parallel import SINGLE, Parallel


class SharedHead(nn.Module):
    """The checkpoint's ``shared_head``: final norm and vocabulary projection of the MTP layer."""

    def __init__(self, norm: RMSNorm, head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.head = norm, head


class DeepseekMTP(nn.Module):
    """enorm(embed(token)) ++ hnorm(hidden_in) -> eh_proj -> one decoder layer -> shared_head.norm.

    forward(input_ids ``[T]``, positions ``[T]``, hidden_in ``[T, D]``, backend, batch) -> hidden
    ``[T, D]`` after shared_head.norm: the hidden_in of the next draft step, and what
    compute_logits reads. Token t at position p pairs with the hidden state that predicted it
    (the target's, or the draft's own while drafting). Its attention is layer 0 of the draft's
    own KV pool; the decoder layer is MoE or dense as layer ``num_hidden_layers`` of the config.

    Embedding and head: ``embed_tokens`` / ``head`` modules passed in are shared; otherwise the
    target's (``target=``) are shared; otherwise the layer gets its own (the public checkpoint
    stores its own copies; see loader.load_mtp). parallel: the target's tensor-parallel slice
    (by default the target's; one process without a target).
    """

    num_attention_layers = 1
    needs_hidden_in = True  # the target's hidden state at the previous position (DraftModel)
    attention: type = MLAttention  # its decoder layer's attention class (V3.2: the sparse one)

    def __init__(
        self,
        config: DeepseekV3Config,
        target: Optional[DeepseekV3ForCausalLM] = None,
        dtype: Optional[torch.dtype] = None,
        device: Any = None,
        *,
        embed_tokens: Optional[VocabEmbedding] = None,
        head: Optional[nn.Linear] = None,
        parallel: Optional[Parallel] = None,
    ) -> None:
        super().__init__()
        if parallel is None:
            parallel = target.parallel if target is not None else SINGLE
        self.config, self.parallel = config, parallel
        fk = {"dtype": dtype, "device": device}
        d, eps = config.hidden_size, config.rms_norm_eps
        if target is not None:
            if target.parallel != parallel:
                raise ValueError(f"the MTP layer's parallel ({parallel}) must be its target's ({target.parallel})")
            embed_tokens = target.embed_tokens if embed_tokens is None else embed_tokens
            head = target.lm_head if head is None else head
        if embed_tokens is None:
            embed_tokens = VocabEmbedding(config.vocab_size, d, parallel, **fk)
        if head is None:
            head = nn.Linear(d, parallel.shard(config.vocab_size, "vocab_size")[1], bias=False, **fk)
        self.embed_tokens = embed_tokens
        self.enorm = RMSNorm(d, eps, **fk)
        self.hnorm = RMSNorm(d, eps, **fk)
        self.eh_proj = nn.Linear(2 * d, d, bias=False, **fk)
        self.layer = DecoderLayer(config, config.num_hidden_layers, 0, parallel, **fk, attention=self.attention)
        self.shared_head = SharedHead(RMSNorm(d, eps, **fk), head)
        self.rotary = RotaryEmbedding(config, device)
        # cache_token_projection's table [V, D] and eh_proj's hidden half [D, D], or None
        self.register_buffer("token_table", None, persistent=False)
        self.register_buffer("eh_hidden", None, persistent=False)

    @property
    def hidden_size(self) -> int:
        """The width of forward's output: the target's (DraftModel)."""
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        """The width of compute_logits' logits: the head's (shared or its own)."""
        return self.shared_head.head.out_features * self.parallel.size

    def attn_spec(self) -> LayerSpec:
        return LayerSpec(local_heads(self.config, self.parallel), softmax_scale(self.config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_in: torch.Tensor, backend, batch: AttnBatch) -> torch.Tensor:
        check_inputs(input_ids, positions, self.config.vocab_size)
        if hidden_in.shape != (input_ids.shape[0], self.config.hidden_size):
            raise ValueError(f"hidden_in must be [T={input_ids.shape[0]}, {self.config.hidden_size}]; got {tuple(hidden_in.shape)}")
        if self.token_table is not None and not self.training:
            x = gemv.linear_add_rows(self.hnorm(hidden_in), self.eh_hidden, self.token_table, input_ids)
        else:
            x = gemv.linear(self._eh_input(input_ids, hidden_in), self.eh_proj.weight)
        h, residual = self.layer.input_layernorm.residual(x, None)
        return self.layer(h, residual, self.rotary(positions), backend, batch, self.shared_head.norm)[0]

    @torch.no_grad()
    def cache_token_projection(self, chunk: int = 4096) -> int:
        """Precompute eh_proj's embedding half for every token, table[t] = eh_proj.weight[:, :D] @
        enorm(embed(t)) ``[V, D]`` (fp32 products rounded to the model's dtype), and keep the hidden
        half ``[D, D]`` contiguous: forward (in eval mode) then reads that half of eh_proj and a
        table row a token (linear_add_rows) where it read all of eh_proj. Returns the bytes the two
        hold, e.g. the rank slice (V 16160, D 7168): 232 + 103 MB for reading 103 MB less a pass.

        The output differs from eh_proj's by the table's rounding (half a unit of the model's dtype
        in the embedding half's sum). A cache of the weights as they are: call it again after they
        change. Under tensor parallelism (a rank's vocabulary slice) it is refused."""
        embed, d = self.embed_tokens, self.config.hidden_size
        if self.parallel.size > 1 or type(embed) is not VocabEmbedding:
            raise ValueError("cache_token_projection takes the whole embedding table of one process (a VocabEmbedding "
                             f"at tensor-parallel size 1), not {type(embed).__name__} at size {self.parallel.size}")
        w_embed = self.eh_proj.weight[:, :d].float()
        table = torch.empty_like(embed.weight)
        for start in range(0, table.shape[0], chunk):
            rows = self.enorm(embed.weight[start:start + chunk])
            table[start:start + chunk] = (rows.float() @ w_embed.T).to(table.dtype)
        self.token_table, self.eh_hidden = table, self.eh_proj.weight[:, d:].contiguous()
        return sum(t.numel() * t.element_size() for t in (self.token_table, self.eh_hidden))

    def _eh_input(self, input_ids: torch.Tensor, hidden_in: torch.Tensor) -> torch.Tensor:
        """enorm(embed(ids)) ++ hnorm(hidden_in) ``[T, 2D]``: one kernel (ops.mtp_input) on the
        Triton path where the embedding is a whole table (not a rank's vocabulary slice, whose lookup
        sums the ranks') and the three modules are ours (that kernel runs no module hooks)."""
        embed, enorm, hnorm = self.embed_tokens, self.enorm, self.hnorm
        if (type(embed) is VocabEmbedding and embed.parallel.size == 1 and type(enorm) is RMSNorm
                and type(hnorm) is RMSNorm and ops.on_triton(hidden_in, embed.weight, enorm.weight, hnorm.weight)):
            return ops.mtp_input(input_ids, embed.weight, hidden_in, enorm.weight, hnorm.weight, enorm.eps, hnorm.eps)
        return torch.cat([enorm(embed(input_ids)), hnorm(hidden_in)], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, D]`` -> logits ``[N, vocab]`` fp32."""
        return self.parallel.all_gather(gemv.linear(hidden, self.shared_head.head.weight, torch.float32))

    def compute_logits_argmax(self, hidden: torch.Tensor):
        """(compute_logits(hidden), the rows' greedy picks or None): logits_and_picks."""
        return logits_and_picks(self, hidden, self.shared_head.head.weight)
