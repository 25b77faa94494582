"""specdec: EAGLE speculative decoding for MLA (DeepSeek-V3-architecture) models."""
