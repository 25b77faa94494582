"""CPU checks of the Gluon wgmma tile (attn/kernels/triton_mla/wgmma.py); its numerics are checked on the GPU
by tests/test_triton_mla_kernel.py, which reaches it through mla_paged_attention on SM90.

The kernel is compiled for sm_90a without a GPU (Triton's compiler and its bundled ptxas) in the
configurations mla_paged_attention launches: it must fit one SM's shared memory, not spill, and
keep its wgmma pipelined.
"""

import re
import subprocess

import pytest
import torch

from attn.kernels.triton_mla import wgmma as wgmma_tile
from attn.kernels.triton_mla.plan import LaunchPlan, TileShape, launch_config, narrow_partials, select_config
from attn.kernels.triton_mla.tma import flat_rows, row_descriptors

H100_SMEM_PER_BLOCK = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on SM90

needs_gluon = pytest.mark.skipif(wgmma_tile.gluon is None, reason="needs Triton with Gluon")


def _descriptor_type(block_shape: list[int], dtype: str = "bf16") -> str:
    from triton.experimental.gluon import language as gl

    gl_dtype = {"bf16": gl.bfloat16, "fp8e4nv": gl.float8e4nv}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block_shape, gl_dtype)
    return f"tensordesc<{dtype}[{block_shape[0]}, {block_shape[1]}],{layout!r}>"


