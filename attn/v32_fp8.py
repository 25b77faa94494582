"""FlashMLA's DeepSeek-V3.2 fp8 cache row (kv_dtype ``fp8_v32``): 656 bytes a token, stored as uint8.

A 576-wide latent row is kept as its 512 NoPE values in e4m3, in 4 tiles of 128 each scaled by
its absolute maximum / 448, then the 4 fp32 scales, then the 64 RoPE values in bf16: the layout
FlashMLA's SM90 sparse decode reads (``flash_mla_with_kvcache`` with indices). The scales travel
in the row, so a pool of these rows has no per-tensor kv_scale (it is 1).

E.g. a row whose first tile is all 2.0: scale 2 / 448 in bytes 512-515, that tile's 128 bytes
e4m3 448 (0x7e); its RoPE values come back exactly.
"""

from __future__ import annotations

import torch

KV_LORA_RANK = 512  # (attn.base's; attn.base imports this module)
V32_FP8_BYTES = 656  # 512 e4m3 NoPE values, 4 fp32 scales, 64 bf16 RoPE values
V32_FP8_DTYPE = torch.uint8  # the pool's storage dtype for these rows
NOPE_TILE = 128  # NoPE values per scale
_SCALES = KV_LORA_RANK // NOPE_TILE
_FP8_MAX = 448.0


def quantize_v32(rows: torch.Tensor) -> torch.Tensor:
    """``[..., 576]`` latent rows (any float dtype) -> ``[..., 656]`` uint8 V3.2 fp8 rows."""
    nope = rows[..., :KV_LORA_RANK].float().unflatten(-1, (_SCALES, NOPE_TILE))
    scale = (nope.abs().amax(-1, keepdim=True) / _FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    quantized = (nope / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
    parts = (quantized.view(torch.uint8), scale.squeeze(-1).contiguous().view(torch.uint8),
             rows[..., KV_LORA_RANK:].to(torch.bfloat16).contiguous().view(torch.uint8))
    return torch.cat(parts, dim=-1)


def dequantize_v32(packed: torch.Tensor) -> torch.Tensor:
    """``[..., 656]`` uint8 V3.2 fp8 rows -> ``[..., 576]`` fp32: quantize_v32's inverse up to its
    rounding (e4m3's 3 mantissa bits, relative to each tile's maximum; RoPE exact)."""
    nope = packed[..., :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).float()
    scale = packed[..., KV_LORA_RANK:KV_LORA_RANK + 4 * _SCALES].contiguous().view(torch.float32)
    rope = packed[..., KV_LORA_RANK + 4 * _SCALES:].contiguous().view(torch.bfloat16).float()
    nope = (nope.unflatten(-1, (_SCALES, NOPE_TILE)) * scale[..., None]).flatten(-2)
    return torch.cat([nope, rope], dim=-1)
