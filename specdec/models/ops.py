"""The decode forward's fused steps between its GEMVs (specdec/models/gemv.py): the norms, the MTP
layer's input, the MLA latents and query (with W_UK's product) and W_UV's product; one Triton
kernel each on a GPU, plain torch elsewhere.

Why our own kernels: at decode sizes each torch op is its own launch (a layer was ~60 small ones);
each of these is one launch reading its inputs once. FlashInfer is not in every install.
The Triton path runs for CUDA tensors outside autograd (training takes the torch path, which has a
backward); the torch path is the same arithmetic, and what CPU runs and the GPU tests compare to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from specdec.triton_lang import jit as _jit, on_triton, tl, triton


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): the kernels' block sizes."""
    return 1 << max(0, n - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands of ``dtype``: exact products for fp32 (the torch
    path's reference runs), tf32 (unused by 16-bit operands) otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def summed_in_order(partials: torch.Tensor) -> torch.Tensor:
    """``[S, ...]`` -> their sum, added first to last (the order the kernels add them in)."""
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    return total


@_jit
def summed(ptrs, stride, mask, SPLITS: tl.constexpr):
    """The SPLITS tensors at ``ptrs + s * stride`` added in order, in fp32."""
    total = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLITS):
        total += tl.load(ptrs + s * stride, mask=mask, other=0.0).to(tl.float32)
    return total


@_jit
def product_values(ptrs, mask, stride_s, SPLITS: tl.constexpr, DTYPE: tl.constexpr):
    """A GEMM's output values at ptrs in fp32: SPLITS 0, a 16-bit output as is; else its SPLITS
    fp32 partial sums ``stride_s`` apart (gemv.linear_parts), added in order and rounded to DTYPE,
    as the GEMV rounds its output."""
    if SPLITS == 0:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return summed(ptrs, stride_s, mask, SPLITS).to(DTYPE).to(tl.float32)


# ------------------------------------------------------------------------------ rms norm
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[T, D]`` (plus ``residual`` ``[T, D]``) -> (norm(h) ``[T, D]``, h), h = residual + x.

    As transformers computes it: h rounded to x's dtype, its norm in fp32, then times the weight in
    x's dtype. Without a residual h is x itself.
    """
    if on_triton(x, weight) and x.dim() == 2 and x.stride(1) == 1 and norm_kernel_takes(x, weight, residual):
        return triton_rms_norm(x, weight, eps, residual)
    h = x if residual is None else residual + x
    return _torch_rms_norm(h, weight, eps), h


def norm_kernel_takes(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor]) -> bool:
    """Whether the row kernels (rms_norm's, the MoE combine's) compute rms_norm(x, weight, eps,
    residual) for this x ``[T, D]``: a weight ``[D]`` and a residual ``[T, D]`` (or None), unit
    stride, in x's dtype. Other inputs take torch's broadcasting and promotion, which the kernels
    do not implement."""
    return (tuple(weight.shape) == (x.shape[-1],) and weight.dtype == x.dtype and weight.stride(0) == 1
            and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1
                                      and residual.dtype == x.dtype)))


@dataclass(frozen=True)
class AddNorm:
    """The residual add and RMS norm that follow a sublayer's output ``out [T, D]``: ``self(out)``
    is rms_norm(out, weight, eps, residual), (norm(h), h) with h = residual + out. A sublayer given
    one returns that pair, from its own last kernel where it can (moe_kernels.triton_combine), the
    same arithmetic as rms_norm's kernel; residual None: h is out."""

    residual: Optional[torch.Tensor]
    weight: torch.Tensor
    eps: float

    def __call__(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(out, self.weight, self.eps, self.residual)

    def kernel_takes(self, out: torch.Tensor) -> bool:
        """Whether a row kernel computes self(out) (norm_kernel_takes)."""
        return norm_kernel_takes(out, self.weight, self.residual)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm's kernel (any device Triton runs on, its interpreter included): rows of unit stride."""
    out = torch.empty_like(x)
    h = out if residual is None else torch.empty_like(x)
    rows, d = x.shape
    if rows:
        _rms_norm_kernel[(rows,)](x, x if residual is None else residual, h, weight, out, eps, d,
                                  x.stride(0), 0 if residual is None else residual.stride(0),
                                  HAS_RESIDUAL=residual is not None, **row_launch(d))
    return out, (x if residual is None else h)


def row_launch(d: int) -> dict:
    """A row-norm program's tile and warps for rows of ``d``: rms_norm's, mtp_input's and the MoE
    combine's alike, so all reduce a row in the same order."""
    return {"BLOCK": pow2(d), "num_warps": 8 if d >= 4096 else 4}


def _torch_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    f = h.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


@_jit
def norm_weight(w_ptrs, mask):
    """A norm's weight as fp32, loaded first in a kernel: a load after the row's stores and
    reduction would wait for them (the pointers may alias), one more memory round trip."""
    return tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)


@_jit
def _scaled(w, normed, DTYPE: tl.constexpr):
    """weight * normed.to(DTYPE), as torch rounds it: the fp32 product of the two DTYPE values
    (w: the weight as norm_weight loads it)."""
    return (w * normed.to(DTYPE).to(tl.float32)).to(DTYPE)


@_jit
def normed_row(x, w, D, eps, DTYPE: tl.constexpr):
    """rms_norm of one row ``x [BLOCK]`` (zeros past D) times the weight w (norm_weight), in DTYPE."""
    f = x.to(tl.float32)
    normed = f * tl.rsqrt(tl.sum(f * f, axis=0) / D + eps)
    return _scaled(w, normed, DTYPE)


@_jit
def add_and_norm(x, res_ptrs, h_ptrs, out_ptrs, w, mask, D, eps, HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr):
    """rms_norm of one row ``x [BLOCK]`` (zeros past D) after its residual add: h = x + the row at
    res_ptrs (HAS_RESIDUAL; the sum rounded to h's dtype), stored at h_ptrs if STORE_H, and
    normed_row(h) at out_ptrs. rms_norm's kernel and the MoE combine's norm (AddNorm) both run it, so
    their bits agree."""
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)).to(h_ptrs.dtype.element_ty)
    if STORE_H:
        tl.store(h_ptrs, x, mask=mask)
    tl.store(out_ptrs, normed_row(x, w, D, eps, out_ptrs.dtype.element_ty), mask=mask)


