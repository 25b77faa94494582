"""The split-KV Triton MLA kernel (kernel), its Gluon wgmma tile for SM90 (wgmma, wgmma_fp8, tma), shared program
helpers (chunks) and the host-side launch planner (plan); DeepSeek-V3.2's sparse passes on them: the indexer's
top-k (indexer) and attention over each token's selected rows (sparse)."""
