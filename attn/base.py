"""The MLA attention backend protocol and the batch description every backend reads.

MLA runs in absorbed (latent) form: a query is ``[tokens, heads, 576]`` (512 latent dims after
W_UK absorption + 64 rope dims), the cache holds one shared 576-wide row per token
(``[num_pages, page_size, 576]`` per layer) and the output is ``[tokens, heads, 512]`` (latent,
before W_UV). ``attn/`` knows nothing about EAGLE beyond :class:`ForwardMode`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import torch

from attn.v32_fp8 import V32_FP8_BYTES, V32_FP8_DTYPE, dequantize_v32, quantize_v32
from attn.values import is_int, is_kv_scale, is_positive_finite

if TYPE_CHECKING:  # (attn.paged imports this module)
    from attn.paged import PagedMetadata

KV_LORA_RANK = 512
QK_ROPE_DIM = 64
KV_DIM = KV_LORA_RANK + QK_ROPE_DIM  # 576
# Cache dtypes by the names backends list (kv_dtypes) and SpecConfig.kv_dtype takes. fp8_v32: FlashMLA's
# V3.2 rows of 656 bytes (attn.v32_fp8), stored as uint8; every other dtype holds 576 values a row.
KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn,
             "fp64": torch.float64, "fp8_v32": V32_FP8_DTYPE}
FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


class ForwardMode(enum.Enum):
    """What a forward pass computes; decides the query layout and masking."""

    DECODE = "decode"  # q_len tokens per request (1, or topk with a tree mask while drafting)
    EXTEND = "extend"  # prefill: variable q_len per request, causal
    TARGET_VERIFY = "target_verify"  # num_draft_tokens per request, causal or tree mask
    DRAFT_EXTEND = "draft_extend"  # fixed tokens per request (num_steps + 1), causal


_CONSTANTS: dict[tuple, torch.Tensor] = {}  # const_tensor's, by (key, device)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x / scale`` in ``dtype``; for float8_e4m3fn saturating at +-448 (torch before 2.12 cast
    a value past 464, and inf, to NaN; 2.12 saturates), divided in fp32 so it is rounded once.
    Another dtype takes ``x`` as it is (its scale is 1)."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    if scale == 1.0:  # (a query: 448 is exact in bf16/fp16, so the clamp rounds nothing)
        return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def kv_row_width(dtype: torch.dtype) -> int:
    """Elements of one cache row in ``dtype``: 656 bytes for fp8_v32's uint8 rows, else 576 values."""
    return V32_FP8_BYTES if dtype == V32_FP8_DTYPE else KV_DIM


def encode_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``[..., 576]`` latent rows as a cache of ``dtype`` stores them (to_cache_dtype's, or fp8_v32's
    quantize_v32): ``[..., kv_row_width(dtype)]``."""
    return quantize_v32(x) if dtype == V32_FP8_DTYPE else to_cache_dtype(x, dtype, scale)


def decode_kv(rows: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cache rows ``[..., kv_row_width]`` as the ``[..., 576]`` fp32 values they hold (times the
    per-tensor ``scale``; fp8_v32's rows carry their own)."""
    return dequantize_v32(rows) if rows.dtype == V32_FP8_DTYPE else rows.float() * scale


def const_tensor(key: tuple, device: torch.device, make: Callable[[torch.device], torch.Tensor]) -> torch.Tensor:
    """``make(device)`` built once per (key, device) and reused (read-only): a pass's index vectors
    and layouts are constants, not kernels in every pass and every graph replay. Under stream
    capture an uncached one is built inside the graph: a tensor first made there holds nothing
    until the graph's first replay, so it is not cached. key names the tensor in full, e.g.
    ("arange", 6, 1, torch.long)."""
    device = torch.device(device)
    cached = _CONSTANTS.get((key, device))
    if cached is not None:
        return cached
    with torch.inference_mode(False):  # a normal tensor: usable inside inference mode or not
        t = make(device)
    if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        _CONSTANTS[(key, device)] = t
    return t