@_jit
def _rms_norm_kernel(x_ptr, res_ptr, h_ptr, w_ptr, out_ptr, eps, D, stride_x, stride_res,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: a long prefill's T * D passes 2^31
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = norm_weight(w_ptr + cols, mask)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    add_and_norm(x, res_ptr + row * stride_res + cols, h_ptr + row * D + cols, out_ptr + row * D + cols, w, mask, D,
                 eps, HAS_RESIDUAL, HAS_RESIDUAL)


# ------------------------------------------------------------------- embedding + norm
def embed_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first layer's input: ids ``[T]`` int64, table ``[V, D]`` -> (rms_norm(h), h), h =
    table[ids] ``[T, D]``, as rms_norm computes it. One kernel on a GPU, a program per token, where
    torch launches the lookup and the norm; there an id outside the table gives a zero row (torch's
    lookup raises)."""
    if on_triton(table, weight) and table.dim() == 2 and table.stride(1) == 1 and ids.dim() == 1:
        return triton_embed_norm(ids, table, weight, eps)
    return rms_norm(F.embedding(ids, table), weight, eps)


def triton_embed_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """embed_norm's kernel: rms_norm's tile and warps, so the norm equals triton_rms_norm's of h."""
    t, d = ids.shape[0], table.shape[1]
    out, h = table.new_empty(t, d), table.new_empty(t, d)
    if t:
        _embed_norm_kernel[(t,)](ids, table, weight, h, out, table.shape[0], d, ids.stride(0), table.stride(0), eps,
                                 **row_launch(d))
    return out, h


@_jit
def lookup_row(id_ptr, table_ptr, stride_table, V, cols, mask):
    """The table row of the id at id_ptr, ``[BLOCK]`` (zeros past the row's D); an id outside
    [0, V) gives a zero row."""
    token = tl.load(id_ptr)
    known = (token >= 0) & (token < V)
    row = tl.where(known, token, 0).to(tl.int64)
    return tl.load(table_ptr + row * stride_table + cols, mask=mask & known, other=0.0)


@_jit
def _embed_norm_kernel(ids_ptr, table_ptr, w_ptr, h_ptr, out_ptr, V, D, stride_ids, stride_table, eps,
                       BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = norm_weight(w_ptr + cols, mask)
    x = lookup_row(ids_ptr + t * stride_ids, table_ptr, stride_table, V, cols, mask)
    at = t.to(tl.int64) * D + cols
    add_and_norm(x, h_ptr + at, h_ptr + at, out_ptr + at, w, mask, D, eps, False, True)


# ------------------------------------------------------------------------- MTP input
def mtp_input(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, e_weight: torch.Tensor,
              h_weight: torch.Tensor, e_eps: float, h_eps: float) -> torch.Tensor:
    """The MTP layer's eh_proj input ``[T, 2D]``: rms_norm(table[ids]) ++ rms_norm(hidden), ids
    ``[T]`` int64, table ``[V, D]``, hidden ``[T, D]``; each norm as rms_norm computes it.

    One kernel on a GPU, a program per token, where torch launches the lookup, two norms and the
    concatenation. There an id outside the table gives a zero row (torch's lookup raises).
    """
    if (on_triton(table, hidden, e_weight, h_weight) and hidden.dim() == 2 and hidden.stride(1) == 1
            and table.stride(1) == 1 and table.shape[1] == hidden.shape[1] and hidden.dtype == table.dtype):
        return triton_mtp_input(ids, table, hidden, e_weight, h_weight, e_eps, h_eps)
    return torch.cat([rms_norm(F.embedding(ids, table), e_weight, e_eps)[0], rms_norm(hidden, h_weight, h_eps)[0]],
                     dim=-1)


def triton_mtp_input(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, e_weight: torch.Tensor,
                     h_weight: torch.Tensor, e_eps: float, h_eps: float) -> torch.Tensor:
    """mtp_input's kernel: rows of unit stride; the norms' tiles and warps are rms_norm's, so each
    half equals what triton_rms_norm gives for it."""
    t, d = hidden.shape
    if ids.shape != (t,):
        raise ValueError(f"mtp_input: ids must be [{t}] (one a hidden row), got {tuple(ids.shape)}")
    out = hidden.new_empty(t, 2 * d)
    if t:
        _mtp_input_kernel[(t,)](ids, table, hidden, e_weight, h_weight, out, table.shape[0], d, ids.stride(0),
                                table.stride(0), hidden.stride(0), e_eps, h_eps, **row_launch(d))
    return out


@_jit
def _mtp_input_kernel(ids_ptr, table_ptr, hidden_ptr, ew_ptr, hw_ptr, out_ptr, V, D, stride_ids, stride_table,
                      stride_hidden, e_eps, h_eps, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    ew, hw = norm_weight(ew_ptr + cols, mask), norm_weight(hw_ptr + cols, mask)
    dtype = out_ptr.dtype.element_ty
    out = out_ptr + t.to(tl.int64) * (2 * D)
    embedded = lookup_row(ids_ptr + t * stride_ids, table_ptr, stride_table, V, cols, mask)
    tl.store(out + cols, normed_row(embedded, ew, D, e_eps, dtype), mask=mask)
    h = tl.load(hidden_ptr + t.to(tl.int64) * stride_hidden + cols, mask=mask, other=0.0)
    tl.store(out + D + cols, normed_row(h, hw, D, h_eps, dtype), mask=mask)


# --------------------------------------------------------------------------- silu * up
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate ++ up) -> silu(gate) * up ``[T, I]`` in the input dtype."""
    if on_triton(gate_up) and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        return triton_silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def triton_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul's kernel: rows of unit stride; silu rounded to the dtype, then the product, as torch."""
    rows, width = gate_up.shape
    inter = width // 2
    out = gate_up.new_empty(rows, inter)
    block = min(pow2(inter), 1024)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), BLOCK=block)
    return out


