"""The shared paged-MLA backend: metadata on the device, one method per kernel call.

Block tables and seq_lens are built on the device from ``req_to_token`` for every mode, with no
host sync, so ``needs_cpu_seq_lens`` is False. Kernel families subclass this and override only
``_run_decode_kernel`` / ``_run_prefill_kernel`` and their class attributes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from attn.base import (KV_DIM, KV_DTYPES, KV_LORA_RANK, AttnBatch, ForwardMode, KVCacheView, LayerSpec, const_arange,
                       encode_kv)
from attn.kernels.block_tables import block_tables
from attn.values import is_int
from attn.workspace import get_workspace


def rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., W]`` (576: latent rows; a sparse model's indexer keys: index_head_dim) as ``[N, W]``
    rows; one-byte dtypes (fp8) as uint8, which every device can index and copy."""
    flat = t.reshape(-1, t.shape[-1])
    return flat.view(torch.uint8) if flat.element_size() == 1 else flat


@dataclass
class PagedMetadata:
    """Per-pass kernel arguments, all on the device.

    block_tables: ``[B, max_pages]`` int32; seq_lens: ``[B]`` int32; cu_seqlens_q: ``[B + 1]`` int32;
    max_seq_len: static host bound of the kv length: the pass's ``max_kv_len``, else the table width
    in tokens.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seq_len: int


class PagedMLABackend:
    """Paged MLA attention over a shared ``[num_pages, page_size, 576]`` pool per layer.

    Class attributes are the family's capabilities and constraints (each stated in
    attn.base.AttentionBackend); the registry validates them before construction, so no kernel
    library is asked to work on an unsupported setup.
    """

    name = "paged"
    kernel_family = "reference"  # which workspace the family owns (attn.workspace)
    needs_cpu_seq_lens = False
    supports_tree_mask = False
    supports_sparse = False
    supports_dense = True  # runs forward (a dense model's passes); False: sparse passes only
    max_index_topk: Optional[int] = None
    sparse_kv_dtypes: Optional[tuple[str, ...]] = None  # None: its sparse passes take every kv_dtypes entry
    supports_cuda_graph = True
    supports_prefill = True
    supports_draft_extend = True  # uniform num_steps + 1 query tokens per request
    prefill_fallback: Optional[str] = None  # backend serving prefill/draft-extend where this one cannot
    max_decode_q_len: Optional[int] = None  # query tokens per request the decode kernel takes (None: any)
    # The decode kernel is compiled per query length (CuTe-DSL, at first use): prefill's chunks are
    # all max_decode_q_len wide, padded, so every prompt runs one variant (prefill_chunk_len).
    compiles_per_q_len = False
    max_prefill_tokens: Optional[int] = None  # query tokens a prefill (EXTEND) pass may hold (None: any)
    # Compute capabilities the kernel runs on: majors (any minor) or (major, minor) pairs; None: any
    required_sm: Optional[tuple[int | tuple[int, int], ...]] = None
    page_sizes: Optional[tuple[int, ...]] = None  # None: any page size
    kv_dtypes: tuple[str, ...] = ("auto", "bf16", "fp16", "fp32", "fp8_e4m3")
    table_tokens_multiple = 1  # block tables (max_context_len tokens wide) must span a multiple of this
    max_heads: Optional[int] = None  # query heads per layer the kernel takes at most (None: any)
    skipped_heads = range(0)  # head counts under max_heads the kernel refuses all the same
    workspace_bytes = 0
    metadata: Optional[PagedMetadata] = None  # the pass's, from init_forward_metadata

    def __init__(
        self,
        kv: KVCacheView,
        layer: LayerSpec,
        max_batch_size: int,
        max_q_len: int,
        max_mask_len: int = 0,
    ) -> None:
        """max_q_len / max_mask_len size the preallocated tree-mask buffer
        ``[max_batch_size, max_q_len, max_mask_len]`` bool (tree-mask backends only)."""
        heads = layer.num_heads
        if (self.max_heads is not None and heads > self.max_heads) or heads in self.skipped_heads:
            skipped = f", except {self.skipped_heads.start}-{self.skipped_heads.stop - 1}" if self.skipped_heads else ""
            raise ValueError(f"{self.name} takes up to {self.max_heads} query heads{skipped}, not {heads} (the "
                             "model's heads on this rank); pick another attention backend")
        if self.page_sizes is not None and kv.page_size not in self.page_sizes:
            raise ValueError(f"{self.name} takes pages of {list(self.page_sizes)} tokens, not {kv.page_size}; pick "
                             "another page_size or attention backend")
        if kv.device.type == "cuda":  # (on the CPU a test swaps the kernel call for a reference)
            capability = tuple(torch.cuda.get_device_capability(kv.device))
            if not self.runs_on(capability):
                raise ValueError(f"{self.name} needs a {self.required_arch()} GPU, not the SM{capability[0]}"
                                 f"{capability[1]} GPU {kv.device} (attn.registry.check_device lists those that run here)")
        dtype = kv.kv_buffers[0].dtype
        if not any(KV_DTYPES.get(name) == dtype for name in self.kv_dtypes):
            raise ValueError(f"{self.name} takes kv caches of {[n for n in self.kv_dtypes if n != 'auto']}, not {dtype}; "
                             "pick another kv dtype or attention backend")
        self.kv = kv
        self.layer = layer
        self.page_size = kv.page_size
        self.max_pages = math.ceil(kv.max_context_len / kv.page_size)
        table_tokens = self.max_pages * self.page_size
        if table_tokens % self.table_tokens_multiple:
            step = self.table_tokens_multiple
            raise ValueError(f"{self.name} needs block tables spanning a multiple of {step} tokens, not {table_tokens} "
                             f"(the KV pool's max_context_len {kv.max_context_len} in pages of {self.page_size}); "
                             f"raise max_context_len to {-(-table_tokens // step) * step}")
        self.max_batch_size = max_batch_size
        self.max_q_len = max_q_len
        self.metadata: Optional[PagedMetadata] = None
        self.tree_mask: Optional[torch.Tensor] = None
        if self.supports_tree_mask and max_mask_len > 0:
            self.tree_mask = torch.zeros(max_batch_size, max_q_len, max_mask_len, dtype=torch.bool, device=kv.device)
        self.workspace = self._allocate_workspace()

    @classmethod
    def runs_on(cls, capability: Optional[tuple[int, int]]) -> bool:
        """Whether the kernel runs on a GPU of this compute capability (None: no GPU). required_sm
        entries: a major (every minor of it) or a (major, minor) pair."""
        if cls.required_sm is None:
            return True
        return capability is not None and (capability[0] in cls.required_sm or capability in cls.required_sm)

    @classmethod
    def required_arch(cls) -> str:
        """required_sm for a message: "SM10x", "SM90/SM100" and the like."""
        return "/".join(f"SM{m}x" if isinstance(m, int) else f"SM{m[0]}{m[1]}" for m in cls.required_sm or ())

    def _allocate_workspace(self) -> Optional[torch.Tensor]:
        if self.workspace_bytes == 0:
            return None
        return get_workspace(self.kernel_family, self.workspace_bytes, self.kv.device)

    # ----------------------------------------------------------------- metadata
    def init_forward_metadata(self, batch: AttnBatch, shared_block_tables: Optional[torch.Tensor] = None) -> None:
        """Block tables from ``req_to_token`` on the device, eager or inside a captured graph alike.

        shared_block_tables: ``[B, max_pages]`` int32 built by another backend over the same
        requests (the multi-step draft's steps share one table); used as is, not copied.
        Contiguous int32 ``seq_lens`` and ``cu_seqlens_q`` are used as they are, not copied:
        change them only for the next pass. A refused call leaves no metadata, so a forward then
        raises instead of running on the previous pass's.
        """
        self.metadata = None
        bs = batch.batch_size
        shapes = (tuple(batch.req_pool_indices.shape), tuple(batch.seq_lens.shape), tuple(batch.cu_seqlens_q.shape))
        if bs > self.max_batch_size or shapes != ((bs,), (bs,), (bs + 1,)):
            raise ValueError(f"{self.name}: a batch of {bs} (at most max_batch_size={self.max_batch_size}) needs "
                             f"req_pool_indices and seq_lens [{bs}] and cu_seqlens_q [{bs + 1}], got {shapes}")
        if batch.max_kv_len is not None and not (is_int(batch.max_kv_len) and batch.max_kv_len >= 1):
            raise ValueError(f"{self.name}: max_kv_len must be None or an int >= 1, got {batch.max_kv_len!r}")
        if shared_block_tables is not None and (tuple(shared_block_tables.shape) != (bs, self.max_pages)
                                                or shared_block_tables.dtype != torch.int32):
            raise ValueError(f"{self.name}: shared_block_tables must be [{bs}, {self.max_pages}] int32 (this batch's "
                             f"requests), got {tuple(shared_block_tables.shape)} {shared_block_tables.dtype}")
        tables = shared_block_tables
        if tables is None:
            tables = block_tables(self.kv.req_to_token, batch.req_pool_indices, self.page_size)
        max_seq_len = self.max_pages * self.page_size
        if batch.max_kv_len is not None:
            max_seq_len = min(batch.max_kv_len, max_seq_len)
        # Kernels take contiguous metadata; a strided view (a column of an engine's table) is copied.
        self.metadata = PagedMetadata(tables, batch.seq_lens.int().contiguous(), batch.cu_seqlens_q.int().contiguous(),
                                      max_seq_len)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Nothing to allocate: a captured pass builds its metadata on the device inside the graph,
        whose memory pool keeps those tensors where every replay reads them; copies into static
        buffers would only add a node each."""

    def init_forward_metadata_replay_cuda_graph(self, bs: int, seq_lens: torch.Tensor, q_len: int) -> None:
        """Nothing to plan on the host: the metadata is built on the device inside the graph."""

    def get_verify_buffers_to_fill_after_draft(self) -> list[Optional[torch.Tensor]]:
        return [self.tree_mask]

    def kv_len_bounds(self, batch_size: int, q_len: int) -> tuple[int, ...]:
        return ()

    # ------------------------------------------------------------------ forward
    def kv_rows(self, layer_id: int, batch: AttnBatch, dtype: torch.dtype, tokens: int,
                heads: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Where a dense pass's new KV rows go, for a model that writes them itself (its latents
        kernel) and then calls forward with kv_new None: (the layer's cache as rows ``[slots, 576]``,
        batch.out_cache_loc ``[T]`` int64); None where the cache does not hold ``dtype`` rows as
        they are (fp8: forward encodes them) or the pass has no tokens. The pass is checked as
        forward checks it, q's ``tokens`` and ``heads`` included, so a refused pass writes nothing."""
        self._check_dense(layer_id)
        self._check_batch(batch, self._direct(batch))
        if (tokens, heads) != (batch.num_tokens, self.layer.num_heads):
            raise ValueError(f"{self.name}: a pass of {batch.num_tokens} new tokens (out_cache_loc) over "
                             f"{self.layer.num_heads} heads, got q of {tokens} tokens and {heads} heads")
        cache = self.kv.kv_buffers[layer_id]
        if cache.dtype != dtype or cache.element_size() == 1 or batch.num_tokens == 0:  # fp8: encoded, scaled
            return None
        return rows(cache), batch.out_cache_loc

    def forward(self, q: torch.Tensor, kv_new: Optional[torch.Tensor], layer_id: int, batch: AttnBatch) -> torch.Tensor:
        direct = self._direct(batch)
        self._check_dense(layer_id)
        self._check_pass(q, kv_new, batch, direct)
        if batch.num_tokens == 0:  # (kernels take no empty query; nothing to write either)
            return q.new_empty(0, q.shape[1], KV_LORA_RANK)
        md = self.metadata
        cache = self.kv.kv_buffers[layer_id]
        if kv_new is not None:
            self._write_kv(cache, kv_new, batch.out_cache_loc)
        if direct:  # uniform query lengths the decode kernel takes: one call; a longer prefill goes in chunks
            bs, q_len = batch.batch_size, batch.max_q_len
            out = self._run_decode_kernel(
                q.view(bs, q_len, *q.shape[1:]), cache, md.block_tables, md.seq_lens, md.max_seq_len, batch.custom_mask
            )
            return out.reshape(q.shape[0], q.shape[1], KV_LORA_RANK)
        return self._run_prefill_kernel(q, cache, md.block_tables, md.seq_lens, md.cu_seqlens_q, batch.max_q_len, md.max_seq_len)

    def _direct(self, batch: AttnBatch) -> bool:
        """The pass goes to the decode kernel in one call (uniform query lengths it takes)."""
        return batch.uniform_q_len and (self.max_decode_q_len is None or batch.max_q_len <= self.max_decode_q_len)

    def _check_dense(self, layer_id: int) -> None:
        """forward's and kv_rows' checks of the backend and the layer (the pass's: _check_pass)."""
        if not self.supports_dense:
            raise ValueError(f"{self.name} runs sparse passes only (supports_dense=False), not a dense model's forward")
        if not 0 <= layer_id < len(self.kv.kv_buffers):
            raise ValueError(f"{self.name}: layer_id must lie in [0, {len(self.kv.kv_buffers)}) (the pool's "
                             f"layers: the model's num_attention_layers), got {layer_id!r}")

    # ------------------------------------------------------------ sparse (DSA)
    def index_topk(self, q: torch.Tensor, weights: torch.Tensor, k_new: torch.Tensor, layer_id: int,
                   batch: AttnBatch, topk: int) -> torch.Tensor:
        self.check_sparse(topk, k_new.shape[-1], layer_id)
        self._check_pass(q, k_new, batch, True, heads=q.shape[1] if q.dim() == 3 else -1, width=k_new.shape[-1])
        if tuple(weights.shape) != tuple(q.shape[:2]) or weights.dtype != torch.float32:
            raise ValueError(f"{self.name}: index_topk's weights must be [{q.shape[0]}, {q.shape[1]}] fp32 (q's tokens "
                             f"and heads), got {tuple(weights.shape)} {weights.dtype}")
        cache = self.kv.index_buffers[layer_id]
        cache.view(-1, cache.shape[-1]).index_copy_(0, batch.out_cache_loc, k_new.to(cache.dtype))
        md = self.metadata
        return self._run_index_kernel(q, weights, cache, md.block_tables, md.seq_lens, md.cu_seqlens_q,
                                      batch.max_q_len, topk, batch.custom_mask, md.max_seq_len)

    def forward_sparse(self, q: torch.Tensor, kv_new: Optional[torch.Tensor], layer_id: int, batch: AttnBatch,
                       slots: torch.Tensor) -> torch.Tensor:
        self.check_sparse(slots.shape[-1], None, layer_id)
        self._check_pass(q, kv_new, batch, True)
        if slots.dim() != 2 or slots.shape[0] != q.shape[0] or slots.dtype != torch.int32:
            raise ValueError(f"{self.name}: slots must be [{q.shape[0]}, topk] int32, got {tuple(slots.shape)} {slots.dtype}")
        cache = self.kv.kv_buffers[layer_id]
        if kv_new is not None:
            self._write_kv(cache, kv_new, batch.out_cache_loc)
        return self._run_sparse_kernel(q, cache, slots)

    def check_sparse(self, topk: int, index_head_dim: Optional[int], layer_id: int = 0) -> None:
        """ValueError naming the setting to change unless this backend and its pool can run a sparse
        pass selecting ``topk`` rows a token with indexer keys ``index_head_dim`` wide (None: unchecked)."""
        if not self.supports_sparse:
            from attn.registry import sparse_backend_names  # (the registry imports this module)

            raise ValueError(f"{self.name} has no sparse attention (supports_sparse=False), which DeepSeek-V3.2's "
                             f"index_topk needs; pick a sparse attention backend: {sparse_backend_names()}")
        if not is_int(topk) or topk < 1 or (self.max_index_topk is not None and topk > self.max_index_topk):
            bound = f"in [1, {self.max_index_topk}]" if self.max_index_topk is not None else "an int >= 1"
            raise ValueError(f"{self.name}: index_topk must be {bound} (the rows its sparse kernel takes a token), "
                             f"got {topk!r}")
        if not 0 <= layer_id < len(self.kv.kv_buffers):
            raise ValueError(f"{self.name}: layer_id must lie in [0, {len(self.kv.kv_buffers)}), got {layer_id!r}")
        if index_head_dim is not None and (len(self.kv.index_buffers) != len(self.kv.kv_buffers)
                                           or self.kv.index_buffers[layer_id].shape[-1] != index_head_dim):
            held = [tuple(b.shape[2:]) for b in self.kv.index_buffers[:1]]
            raise ValueError(f"{self.name}: the KV pool holds no indexer keys of index_head_dim={index_head_dim} for "
                             f"each of its {len(self.kv.kv_buffers)} layers (index buffers: {len(self.kv.index_buffers)}, "
                             f"widths {held}); build it with index_head_dim={index_head_dim} (MLAKVPool)")

    def _run_index_kernel(self, q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          max_q_len: int, topk: int, custom_mask: Optional[torch.Tensor],
                          max_seq_len: int) -> torch.Tensor:
        """The indexer's kernel: q ``[T, Hi, D]``, weights ``[T, Hi]`` fp32, index_cache
        ``[num_pages, page_size, D]``; the rest as _run_ragged_kernel's (max_seq_len: the pass's host
        bound of seq_lens, so a kernel scores that many positions, not the tables' width). Returns
        ``[T, topk]`` int32 slots (index_topk's contract)."""
        raise NotImplementedError(f"{type(self).__name__} defines no indexer kernel")

    def _run_sparse_kernel(self, q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, 576]`` over the rows ``slots`` ``[T, K]`` int32 (-1: none) of kv_cache ``[num_pages,
        page_size, 576]`` -> ``[T, H, 512]`` in q's dtype (0 for a token with no row)."""
        raise NotImplementedError(f"{type(self).__name__} defines no sparse kernel")

    def _check_pass(self, q: torch.Tensor, kv_new: Optional[torch.Tensor], batch: AttnBatch, direct: bool,
                    heads: Optional[int] = None, width: int = KV_DIM) -> None:
        """What forward can check on the host, all before its cache write, so that a refused pass
        leaves the cache as it was (direct: the pass goes to the decode kernel in one call; heads x
        width: q's, the layer's heads x 576 unless given, kv_new's width too: index_topk's; kv_new
        None: the rows are in the cache already, kv_rows). The device metadata (cu_seqlens_q[-1] ==
        the token count, q_lens <= max_q_len) is not checked: that would sync."""
        self._check_batch(batch, direct)
        heads, tokens = heads or self.layer.num_heads, batch.num_tokens
        if q.dim() != 3 or tuple(q.shape[1:]) != (heads, width):
            raise ValueError(f"{self.name}: q must be [tokens, {heads}, {width}], got {tuple(q.shape)}")
        if q.stride(2) != 1:
            raise ValueError(f"{self.name}: q's last dim must be contiguous, got strides {q.stride()}")
        if q.shape[0] != tokens or (kv_new is not None and tuple(kv_new.shape) != (tokens, width)):
            got = "none" if kv_new is None else tuple(kv_new.shape)
            raise ValueError(f"{self.name}: a pass of {tokens} new tokens (out_cache_loc) needs {tokens} query rows "
                             f"and kv rows [{tokens}, {width}], got {q.shape[0]} and {got}")

    def _check_batch(self, batch: AttnBatch, direct: bool) -> None:
        """_check_pass's checks of the batch and the metadata alone."""
        if self.metadata is None:
            raise RuntimeError(f"{self.name}: init_forward_metadata was not called before forward")
        if self.metadata.seq_lens.shape[0] != batch.batch_size:
            raise ValueError(f"{self.name}: the metadata was built for a batch of {self.metadata.seq_lens.shape[0]} "
                             f"requests, this pass has {batch.batch_size}; call init_forward_metadata with its batch")
        tokens = batch.num_tokens
        if not is_int(batch.max_q_len) or batch.max_q_len < min(tokens, 1):
            raise ValueError(f"{self.name}: max_q_len must be an int >= 1 (0 for no tokens), got {batch.max_q_len!r}")
        mode = batch.mode
        if (mode is ForwardMode.EXTEND and not self.supports_prefill) or (
                mode is ForwardMode.DRAFT_EXTEND and not self.supports_draft_extend):
            fallback = f"; {self.prefill_fallback} serves it (attn.registry)" if self.prefill_fallback else ""
            raise ValueError(f"{self.name} runs no {mode.value} pass{fallback}")
        if not direct and mode is not ForwardMode.EXTEND:
            if not batch.uniform_q_len:
                raise ValueError(f"{self.name}: variable query lengths are only supported for prefill (EXTEND), "
                                 f"not {mode.value}")
            raise ValueError(f"{self.name}: its decode kernel takes at most {self.max_decode_q_len} query tokens a "
                             f"request, this {mode.value} pass has {batch.max_q_len}")
        if batch.uniform_q_len and tokens != batch.batch_size * batch.max_q_len:
            raise ValueError(f"{self.name}: {batch.batch_size} requests of {batch.max_q_len} query tokens need "
                             f"{batch.batch_size * batch.max_q_len} query rows, got {tokens}")
        mask = batch.custom_mask
        if mask is None:
            return
        if not self.supports_tree_mask:
            raise ValueError(f"{self.name} cannot attend with a tree mask; use topk=1 or a tree-mask backend")
        if not batch.uniform_q_len:
            raise ValueError(f"{self.name}: a tree mask needs a pass of uniform query lengths (verify, draft steps)")
        expected = (batch.batch_size, batch.max_q_len)
        if mask.dtype != torch.bool or mask.dim() != 3 or tuple(mask.shape[:2]) != expected or mask.shape[2] < 1:
            raise ValueError(f"{self.name}: the tree mask must be [{expected[0]}, {expected[1]}, M >= 1] bool, "
                             f"got {tuple(mask.shape)} {mask.dtype}")
        cache_device = self.kv.kv_buffers[0].device
        if mask.device != cache_device:
            raise ValueError(f"{self.name}: the tree mask is on {mask.device}, the cache on {cache_device}")
        if mask.stride(2) != 1:
            raise ValueError(f"{self.name}: the tree mask's last dim must be contiguous, got strides {mask.stride()}")

    def _write_kv(self, cache: torch.Tensor, kv_new: torch.Tensor, loc: torch.Tensor) -> None:
        rows(cache).index_copy_(0, loc, rows(encode_kv(kv_new, cache.dtype, self.kv.kv_scale)))

    def bmm1_scale(self) -> float:
        """Scale applied to q·K: k_scale (fp8 cache only) * softmax scale."""
        return self.bmm2_scale() * self.layer.sm_scale

    def bmm2_scale(self) -> float:
        """Scale applied to softmax·V: the v (= k) scale of an fp8 cache."""
        return self.kv.kv_scale if self.kv.kv_buffers[0].dtype == torch.float8_e4m3fn else 1.0

    # ------------------------------------------------------------- kernel seam
    def _run_decode_kernel(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        custom_mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """The one kernel call of uniform-q modes (decode, verify, draft-extend, draft steps).

        query: ``[B, q_len, H, 576]``; kv_cache: ``[num_pages, page_size, 576]``;
        block_tables: ``[B, max_pages]`` int32; seq_lens: ``[B]`` int32 (new tokens included);
        custom_mask: ``[B, q_len, M]`` bool or None (causal). Returns ``[B, q_len, H, 512]``.
        """
        raise NotImplementedError(f"{type(self).__name__} defines no decode kernel")

    @classmethod
    def prefill_chunk_len(cls, max_q_len: int, max_seq_len: int) -> int:
        """Query tokens a request of each decode-kernel call of the default ``_run_prefill_kernel``
        (max_q_len and max_seq_len: the pass's host bounds, which every request's q_len <= L lies
        within): max_decode_q_len where the kernel takes fewer than max_q_len, or compiles per
        query length; else max_q_len. Padded chunks read more kv rows past a short request's
        length, so only a kernel compiled per length pads them."""
        chunk = min(cls.max_decode_q_len or max_q_len, max_seq_len)
        return chunk if cls.compiles_per_q_len else min(chunk, max_q_len)

    def _run_prefill_kernel(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        max_q_len: int,
        max_seq_len: int,
    ) -> torch.Tensor:
        """Causal attention for ragged prefill: query ``[T, H, 576]`` -> ``[T, H, 512]``, no host sync.

        Default: the decode kernel over chunks of prefill_chunk_len query tokens a request (one
        width where the kernel compiles per q_len: tests/test_sm100_compile.py compiles it). Chunk j
        (from the end) of a request of kv length L holds kv positions ``[E - chunk, E)`` and sees kv
        length E = max(L - j * chunk, chunk), so no chunk sees fewer kv rows than its query tokens
        (the decode kernels assume a kv row at every query position) or more than max(L, chunk). A
        request shorter than a chunk reads kv rows past L, hidden by the causal mask: they must hold
        finite values (KVCacheView), as 0 x NaN is NaN. O(B x max(max_q_len, chunk)) rows in all.
        """
        num_tokens, heads = query.shape[:2]
        if num_tokens == 0:
            return query.new_empty(0, heads, KV_LORA_RANK)
        chunk = self.prefill_chunk_len(max_q_len, max_seq_len)
        kv_len = seq_lens.long()
        starts, ends = cu_seqlens_q[:-1].long(), cu_seqlens_q[1:].long()
        first_new = kv_len - (ends - starts)  # [B]: the kv position of each request's first query token
        out = query.new_empty(num_tokens + 1, heads, KV_LORA_RANK)  # the last row is the trash row
        cols = torch.arange(chunk, device=query.device)
        for j in range(-(-max_q_len // chunk)):
            # A chunk's [B, chunk] cells: the new tokens at positions no later chunk holds, gathered
            # from query and scattered back; the others are padding, which read the last token and
            # write the trash row (a chunk of them alone sees the first ``chunk`` kv rows, not a
            # long cached prefix).
            later = kv_len - j * chunk  # [B]: positions from here on are the later chunks'
            end = later.clamp(min=chunk)
            position = end[:, None] - chunk + cols  # [B, chunk]
            present = (position >= first_new[:, None]) & (position < later[:, None])
            token = torch.where(present, starts[:, None] + position - first_new[:, None], num_tokens)
            lens = torch.where(present.any(1), end, chunk).int()
            part = self._run_decode_kernel(query[token.clamp(max=num_tokens - 1)], kv_cache, block_tables, lens,
                                           max_seq_len, None)
            out.index_copy_(0, token.flatten(), part.flatten(0, 1).to(out.dtype))
        return out[:num_tokens]


class RaggedKernelBackend(PagedMLABackend):
    """A family whose one kernel takes packed ragged queries with an optional tree mask
    (``_run_ragged_kernel``); uniform-q passes flatten into it, prefill calls it directly."""

    supports_tree_mask = True

    def _run_decode_kernel(self, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask):
        bs, q_len = query.shape[:2]
        cu = const_arange((bs + 1) * q_len, query.device, q_len, torch.int32)
        out = self._run_ragged_kernel(query.flatten(0, 1), kv_cache, block_tables, seq_lens, cu, q_len, custom_mask,
                                      max_seq_len)
        return out.view(bs, q_len, *out.shape[1:])

    def _run_prefill_kernel(self, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, max_seq_len):
        return self._run_ragged_kernel(query, kv_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len, None,
                                       max_seq_len)

    def _run_ragged_kernel(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        max_q_len: int,
        custom_mask: Optional[torch.Tensor],
        max_seq_len: int,
    ) -> torch.Tensor:
        """query ``[T, H, 576]`` packed by ``cu_seqlens_q`` ``[B + 1]`` int32; custom_mask
        ``[B, max_q_len, M]`` bool or None (causal); max_seq_len: host bound of seq_lens. Returns
        ``[T, H, 512]`` in query's dtype."""
        raise NotImplementedError(f"{type(self).__name__} defines no ragged kernel")