def compile_sm90(tile: TileShape, num_heads: int, has_mask: bool, direct: bool, block_n: int, num_stages: int,
                 out_dtype: str, kv_fp8: bool = False, sparse: bool = False):
    """Compile the kernel as _launch (sparse: sparse_mla_decode) would launch it, writing
    ``out_dtype`` ("bf16" or "fp32": the output or the split partials), over a bf16 or (kv_fp8)
    fp8 cache: (compiled kernel, its PTX, the ptxas path)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    kv_dtype = "fp8e4nv" if kv_fp8 else "bf16"
    ints = ["stride_bt", "stride_mb", "stride_mq", "stride_ot", "stride_oh", "stride_os",
            "stride_lt", "stride_lh", "num_splits", "mask_len"]
    box = wgmma_tile.query_box_rows(tile.block_h)
    signature = dict(q_nope_desc=_descriptor_type([box, 512]), q_pe_desc=_descriptor_type([box, 64]),
                     kv_nope_desc=_descriptor_type([block_n, 512], kv_dtype),
                     kv_pe_desc=_descriptor_type([block_n, 64], kv_dtype), bt_ptr="*i32", seq_lens_ptr="*i32",
                     cu_q_ptr="*i32", mask_ptr="*u8" if has_mask else "*i32", o_ptr=f"*{out_dtype}",
                     lse_ptr="*fp32", **{name: "i32" for name in ints}, qk_scale="fp32", v_scale="fp32",
                     kv_ptr="*" + kv_dtype, stride_kv_page="i32", stride_kv_row="i32", slots_ptr="*i32",
                     stride_st="i32", num_slots="i32", chunk="i32")
    constants = dict(PAGE_SIZE=16 if sparse else 64, NUM_HEADS=num_heads, BLOCK_H=tile.block_h, BLOCK_Q=tile.block_q,
                     MIN_CHUNK=128, HAS_MASK=has_mask, DIRECT=direct, NUM_STAGES=num_stages,
                     KV_FP8=kv_fp8, PDL=True, SPARSE=sparse)
    signature.update({name: "constexpr" for name in constants})
    # As the launcher specialises them: pointers 16-byte aligned, the strides of the partials and
    # the output (multiples of 512) divisible by 16; what vectorises its loads and stores.
    aligned = [name for name in signature if name.endswith("_ptr") or name in (
        "stride_ot", "stride_oh", "stride_os", "stride_kv_page", "stride_kv_row")]
    attrs = {(list(signature).index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = GluonASTSource(wgmma_tile._mla_wgmma_kernel, signature, constants, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=wgmma_tile.NUM_WARPS))
    ptxas = get_ptxas(90).path
    return kernel, kernel.asm["ptx"], ptxas


@needs_gluon
@pytest.mark.parametrize("num_heads, q_len, has_mask, direct, kv_fp8", [
    (128, 1, False, False, False),  # decode, 16-bit split-KV partials
    (16, 4, True, True, False),  # tree verify, one split
    (128, 4, False, True, False),  # causal verify
    (16, 1, False, False, False),  # widened decode: a quarter of the rows queries, fp32 partials
    (128, 1, False, False, True),  # fp8 cache: decode
    (16, 4, True, True, True),  # fp8 cache: tree verify
    (16, 1, False, False, True),  # fp8 cache: widened decode, fp32 partials
    (8, 1, False, False, False),  # the fewest heads a box of one token holds (serves_heads): 8 rows
    (8, 4, True, True, True),  # and their tree verify over an fp8 cache
    (4, 16, True, True, False),  # 4 heads: boxes of two tokens' heads, tree verify
    (2, 32, False, False, True),  # 2 heads, four tokens a box: causal verify over an fp8 cache, split partials
    (1, 64, False, True, False),  # 1 head, eight tokens a box: extend
])
def test_compiles_for_sm90_within_shared_memory_without_spills(tmp_path, num_heads, q_len, has_mask, direct,
                                                                 kv_fp8):
    tile = TileShape(min(num_heads, 64), 64 // min(num_heads, 64))
    assert tile.rows == wgmma_tile.BLOCK_M
    config = launch_config(LaunchPlan(tile, select_config(tile), 1), wgmma=True)
    out_dtype = "bf16" if direct or narrow_partials(config, num_heads, q_len) else "fp32"
    check_compiled(tmp_path, *compile_sm90(tile, num_heads, has_mask, direct, config.block_n, config.num_stages,
                                           out_dtype=out_dtype, kv_fp8=kv_fp8), out_dtype)


@needs_gluon
@pytest.mark.parametrize("num_heads, direct, kv_fp8", [(64, True, False), (128, False, False), (128, True, True),
                                                       (64, False, True), (16, False, False), (16, True, True)])
def test_sparse_tile_compiles_for_sm90_within_shared_memory_without_spills(tmp_path, num_heads, direct, kv_fp8):
    """sparse_mla_decode's launches of the tile (kv tiles gathered by cp.async; 16 heads padded to
    its 64 rows), which write their output or 16-bit split partials; its gathers go out 16 bytes
    a copy."""
    kernel, ptx, ptxas = compile_sm90(TileShape(64, 1), num_heads, False, direct, wgmma_tile.BLOCK_N, 2,
                                      out_dtype="bf16", kv_fp8=kv_fp8, sparse=True)
    assert "cp.async.cg.shared.global" in ptx and "cp.async.ca." not in ptx  # cg: 16-byte copies only
    check_compiled(tmp_path, kernel, ptx, ptxas, "bf16")


def check_compiled(tmp_path, kernel, ptx: str, ptxas: str, out_dtype: str) -> None:
    """Within one SM's shared memory; 16-bit stores 16 bytes a thread; no spills, at most 255
    registers and no serialised wgmma (ptxas -v)."""
    assert kernel.metadata.shared <= H100_SMEM_PER_BLOCK
    if out_dtype == "bf16":  # staged into rows a warp writes whole, 16 bytes a thread (_store_half)
        assert "st.global.v4.b32" in ptx and "st.global.b16" not in ptx
    (tmp_path / "k.ptx").write_text(ptx)
    report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.o")],
                            capture_output=True, text=True, check=True).stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    assert spills == [0] and registers and registers[0] <= 255, report
    # A wgmma whose accumulator other instructions touch while it is in flight makes ptxas wait after
    # every wgmma of the kernel (C7514/C7515): no warning may say so (its cost: docs/kernels.md).
    assert "serialized" not in report, report


def test_serves_heads_that_fill_query_boxes_of_eight_rows():
    """A box is one token's heads, rounded up to a power of two: 5-8 heads make 8-row boxes; 1, 2
    and 4 heads, all of a request's, fill 8 rows with several tokens' heads; 3 heads cannot."""
    assert [h for h in range(1, 17) if wgmma_tile.serves_heads(h)] == [1, 2, 4, *range(5, 17)]
    assert wgmma_tile.serves_heads(128)
    assert [wgmma_tile.query_box_rows(h) for h in (1, 2, 4, 8, 16, 64)] == [8, 8, 8, 8, 16, 64]


def test_not_used_off_sm90_or_for_caches_it_cannot_address():
    q = torch.zeros(1, 128, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    assert not wgmma_tile.supports(q, kv)  # a CPU tensor: no SM90 device
    plan = LaunchPlan(TileShape(64, 1), select_config(TileShape(64, 1)), 1)
    assert launch_config(plan, wgmma_tile.supports(q, kv)) == plan.config and not plan.config.wgmma
    assert launch_config(plan, True).wgmma  # a 64-row tile on a device and cache it serves
    narrow = LaunchPlan(TileShape(16, 1), select_config(TileShape(16, 1)), 1)
    assert launch_config(narrow, True) == narrow.config  # the Triton kernel serves 16-row tiles


@needs_gluon
def test_kv_descriptors_address_latent_and_rope_rows_of_the_flat_cache():
    kv = torch.zeros(3, 128, 576, dtype=torch.bfloat16)
    nope, pe = row_descriptors(kv, 64)
    assert nope.shape == [384, 512] and pe.shape == [384, 64]
    assert nope.strides == [576, 1] and pe.strides == [576, 1]
    assert nope.block_shape == [64, 512] and pe.block_shape == [64, 64]
    assert nope.base.data_ptr() == kv.data_ptr()
    assert pe.base.data_ptr() == kv.data_ptr() + 512 * kv.element_size()


def test_flat_rows_only_where_tma_can_address_them():
    """The query [T, H, 576] and the cache [pages, page_size, 576] are read by TMA as flat rows:
    only evenly strided, 16-byte aligned ones; otherwise the launch takes the Triton tile."""
    q = torch.zeros(5, 16, 576, dtype=torch.bfloat16)
    flat = flat_rows(q)
    assert flat.shape == (80, 576) and flat.stride() == (576, 1) and flat.data_ptr() == q.data_ptr()
    padded = torch.zeros(5, 16, 640, dtype=torch.bfloat16)[..., :576]  # rows 1280 bytes apart
    assert flat_rows(padded).stride() == (640, 1)
    assert flat_rows(torch.zeros(5, 20, 576, dtype=torch.bfloat16)[:, :16]) is None  # uneven
    assert flat_rows(torch.zeros(5, 16, 580, dtype=torch.bfloat16)[..., 1:577]) is None  # unaligned
    one_token = torch.zeros(2, 16, 576, dtype=torch.bfloat16)[:1]
    assert flat_rows(one_token.as_strided((1, 16, 576), (10**6, 576, 1))) is not None
    assert flat_rows(torch.zeros(4, 64, 576, dtype=torch.bfloat16)).shape == (256, 576)