@_jit
def _silu_mul_kernel(gu_ptr, out_ptr, INTER, stride_gu, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * INTER + cols, silu_times(gate, up, out_ptr.dtype.element_ty), mask=mask)


@_jit
def silu_times(gate, up, DTYPE: tl.constexpr):
    """silu(gate) * up in DTYPE from fp32 values of DTYPE, rounded as torch's F.silu(gate) * up."""
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return (act * up).to(DTYPE)


# ------------------------------------------------------------------------------- rope
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate ``x [T, ..., 64]`` by cos/sin ``[T, 32]``.

    Interleaved pairs (x0, x1), (x2, x3), ... come out de-interleaved (rotated evens, then odds),
    as in transformers; q and k get the same permutation, so their dot products are unchanged.
    """
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions ``[T]`` int64, inv_freq ``[32]`` fp32 -> (cos, sin) ``[T, 32]`` fp32 of
    positions x inv_freq, each times ``factor`` (YaRN's attention factor) unless it is 1.

    One kernel on a GPU where torch takes three to five (the product, cos, sin, the scalings); the
    same fp32 product and libdevice's cos/sin, which torch's CUDA kernels call too. E.g. position
    4095 at frequency 1.0: (cos, sin) = (-0.0660, -0.9978)."""
    half = inv_freq.shape[0]
    if (on_triton(positions, inv_freq) and positions.dim() == 1 and inv_freq.is_contiguous()
            and inv_freq.dtype == torch.float32 and half & (half - 1) == 0):
        return triton_rope_cos_sin(positions, inv_freq, factor)
    freqs = positions[:, None] * inv_freq[None, :]  # fp32: one kernel, no cast
    if factor == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * factor, freqs.sin() * factor


