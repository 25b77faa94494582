"""How the Gluon wgmma tile (attn/kernels/triton_mla/wgmma.py) computes over an fp8 e4m3 cache: in fp16.

Each fp8 kv tile is widened from the slot its copy landed in into a 16-bit compute stage (e4m3 ->
fp16 is exact and one instruction a pair, where bf16 needs several), and a 16-bit query tile is
rewritten once as fp16 times Q_FP16_SCALE, the score scale divided by it. Imports without Gluon.
"""

from __future__ import annotations

import struct

from attn.base import KV_LORA_RANK

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared
except ImportError:  # CPU-only install, or a Triton without Gluon
    gluon = None

_constexpr = gl.constexpr if gluon is not None else (lambda value: value)
_D_NOPE, _D_HALF = _constexpr(KV_LORA_RANK), _constexpr(KV_LORA_RANK // 2)
# A bf16 query scaled into fp16 (for an fp8 cache): exact for magnitudes 2^-6 to 2^24; below,
# absolute error under 2^-16 (bf16's own rounding of a value near 1 is 2^-9).
Q_FP16_SCALE = 2.0 ** -8
QUERY_SCALE = _constexpr(Q_FP16_SCALE)  # the same, kernel-visible
# The same scale as a PTX fp32 literal (0f + its bits), for _scaled_fp16.
_SCALE_PTX = _constexpr(f"mul.rn.f32 $0, $1, 0f{struct.unpack('<I', struct.pack('<f', Q_FP16_SCALE))[0]:08X};")


def _jit(fn):
    return gluon.jit(fn) if gluon is not None else fn


@_jit
def widen_half(src_nope, src_pe, dst_nope, dst_pe, HALF: gl.constexpr):
    """Latent columns [HALF * 256, HALF * 256 + 256) of an fp8 kv tile ([BLOCK_N, 512] + [BLOCK_N,
    64] in its landing slot) into the 16-bit compute stage, 128 (one swizzle row of the slot, 64
    values a thread) at a time; half 1 also the rope columns. Then fenced for the wgmma and
    synchronised across the warpgroup."""
    nope_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8],
                                                 warps_per_cta=[4, 1], order=[1, 0])
    pe_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                               warps_per_cta=[4, 1], order=[1, 0])
    for c in gl.static_range(_D_HALF // 128):
        part = src_nope.slice(HALF * _D_HALF + c * 128, 128, dim=1).load(nope_layout)
        dst_nope.slice(HALF * _D_HALF + c * 128, 128, dim=1).store(part.to(dst_nope.dtype))
    if HALF == 1:
        dst_pe.store(src_pe.load(pe_layout).to(dst_pe.dtype))
    fence_async_shared()  # before a wgmma reads it
    gl.thread_barrier()


@_jit
def _scaled_fp16(x):
    """x * Q_FP16_SCALE in fp16, scaled in fp32 first: as plain code the compiler moved the
    multiply after the narrowing, where values over 65504 overflow."""
    scaled = gl.inline_asm_elementwise(_SCALE_PTX, "=r,r", [x.to(gl.float32)],
                                       dtype=gl.float32, is_pure=True, pack=1)
    return scaled.to(gl.float16)


@_jit
def query_to_fp16(q_nope_smem, q_pe_smem, layout: gl.constexpr):
    """Rewrite a 16-bit query tile in place as fp16 times Q_FP16_SCALE; returns its fp16 views."""
    nope = q_nope_smem._reinterpret(gl.float16, q_nope_smem.shape, q_nope_smem.layout)
    pe = q_pe_smem._reinterpret(gl.float16, q_pe_smem.shape, q_pe_smem.layout)
    # Each thread rewrites only the values it read.
    for c in gl.static_range(_D_NOPE // 64):
        part = q_nope_smem.slice(c * 64, 64, dim=1).load(layout)
        nope.slice(c * 64, 64, dim=1).store(_scaled_fp16(part))
    pe.store(_scaled_fp16(q_pe_smem.load(layout)))
    fence_async_shared()  # before the wgmma reads it
    gl.thread_barrier()
    return nope, pe
