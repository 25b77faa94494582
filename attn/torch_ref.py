"""The plain-torch backend: the reference every other backend is tested against. Runs anywhere."""

from __future__ import annotations

from attn.paged import RaggedKernelBackend
from attn.reference import paged_mla_reference


class TorchRefBackend(RaggedKernelBackend):
    """Paged MLA attention in plain torch (fp32 math); supports tree masks and CUDA graphs."""

    name = "torch_ref"
    kernel_family = "torch_ref"
    kv_dtypes = (*RaggedKernelBackend.kv_dtypes, "fp64")  # any cache dtype: attention math is fp32 regardless

    def _run_ragged_kernel(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, custom_mask,
                           max_seq_len):
        return paged_mla_reference(
            query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, self.layer.sm_scale,
            custom_mask=custom_mask, kv_scale=self.bmm2_scale(),
        )