def triton_rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                        factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_cos_sin's kernel: positions ``[T]`` (any stride), a contiguous inv_freq of a power of two."""
    t, half = positions.shape[0], inv_freq.shape[0]
    if inv_freq.dtype != torch.float32 or half & (half - 1):
        raise ValueError(f"rope_cos_sin: inv_freq {tuple(inv_freq.shape)} {inv_freq.dtype}: expected fp32 of a power "
                         "of two")
    cos = torch.empty(t, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if t:
        block = min(64, pow2(t))
        _rope_cos_sin_kernel[(triton.cdiv(t, block),)](positions, inv_freq, cos, sin, t, positions.stride(0), factor,
                                                       SCALE=factor != 1.0, HALF=half, BLOCK_T=block)
    return cos, sin


@_jit
def _rope_cos_sin_kernel(pos_ptr, freq_ptr, cos_ptr, sin_ptr, T, stride_p, factor, SCALE: tl.constexpr,
                         HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    """BLOCK_T tokens a program: cos and sin of position x frequency (tl.cos / tl.sin compile to
    libdevice's cosf / sinf, not the approximate instructions)."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    idx = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + rt * stride_p, mask=rt < T, other=0).to(tl.float32)
    freqs = pos[:, None] * tl.load(freq_ptr + idx)[None, :]
    cos, sin = tl.cos(freqs), tl.sin(freqs)
    if SCALE:
        cos, sin = cos * factor, sin * factor
    offs = rt[:, None] * HALF + idx[None, :]
    mask = (rt < T)[:, None]
    tl.store(cos_ptr + offs, cos, mask=mask)
    tl.store(sin_ptr + offs, sin, mask=mask)


@_jit
def _rope_pairs(ptr, cos, sin, HALF: tl.constexpr, INTERLEAVE: tl.constexpr, stride_s=0, SPLITS: tl.constexpr = 0,
                DTYPE: tl.constexpr = tl.float32):
    """(rotated first half, rotated second half) of the 2*HALF values at ptr, in fp32 (SPLITS,
    stride_s, DTYPE: as product_values reads them)."""
    idx = tl.arange(0, HALF)
    if INTERLEAVE:
        x1 = product_values(ptr + 2 * idx, idx < HALF, stride_s, SPLITS, DTYPE)
        x2 = product_values(ptr + 2 * idx + 1, idx < HALF, stride_s, SPLITS, DTYPE)
    else:
        x1 = product_values(ptr + idx, idx < HALF, stride_s, SPLITS, DTYPE)
        x2 = product_values(ptr + HALF + idx, idx < HALF, stride_s, SPLITS, DTYPE)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


# --------------------------------------------------------------------- MLA prologue
KVRows = tuple[torch.Tensor, torch.Tensor]  # (cache rows [slots, 576], a token's slot [T] int64): attn's kv_rows


def mla_latents(qkv: torch.Tensor, q_rank: int, q_norm: Optional[torch.Tensor], kv_norm: torch.Tensor, eps: float,
                cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                cache: Optional[KVRows] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The fused q_a / kv_a projection's output ``[T, q_rank + 576]`` -> (q side ``[T, q_rank]``,
    kv row ``[T, 576]``): q_a_layernorm on the q side (as is, without ``q_norm``: a plain q_proj's
    output), kv_a_layernorm on the 512 latent dims, RoPE on the 64 rope dims (the row the cache holds).
    qkv may also come as gemv.linear_parts' ``[S, T, q_rank + 576]`` fp32 partial sums: their
    in-order sum rounded to kv_norm's dtype is the output (the kernel adds them as it loads).
    ``cache``: the kv rows go there instead, token t's to row ``slots[t]`` (and None comes back).
    """
    dtype = qkv.dtype if qkv.dim() == 2 else kv_norm.dtype
    latent = qkv.shape[-1] - q_rank - 64
    if cache is not None and cache[0].dtype != dtype:
        raise ValueError(f"mla_latents: the cache rows are {cache[0].dtype}, the projection {dtype}: a cache of "
                         "another dtype takes kv rows through the backend's forward")
    if on_triton(qkv, kv_norm) and qkv.stride(-1) == 1 and latent == 512 and (cache is None or cache[0].stride(1) == 1):
        return triton_mla_latents(qkv, q_rank, q_norm, kv_norm, eps, cos, sin, interleave, cache)
    if qkv.dim() == 3:
        qkv = summed_in_order(qkv).to(dtype)
    q, latent_part, rope = qkv.split([q_rank, latent, 64], dim=-1)
    if q_norm is not None:
        q = _torch_rms_norm(q, q_norm, eps)
    kv = torch.cat([_torch_rms_norm(latent_part, kv_norm, eps), apply_rope(rope, cos, sin, interleave)], dim=-1)
    if cache is None:
        return q, kv
    cache[0].index_copy_(0, cache[1], kv)
    return q, None


def triton_mla_latents(qkv: torch.Tensor, q_rank: int, q_norm: Optional[torch.Tensor], kv_norm: torch.Tensor,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                       cache: Optional[KVRows] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """mla_latents' kernel: a latent of 512, rows of unit stride (``[T, C]`` 16-bit or ``[S, T, C]``
    fp32 parts), cos/sin ``[T, 32]`` fp32 contiguous; ``cache`` rows of unit stride in the output's
    dtype."""
    parts = qkv.dim() == 3
    if parts and (qkv.dtype != torch.float32 or q_norm is None):
        raise ValueError(f"mla_latents: parts {tuple(qkv.shape)} {qkv.dtype} must be fp32 partial sums of a "
                         "q_a / kv_a projection (with a q norm)")
    t = qkv.shape[-2]
    dtype = kv_norm.dtype if parts else qkv.dtype
    if cache is not None and (tuple(cache[1].shape) != (t,) or cache[0].shape[1] != 576):
        raise ValueError(f"mla_latents: {t} tokens need cache rows [slots, 576] and a slot each, got rows "
                         f"{tuple(cache[0].shape)} and slots {tuple(cache[1].shape)}")
    kv = qkv.new_empty(t, 576, dtype=dtype) if cache is None else cache[0]
    q = qkv.new_empty(t, q_rank, dtype=dtype) if q_norm is not None else qkv[:, :q_rank]
    if t:
        _mla_latents_kernel[(t,)](
            qkv, q, q_norm if q_norm is not None else kv_norm, kv_norm, kv, kv if cache is None else cache[1], cos, sin,
            eps, q_rank, qkv.stride(-2), qkv.stride(0) if parts else 0, kv.stride(0), kv.shape[0],
            HAS_Q_NORM=q_norm is not None, Q_BLOCK=pow2(q_rank) if q_norm is not None else 1,
            TO_SLOTS=cache is not None, SPLITS=qkv.shape[0] if parts else 0, LATENT=512, HALF=32,
            INTERLEAVE=interleave, num_warps=4)
    return q, (kv if cache is None else None)


@_jit
def _mla_latents_kernel(qkv_ptr, q_ptr, qw_ptr, kvw_ptr, kv_ptr, slots_ptr, cos_ptr, sin_ptr, eps, Q_RANK, stride_qkv,
                        stride_s, stride_kv, KV_ROWS, HAS_Q_NORM: tl.constexpr, Q_BLOCK: tl.constexpr,
                        TO_SLOTS: tl.constexpr, SPLITS: tl.constexpr, LATENT: tl.constexpr, HALF: tl.constexpr,
                        INTERLEAVE: tl.constexpr):
    """TO_SLOTS: token t's kv row goes to row slots[t] of kv (the cache; a slot outside its
    KV_ROWS rows writes nothing), else to row t. SPLITS: qkv as that many fp32 partial sums
    ``stride_s`` apart (product_values), 0: a 16-bit qkv."""
    t = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + t * stride_qkv
    dtype = kv_ptr.dtype.element_ty
    lat = tl.arange(0, LATENT)
    kv_w = norm_weight(kvw_ptr + lat, lat < LATENT)
    if HAS_Q_NORM:
        cols = tl.arange(0, Q_BLOCK)
        mask = cols < Q_RANK
        q_w = norm_weight(qw_ptr + cols, mask)
        f = product_values(row + cols, mask, stride_s, SPLITS, dtype)
        normed = f * tl.rsqrt(tl.sum(f * f, axis=0) / Q_RANK + eps)
        tl.store(q_ptr + t * Q_RANK + cols, _scaled(q_w, normed, q_ptr.dtype.element_ty), mask=mask)
    f = product_values(row + Q_RANK + lat, lat < LATENT, stride_s, SPLITS, dtype)
    normed = f * tl.rsqrt(tl.sum(f * f, axis=0) / LATENT + eps)
    slot = t
    if TO_SLOTS:
        slot = tl.load(slots_ptr + t).to(tl.int64)
    inside = (slot >= 0) & (slot < KV_ROWS)
    out = kv_ptr + slot * stride_kv
    tl.store(out + lat, _scaled(kv_w, normed, kv_ptr.dtype.element_ty), mask=inside)
    idx = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + t * HALF + idx)
    sin = tl.load(sin_ptr + t * HALF + idx)
    r1, r2 = _rope_pairs(row + Q_RANK + LATENT, cos, sin, HALF, INTERLEAVE, stride_s, SPLITS, dtype)
    tl.store(out + LATENT + idx, r1.to(kv_ptr.dtype.element_ty), mask=inside)
    tl.store(out + LATENT + HALF + idx, r2.to(kv_ptr.dtype.element_ty), mask=inside)


def mla_query(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              interleave: bool) -> torch.Tensor:
    """The absorbed query ``[T, H, 576]``: each head's nope dims times its W_UK, then its rotated
    rope dims; q ``[T, H, nope + 64]``, w_uk ``[H, nope, 512]`` (rows of kv_b_proj's weight).

    One kernel on a GPU (16-bit): a program per (head, 64 latent columns, 16 tokens) streams its
    slice of W_UK once for all the tokens, and rotates the rope dims after it or, past 16 tokens,
    in programs of its own; torch does a batched GEMM, a copy and the rope.
    """
    heads, nope, latent = w_uk.shape
    if q.dim() != 3 or tuple(q.shape[1:]) != (heads, nope + 64):
        raise ValueError(f"mla_query: q must be [T, {heads}, {nope + 64}] for W_UK {tuple(w_uk.shape)}, "
                         f"got {tuple(q.shape)}")
    if (on_triton(q, w_uk) and q.dtype in (torch.bfloat16, torch.float16) and q.stride(2) == 1
            and w_uk.stride(2) == 1 and nope >= 16 and nope & (nope - 1) == 0 and latent % 64 == 0):
        return triton_mla_query(q, w_uk, cos, sin, interleave)
    q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk)  # [H, T, 512]
    return torch.cat([q_latent.transpose(0, 1), apply_rope(q[..., nope:], cos, sin, interleave)], dim=-1)


def triton_mla_query(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     interleave: bool) -> torch.Tensor:
    """mla_query's kernel: last dims of unit stride, cos/sin ``[T, 32]`` fp32 contiguous."""
    t, heads, _ = q.shape
    nope, latent = w_uk.shape[1:]
    query = q.new_empty(t, heads, latent + 64)
    if t:
        block_m = 16 if t <= 16 else 64
        rope_apart = block_m == 64  # the rope in programs of its own: the last column block
        grid = (heads, triton.cdiv(latent, 64) + rope_apart, triton.cdiv(t, block_m))
        _mla_query_kernel[grid](q, w_uk, query, cos, sin, t, q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1),
                                NOPE=nope, LATENT=latent, HALF=32, INTERLEAVE=interleave, ROPE_APART=rope_apart,
                                BLOCK_M=block_m, BLOCK_N=64, num_warps=4)
    return query


