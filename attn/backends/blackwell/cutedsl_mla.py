"""FlashInfer CuTe-DSL MLA decode (Blackwell, SM100 family): decode only.

Prefill and draft-extend fall back to trtllm_mla (attn.registry). The cute-dsl kernel writes
split-KV partials into its workspace, so it owns one of its own (attn.workspace): never
trtllm-gen's, whose zero-initialised multi-CTA counters some FlashInfer versions keep there.
"""

from __future__ import annotations

from attn.backends.blackwell.trtllm_mla import TrtllmMLABackend


class CuteDslMLABackend(TrtllmMLABackend):
    name = "cutedsl_mla"
    kernel_family = "cute_dsl"
    flashinfer_backend = "cute-dsl"
    supports_prefill = False
    supports_draft_extend = False
    prefill_fallback = "trtllm_mla"
    # FlashInfer's cute-dsl entry point takes block tables of whole 128-token blocks.
    table_tokens_multiple = 128
    skipped_heads = range(0)  # cute-dsl takes every head count up to 128
    multi_cta_counters = False
    compiles_per_q_len = True
    supports_sparse = False  # FlashInfer's sparse MLA is trtllm-gen's