def const_arange(end: int, device: torch.device, step: int = 1, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``arange(0, end, step)`` on ``device`` as a const_tensor."""
    return const_tensor(("arange", end, step, dtype), device,
                        lambda dev: torch.arange(0, end, step, dtype=dtype, device=dev))


@dataclass
class KVCacheView:
    """The paged KV storage a backend reads and writes; owned by the engine (specdec.kv).

    kv_buffers: one contiguous ``[num_pages, page_size, 576]`` tensor per layer (KV_DTYPES' dtypes;
        fp8_v32's uint8 rows are 656 wide: kv_row_width).
    req_to_token: ``[max_reqs, max_context_len]`` int32, token slot (page * page_size + offset)
        of each position of each request; positions of a request lie in its pages in order, so
        ``req_to_token[r, ::page_size] // page_size`` is its block table.
    kv_scale: per-tensor dequantisation scale of an fp8 cache (1.0 otherwise, fp8_v32's too).
    index_buffers: sparse models (DeepSeek-V3.2) only: the indexer's keys, one contiguous
        ``[num_pages, page_size, index_head_dim]`` tensor per layer; empty for dense models. They sit
        beside kv_buffers in the same pool and slots, so a request's pages, trims and frees cover both.
    Entries past a request's length must still be slots of the pool, and slots no request has
    written must hold finite values (zeros, or a freed request's kv): PagedMLABackend's chunked
    prefill of a request shorter than a chunk (up to 8 positions) reads those rows under the
    causal mask, and 0 x NaN is NaN.
    """

    kv_buffers: Sequence[torch.Tensor]
    req_to_token: torch.Tensor
    page_size: int
    kv_scale: float = 1.0
    index_buffers: Sequence[torch.Tensor] = ()

    def __post_init__(self) -> None:
        # Backends write a pass's rows through a [num_pages * page_size, 576] view of each buffer:
        # of another layout (e.g. one layer's slice of a page-first pool) that would be a copy,
        # and the writes would be lost.
        for layer, buf in enumerate(self.kv_buffers):
            width = kv_row_width(buf.dtype)
            if buf.dim() != 3 or tuple(buf.shape[1:]) != (self.page_size, width) or not buf.is_contiguous():
                raise ValueError(f"KVCacheView: layer {layer}'s kv buffer must be a contiguous [num_pages, "
                                 f"{self.page_size}, {width}] tensor, got shape {tuple(buf.shape)} strides {buf.stride()}")
        pages = self.kv_buffers[0].shape[0] if self.kv_buffers else None
        if self.index_buffers and len(self.index_buffers) != len(self.kv_buffers):
            raise ValueError(f"KVCacheView: {len(self.index_buffers)} index buffers for {len(self.kv_buffers)} kv "
                             "layers; give one a layer, or none")
        for layer, buf in enumerate(self.index_buffers):
            if buf.dim() != 3 or tuple(buf.shape[:2]) != (pages, self.page_size) or not buf.is_contiguous():
                raise ValueError(f"KVCacheView: layer {layer}'s index buffer must be a contiguous [{pages}, "
                                 f"{self.page_size}, index_head_dim] tensor (the kv pool's pages), got shape "
                                 f"{tuple(buf.shape)} strides {buf.stride()}")
        # Checked here, not first by a kernel: that runs after the pass's cache write.
        if not is_kv_scale(self.kv_scale):
            raise ValueError(f"KVCacheView: kv_scale must be a finite positive float in [2**-64, 2**64], "
                             f"got {self.kv_scale!r}")
        if self.kv_buffers and self.kv_buffers[0].dtype == V32_FP8_DTYPE and self.kv_scale != 1.0:
            raise ValueError(f"KVCacheView: an fp8_v32 cache's rows carry their own scales; kv_scale must be 1.0, "
                             f"got {self.kv_scale!r}")

    @property
    def max_context_len(self) -> int:
        return self.req_to_token.shape[1]

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device


@dataclass
class AttnBatch:
    """One forward pass as the attention backend sees it. All tensors live on the model's device.

    mode: the forward mode.
    req_pool_indices: ``[B]`` int64, rows of ``req_to_token``.
    seq_lens: ``[B]`` int32, kv length of each request *after* this pass (its new tokens included).
    out_cache_loc: ``[T]`` int64, cache slot each new token's KV row is written to.
    cu_seqlens_q: ``[B + 1]`` int32, query-token offsets (compact layout).
    max_q_len: static host bound of the per-request query length; equal to every request's q_len
        when ``uniform_q_len`` is True (decode, verify, draft-extend, draft tree steps).
    uniform_q_len: every request has exactly ``max_q_len`` query tokens.
    custom_mask: ``[B, max_q_len, M]`` bool or None: visibility of the last M kv positions of each
        request (earlier positions are always visible). None means causal.
    max_kv_len: a host bound on every ``seq_lens`` value, which backends plan their kernel launches
        for (``kv_len_bounds``); None: the longest context (the block tables' width).
    """

    mode: ForwardMode
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_q_len: int
    uniform_q_len: bool
    custom_mask: Optional[torch.Tensor] = None
    max_kv_len: Optional[int] = None

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.shape[0]


@dataclass(frozen=True)
class LayerSpec:
    """Static per-model attention facts a backend needs.

    num_heads: query heads per layer (16..128). sm_scale: softmax scale of the (nope + rope)-wide
    head (1/sqrt(192) for DeepSeek-V3), YaRN mscale included.
    index_topk / index_head_dim: a sparse model's (DeepSeek-V3.2's): the rows each query token
    attends to (index_topk / forward_sparse), and the width of its indexer keys, which the KV pool
    holds beside the latent rows. None / 0: a dense model.
    """

    num_heads: int
    sm_scale: float
    index_topk: Optional[int] = None
    index_head_dim: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.num_heads) or self.num_heads < 1:
            raise ValueError(f"LayerSpec: num_heads must be an int >= 1, got {self.num_heads!r}")
        if not is_positive_finite(self.sm_scale):  # (NaN made every output NaN, in every backend)
            raise ValueError(f"LayerSpec: sm_scale must be a finite positive float, got {self.sm_scale!r}")
        sparse = self.index_topk is not None
        if sparse and not (is_int(self.index_topk) and self.index_topk >= 1):
            raise ValueError(f"LayerSpec: index_topk must be None (dense) or an int >= 1, got {self.index_topk!r}")
        if not is_int(self.index_head_dim) or (self.index_head_dim >= 1) != sparse or self.index_head_dim < 0:
            raise ValueError(f"LayerSpec: index_head_dim must be an int >= 1 with index_topk (a sparse model), 0 "
                             f"without; got {self.index_head_dim!r} with index_topk={self.index_topk!r}")

    @property
    def sparse(self) -> bool:
        """Whether the model attends sparsely (index_topk, forward_sparse)."""
        return self.index_topk is not None


class AttentionBackend(Protocol):
    """The whole backend contract: every attribute and method the registry, the worker, the
    multi-step draft and the graph runner read. Implemented by :class:`attn.paged.PagedMLABackend`;
    a kernel family subclasses it, sets these class attributes and overrides only its kernel call
    (``_run_decode_kernel`` / ``_run_prefill_kernel``, the seam).

    Capabilities and constraints are class attributes, so callers never test a backend's class, and
    the registry (attn.registry.check_*) validates a setup before any kernel library is imported.
    """

    name: str  # the registry's name ("triton_mla"); every refusal names it
    kernel_family: str  # the workspace it shares (attn.workspace): one buffer per family and device
    needs_cpu_seq_lens: bool  # True: plans from host kv lengths (eager: a sync per pass); False: sync-free
    supports_tree_mask: bool  # attends with a custom (topk > 1) tree mask
    supports_sparse: bool  # runs index_topk and forward_sparse (DeepSeek-V3.2 sparse attention)
    supports_dense: bool  # runs forward (a dense model's attention); False: sparse passes only
    max_index_topk: Optional[int]  # rows a query token its sparse call takes at most; None: any
    sparse_kv_dtypes: Optional[tuple[str, ...]]  # cache dtypes its sparse passes take (kv_dtypes' names); None: kv_dtypes
    supports_cuda_graph: bool  # its passes can be captured (graphs.runner refuses it otherwise)
    supports_prefill: bool  # runs EXTEND passes (variable query lengths, causal)
    supports_draft_extend: bool  # runs DRAFT_EXTEND passes (num_steps + 1 query tokens a request)
    prefill_fallback: Optional[str]  # registry name of the backend serving the passes it cannot; None: none
    required_sm: Optional[tuple[int | tuple[int, int], ...]]  # capabilities: majors or (major, minor); None: any
    page_sizes: Optional[tuple[int, ...]]  # KV page sizes the kernel takes; None: any
    kv_dtypes: tuple[str, ...]  # cache dtypes it takes, by KV_DTYPES' names, and "auto" (the model's)
    table_tokens_multiple: int  # block tables (max_context_len tokens wide) span a multiple of this
    max_decode_q_len: Optional[int]  # query tokens a request its decode kernel takes; None: any
    compiles_per_q_len: bool  # the decode kernel compiles per q_len: prefill chunks are max_decode_q_len wide
    max_heads: Optional[int]  # query heads per layer it takes at most; None: any
    skipped_heads: range  # head counts up to max_heads it refuses all the same
    max_prefill_tokens: Optional[int]  # query tokens a prefill (EXTEND) pass may hold; None: any
    workspace_bytes: int  # bytes of its family's workspace it needs; 0: none
    metadata: Optional[PagedMetadata]  # the pass's device metadata (init_forward_metadata); None: not built

    def __init__(self, kv: KVCacheView, layer: LayerSpec, max_batch_size: int, max_q_len: int,
                 max_mask_len: int = 0) -> None:
        """A backend over ``kv`` for passes of at most ``max_batch_size`` requests; ValueError naming
        the setting to change where the kernel cannot take the heads, page size, dtype or device.
        max_q_len x max_mask_len size its tree-mask buffer ``[max_batch_size, max_q_len,
        max_mask_len]`` bool (tree-mask backends only)."""

    @classmethod
    def runs_on(cls, capability: Optional[tuple[int, int]]) -> bool:
        """Whether the kernel runs on a GPU of this compute capability (None: no GPU)."""

    @classmethod
    def required_arch(cls) -> str:
        """required_sm for a message: "SM10x", "SM90/SM100" and the like."""

    def init_forward_metadata(self, batch: AttnBatch, shared_block_tables: Optional[torch.Tensor] = None) -> None:
        """Build the pass's metadata (block tables, seq_lens; ``metadata``) on the device; call once
        per pass, before its layers. shared_block_tables: ``[B, max_pages]`` int32 another backend
        built over the same requests (the multi-step draft's steps), used as is."""

    def kv_rows(self, layer_id: int, batch: AttnBatch, dtype: torch.dtype, tokens: int,
                heads: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Where a dense pass's new KV rows go, for a model that writes them itself: (the layer's
        cache rows ``[slots, 576]`` of ``dtype``, batch.out_cache_loc ``[T]`` int64), after checking
        the pass as forward would, for a q of ``tokens`` x ``heads`` (so a refused pass writes
        nothing); None where the cache holds another dtype (forward encodes kv_new then) or the pass
        has no tokens."""

    def forward(self, q: torch.Tensor, kv_new: Optional[torch.Tensor], layer_id: int, batch: AttnBatch) -> torch.Tensor:
        """Write ``kv_new`` ``[T, 576]`` into the cache at ``batch.out_cache_loc``, then attend.

        q: ``[T, H, 576]``; returns ``[T, H, 512]`` in q's dtype. kv_new None: the model wrote the
        rows where kv_rows said.
        """

    def index_topk(self, q: torch.Tensor, weights: torch.Tensor, k_new: torch.Tensor, layer_id: int,
                   batch: AttnBatch, topk: int) -> torch.Tensor:
        """The lightning indexer (DeepSeek-V3.2): write ``k_new`` ``[T, D]`` into the layer's index
        buffer at ``batch.out_cache_loc``, then select each query token's ``topk`` rows.

        q: ``[T, index_heads, D]``; weights: ``[T, index_heads]`` fp32 (softmax scale folded in).
        A row's score is ``sum_h weights[t, h] * relu(q[t, h] . k[row])`` over the rows token t sees:
        causal, or batch.custom_mask's visibility (a tree token: the prefix and its ancestors), as in
        forward. Returns ``[T, topk]`` int32 cache slots (page * page_size + offset), best first, -1
        past the rows the token sees.
        """

    def check_sparse(self, topk: int, index_head_dim: Optional[int], layer_id: int = 0) -> None:
        """ValueError naming the setting to change unless this backend and its pool run sparse passes
        of ``topk`` rows a token (max_index_topk) over indexer keys ``index_head_dim`` wide in every
        layer (None: unchecked); index_topk and forward_sparse call it, a model before its first layer."""

    def forward_sparse(self, q: torch.Tensor, kv_new: Optional[torch.Tensor], layer_id: int, batch: AttnBatch,
                       slots: torch.Tensor) -> torch.Tensor:
        """forward's contract, attending only over ``slots`` ``[T, K]`` int32 (index_topk's; -1: none)
        instead of every visible row: the slots decide visibility, batch.custom_mask is not read."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Before the first capture: allocate whatever static buffers graphs capture against
        (largest sizes), if the backend has any; init_forward_metadata is captured with the pass
        it serves either way."""

    def init_forward_metadata_replay_cuda_graph(self, bs: int, seq_lens: torch.Tensor, q_len: int) -> None:
        """Before a capture or replay of a pass over ``bs`` requests: host planning from host kv
        lengths ``seq_lens`` (``[bs]`` int32, new tokens included) and ``q_len`` query tokens each.
        Only ``needs_cpu_seq_lens`` backends do work here; the others build their metadata on the
        device inside the graph."""

    def get_verify_buffers_to_fill_after_draft(self) -> list[Optional[torch.Tensor]]:
        """Preallocated buffers the tree builder writes in place: ``[tree_mask or None]``."""

    def kv_len_bounds(self, batch_size: int, q_len: int) -> tuple[int, ...]:
        """Kv lengths (ascending, below the longest context) up to which a uniform pass of
        ``batch_size`` requests x ``q_len`` tokens launches another kernel plan than the longest
        context's: a graph captured with such an ``AttnBatch.max_kv_len`` runs that plan. Empty
        where the plan does not follow the kv length."""
