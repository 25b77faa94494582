"""The split-KV Triton MLA kernel (kernel), its Gluon wgmma tile for SM90 (wgmma, wgmma_fp8, tma), shared program
helpers (chunks) and the host-side launch planner (plan)."""
