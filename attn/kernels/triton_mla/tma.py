"""How the Gluon wgmma tile (attn/kernels/triton_mla/wgmma.py) addresses a query or a paged cache by TMA:
an [n, m, 576] tensor as its flat [n * m, 576] rows, and the descriptors of their latent and rope
parts. Host-side; imports without Gluon (descriptors then cannot be made)."""

from __future__ import annotations

import torch

from attn.base import KV_LORA_RANK, QK_ROPE_DIM

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # CPU-only install, or a Triton without Gluon: flat_rows alone is of use
    gl = None


def flat_rows(x: torch.Tensor) -> torch.Tensor | None:
    """[n, m, 576] x as its [n * m, 576] rows, where TMA can address them: evenly strided (the
    outer stride m times the inner one, or one outer index), 16-byte aligned, under 2**31 rows."""
    n, m, width = x.shape
    if ((n > 1 and x.stride(0) != m * x.stride(1)) or (x.stride(1) * x.element_size()) % 16
            or x.data_ptr() % 16 or n * m >= 2**31):
        return None
    return x.as_strided((n * m, width), (x.stride(1), 1))


def row_descriptors(x: torch.Tensor, box_rows: int) -> tuple:
    """TMA descriptors of the latent ([rows, 512]) and rope ([rows, 64]) parts of an [n, m, 576]
    tensor's flat rows (a cache [num_pages, page_size, 576]: row page * page_size + offset; a query
    [T, H, 576]: row token * H + head) that flat_rows accepts, box_rows rows a box. A box that
    reaches past the last row is filled with zeros."""
    flat = flat_rows(x)
    rows = flat.shape[0]
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[flat.dtype]
    nope_layout = gl.NVMMASharedLayout.get_default_for([box_rows, KV_LORA_RANK], dtype)
    pe_layout = gl.NVMMASharedLayout.get_default_for([box_rows, QK_ROPE_DIM], dtype)
    nope = TensorDescriptor(flat, [rows, KV_LORA_RANK], [flat.stride(0), 1], [box_rows, KV_LORA_RANK], nope_layout)
    pe = TensorDescriptor(flat[:, KV_LORA_RANK:], [rows, QK_ROPE_DIM], [flat.stride(0), 1], [box_rows, QK_ROPE_DIM],
                          pe_layout)
    return nope, pe
