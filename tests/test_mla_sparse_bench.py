"""benchmarks/mla_sparse.py's host-side parts on the CPU: FlashMLA's V3.2 fp8 row layout, the drawn
selections and the target's verdict (the timing needs a GPU)."""

import math

import torch

from attn.base import KV_LORA_RANK
from benchmarks.mla_sparse import NOPE_TILE, PAGE_SIZE, V32_FP8_BYTES, draw_slots, targets, to_v32_fp8


def from_v32_fp8(packed: torch.Tensor) -> torch.Tensor:
    """to_v32_fp8's inverse up to its rounding: ``[..., 656]`` uint8 -> ``[..., 576]`` fp32."""
    nope = packed[..., :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).float()
    scale = packed[..., KV_LORA_RANK:KV_LORA_RANK + 16].contiguous().view(torch.float32)
    rope = packed[..., KV_LORA_RANK + 16:].contiguous().view(torch.bfloat16).float()
    nope = (nope.unflatten(-1, (-1, NOPE_TILE)) * scale[..., None]).flatten(-2)
    return torch.cat([nope, rope], dim=-1)


def test_v32_fp8_rows_hold_scaled_nope_tiles_then_bf16_rope():
    rows = torch.randn(3, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows[0, :128] = 2.0
    packed = to_v32_fp8(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (3, V32_FP8_BYTES)
    # a tile of all 2.0: scale 2 / 448, every value e4m3 448 (0x7e)
    assert packed[0, 512:516].view(torch.float32).item() == torch.tensor(2.0 / 448).item()
    assert (packed[0, :128] == 0x7E).all()
    for r in range(3):  # each tile's scale is its absolute maximum / 448
        tiles = rows[r, :512].float().view(4, 128)
        torch.testing.assert_close(packed[r, 512:528].view(torch.float32), tiles.abs().amax(-1) / 448)
    back = from_v32_fp8(packed)
    assert torch.equal(back[:, 512:], rows[:, 512:].float())  # the RoPE part is kept exactly
    tile_max = rows[:, :512].float().view(3, 4, 128).abs().amax(-1, keepdim=True)
    error = (back[:, :512] - rows[:, :512].float()).view(3, 4, 128).abs()
    assert (error <= tile_max * 2**-4).all() and error.max() > 0  # e4m3's 3 mantissa bits, relative to the tile


def test_selections_are_distinct_positions_of_each_tokens_own_request():
    g = torch.Generator().manual_seed(1)
    pages = torch.tensor([[5, 2, 7], [0, 3, 6]], dtype=torch.int32)  # 2 requests of 3 pages (192 tokens)
    slots = draw_slots(pages, 150, 2, 64, g)
    assert slots.shape == (4, 64) and slots.dtype == torch.int32
    for token in range(4):
        table = pages[token // 2].tolist()  # tokens 0-1 are request 0's, 2-3 request 1's
        chosen = slots[token].tolist()
        assert len(set(chosen)) == 64 and {s // PAGE_SIZE for s in chosen} <= set(table)
        assert max(table.index(s // PAGE_SIZE) * PAGE_SIZE + s % PAGE_SIZE for s in chosen) < 150  # within context
    short = draw_slots(pages, 40, 1, 64, g)  # a context shorter than topk: all 40 rows, then -1
    assert (short[:, 40:] == -1).all()
    assert sorted(short[0, :40].tolist()) == [int(pages[0, 0]) * PAGE_SIZE + i for i in range(40)]


def test_the_target_is_flashmlas_speed_where_it_ran():
    assert targets(dict(speedup_vs_flashmla=1.0)) == "flashmla:yes"
    assert targets(dict(speedup_vs_flashmla=0.99)) == "flashmla:no"
    assert targets(dict(speedup_vs_flashmla=math.nan)) == "-"