def mla_value(out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Each head's attention output ``out [T, H, 512]`` times its W_UV ``w_uv [H, v, 512]`` (rows of
    kv_b_proj's weight) -> ``[T, H * v]``, the o_proj input: one kernel on a GPU (16-bit) writing
    that layout, where torch does a batched GEMM and a copy."""
    if out.dim() != 3 or (out.shape[1], out.shape[2]) != (w_uv.shape[0], w_uv.shape[2]):
        raise ValueError(f"mla_value: out must be [T, {w_uv.shape[0]}, {w_uv.shape[2]}] for W_UV "
                         f"{tuple(w_uv.shape)}, got {tuple(out.shape)}")
    if (on_triton(out, w_uv) and out.dtype in (torch.bfloat16, torch.float16) and out.stride(2) == 1
            and w_uv.stride(2) == 1 and out.shape[2] % 128 == 0):
        return triton_mla_value(out, w_uv)
    return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).flatten(1)


def triton_mla_value(out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """mla_value's kernel: last dims of unit stride."""
    t, heads, latent = out.shape
    v = w_uv.shape[1]
    value = out.new_empty(t, heads * v)
    if t:
        block_m = 16 if t <= 16 else 64
        block_n = 16 if t <= 16 else 64  # few tokens: more programs streaming W_UV
        grid = (heads, triton.cdiv(v, block_n), triton.cdiv(t, block_m))
        _mla_value_kernel[grid](out, w_uv, value, t, v, out.stride(0), out.stride(1), w_uv.stride(0), w_uv.stride(1),
                                LATENT=latent, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, num_warps=4)
    return value


@_jit
def _mla_query_kernel(q_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, T, stride_qt, stride_qh, stride_wh, stride_wd,
                      NOPE: tl.constexpr, LATENT: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr,
                      ROPE_APART: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows past T load row T - 1 again (no masks on the loads) and store nothing. Row offsets are
    int64: a long prefill's T * H * 576 passes 2^31. The rope dims: ROPE_APART, the programs of
    column block LATENT / BLOCK_N (at 64-token blocks, where after a product's they lengthened the
    launch's slowest program); else column block 0's, after its product (at 16-token blocks, where
    the extra programs cost more)."""
    h, n_blk = tl.program_id(0), tl.program_id(1)
    rm = (tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rows = tl.minimum(rm, T - 1)
    heads = tl.num_programs(0)
    q_rows = q_ptr + rows[:, None] * stride_qt + h * stride_qh
    out_rows = out_ptr + (rm[:, None] * heads + h) * (LATENT + 2 * HALF)
    stored = (rm < T)[:, None]
    if n_blk < LATENT // BLOCK_N:
        rn = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)
        rd = tl.arange(0, NOPE)
        w = tl.load(w_ptr + h * stride_wh + rd[:, None] * stride_wd + rn[None, :])  # [NOPE, BLOCK_N]
        acc = tl.dot(tl.load(q_rows + rd[None, :]), w)
        tl.store(out_rows + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=stored)
    if n_blk == (LATENT // BLOCK_N if ROPE_APART else 0):
        idx = tl.arange(0, HALF)
        cos = tl.load(cos_ptr + rows[:, None] * HALF + idx[None, :])
        sin = tl.load(sin_ptr + rows[:, None] * HALF + idx[None, :])
        r1, r2 = _rope_pairs(q_rows + NOPE, cos, sin, HALF, INTERLEAVE)
        tl.store(out_rows + LATENT + idx[None, :], r1.to(out_ptr.dtype.element_ty), mask=stored)
        tl.store(out_rows + LATENT + HALF + idx[None, :], r2.to(out_ptr.dtype.element_ty), mask=stored)


@_jit
def _mla_value_kernel(o_ptr, w_ptr, out_ptr, T, V, stride_ot, stride_oh, stride_wh, stride_wv, LATENT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """As _mla_query_kernel: rows past T load row T - 1 and store nothing; int64 row offsets."""
    h = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rows = tl.minimum(rm, T - 1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, LATENT, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        o = tl.load(o_ptr + rows[:, None] * stride_ot + h * stride_oh + rk[None, :])
        w = tl.load(w_ptr + h * stride_wh + rn[:, None] * stride_wv + rk[None, :], mask=(rn < V)[:, None], other=0.0)
        acc = tl.dot(o, tl.trans(w), acc)
    heads = tl.num_programs(0)
    tl.store(out_ptr + rm[:, None] * (heads * V) + h * V + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm < T)[:, None] & (rn < V)[None, :])
