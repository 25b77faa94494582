"""Paged MLA KV pool: per-layer ``[num_pages, page_size, 576]`` storage, page allocator, req_to_token.

Each request owns whole pages; position p of request r lives in slot
``pages[p // page_size] * page_size + p % page_size`` and ``req_to_token[r, p]`` holds that slot.
Page 0 and req_to_token row 0 are never handed out: padded rows of CUDA graphs use row 0, whose
slots all lie in page 0, so they read and write nothing of a real request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from attn.base import KVCacheView, kv_row_width
from attn.paged import rows
from specdec.config import ConfigError, SpecConfig

PADDING_PAGE = 0
PADDING_ROW = 0
GROW_AHEAD_PAGES = 2  # extra pages a growing request takes at once (MLAKVPool.grow)


class OutOfPagesError(RuntimeError):
    """The pool has too few free pages for a request; nothing was allocated."""


@dataclass
class _Request:
    pages: list[int] = field(default_factory=list)


class MLAKVPool:
    """KV storage for ``num_layers`` MLA layers and the request -> slot map.

    kv_buffers[layer]: ``[num_pages, page_size, 576]`` of ``dtype`` (fp8_v32's uint8: 656, kv_row_width).
    index_buffers[layer]: ``[num_pages, page_size, index_head_dim]`` of ``index_dtype`` (default
    :meth:`index_dtype_for` ``dtype``), a sparse model's indexer keys (KVCacheView.index_buffers);
    none when index_head_dim is 0.
    req_to_token: ``[max_requests + 1, max_context_len]`` int32 (max_context_len a multiple of
    page_size); row 0 is the padding row.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        max_requests: int,
        max_context_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_scale: float = 1.0,
        index_head_dim: int = 0,
        index_dtype: torch.dtype | None = None,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is the padding sink), got {num_pages}")
        if max_context_len % page_size:
            raise ValueError(f"max_context_len {max_context_len} must be a multiple of page_size {page_size}")
        if (max_requests + 1) * max_context_len >= 2**31:
            raise ValueError(f"(max_requests + 1) * max_context_len must stay below 2**31 (int32 slot indices), got "
                             f"{max_requests + 1} * {max_context_len}; lower one of them")
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        width = kv_row_width(dtype)
        self.kv_buffers = [torch.zeros(num_pages, page_size, width, dtype=dtype, device=self.device)
                           for _ in range(num_layers)]
        self.index_buffers = [torch.zeros(num_pages, page_size, index_head_dim, dtype=index_dtype or self.index_dtype_for(dtype),
                                          device=self.device) for _ in range(num_layers if index_head_dim else 0)]
        self.req_to_token = torch.zeros(max_requests + 1, max_context_len, dtype=torch.int32, device=self.device)
        self.kv_scale = kv_scale
        self.capacity = np.zeros(max_requests + 1, dtype=np.int64)  # tokens each row's pages hold: a vectorised per-step check
        self._init_allocator()
        self._staging: torch.Tensor | None = None  # [2, n] int32, pinned on CUDA: see _write_slots
        self._staging_done: torch.cuda.Event | None = None  # CUDA: after the staging buffer's last copy

    @staticmethod
    def index_dtype_for(dtype: torch.dtype) -> torch.dtype:
        """The indexer keys' default dtype beside a latent cache of ``dtype``: the same, but bf16 in
        place of a one-byte (fp8) one, whose keys would need a per-token scale index_topk does not
        apply."""
        return torch.bfloat16 if torch.empty((), dtype=dtype).element_size() == 1 else dtype

    @classmethod
    def bytes_for(cls, num_layers: int, num_pages: int, page_size: int, max_requests: int, max_context_len: int,
                  dtype: torch.dtype, index_head_dim: int = 0) -> int:
        """The bytes a pool of these sizes allocates (index keys in their default dtype): its KV
        pages, its indexer keys and its req_to_token table."""
        row = kv_row_width(dtype) * torch.empty((), dtype=dtype).element_size()
        row += index_head_dim * torch.empty((), dtype=cls.index_dtype_for(dtype)).element_size()
        return num_layers * num_pages * page_size * row + (max_requests + 1) * max_context_len * 4

    def _init_allocator(self) -> None:
        """Every page and row free (page 0 and row 0 are never handed out)."""
        self._free_pages = list(range(self.num_pages - 1, PADDING_PAGE, -1))  # pop() hands out low pages first
        self._free_rows = list(range(self.req_to_token.shape[0] - 1, PADDING_ROW, -1))
        self._requests: dict[int, _Request] = {}
        self.capacity[:] = 0

    def reset(self) -> None:
        """Free every row and page at once: every position points at the padding page again."""
        self.req_to_token.zero_()
        self._init_allocator()

    def view(self) -> KVCacheView:
        """What attention backends see of this pool."""
        return KVCacheView(self.kv_buffers, self.req_to_token, self.page_size, self.kv_scale, self.index_buffers)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's row at slots ``src`` ``[N]`` int64 to slots ``dst`` ``[N]`` (distinct):
        the latent rows and a sparse model's indexer keys alike, which share slots (a tree's
        accepted path moved into place). Every source is read before any destination is written."""
        for buf in (*self.kv_buffers, *self.index_buffers):
            flat = rows(buf)
            flat.index_copy_(0, dst, flat[src])

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def alloc_request(self) -> int:
        """Reserve a req_to_token row; returns its index. The row is registered before it leaves
        the free list: an interrupt between the two leaves it free, and the next call takes it."""
        if not self._free_rows:
            raise OutOfPagesError(f"all {self.req_to_token.shape[0] - 1} request rows are in use "
                                  "(SpecConfig.max_batch_size)")
        row = self._free_rows[-1]
        self._requests[row] = _Request()
        self._free_rows.pop()
        return row

    def _request(self, row: int) -> _Request:
        if row not in self._requests:
            raise KeyError(f"request row {row} is not allocated (alloc_request first, or it was freed)")
        return self._requests[row]

    def pages_for(self, num_tokens):
        """Pages that hold ``num_tokens`` positions (an int, or an int array elementwise)."""
        return -(-num_tokens // self.page_size)

    def ensure_capacity(self, row: int, num_tokens: int) -> None:
        """Give request ``row`` pages for positions ``[0, num_tokens)``; all or nothing."""
        self.ensure_capacity_many([row], [num_tokens])

    def ensure_capacity_many(self, rows: list[int], num_tokens: list[int]) -> None:
        """``ensure_capacity`` for several requests at once, with one req_to_token write; all or
        nothing over the whole list, whose rows must be distinct."""
        ps, need = self.page_size, []
        if len(set(rows)) != len(rows):  # each entry's pages are counted from the row's own
            raise ValueError(f"ensure_capacity_many: rows repeat ({rows}); give each row once, with its largest count")
        for row, n in zip(rows, num_tokens):
            req = self._request(row)
            if n > self.max_context_len:
                raise ValueError(f"{n} tokens exceed max_context_len {self.max_context_len}")
            need.append(max(0, self.pages_for(n) - len(req.pages)))
        if sum(need) > len(self._free_pages):
            raise OutOfPagesError(f"need {sum(need)} more KV pages, {len(self._free_pages)} free; raise num_pages")
        writes = []  # (flat req_to_token index of the page's first slot, page)
        held = [len(self._requests[row].pages) for row in rows]
        try:
            for row, k in zip(rows, need):
                req = self._requests[row]
                for _ in range(k):
                    req.pages.append(self._free_pages.pop())
                    writes.append((row * self.max_context_len + (len(req.pages) - 1) * ps, req.pages[-1]))
                self.capacity[row] = len(req.pages) * ps
            if writes:
                self._write_slots(writes)
        except BaseException:  # the slots' write failed (out of memory): the pages go back, as trim returns them
            for row, n in zip(reversed(rows), reversed(held)):
                self.trim(row, n * ps)
            raise

    def trim(self, row: int, num_tokens: int) -> None:
        """Return the pages of request ``row`` past position ``num_tokens`` (0 frees them all).
        Their positions point at page 0 again, so that a stray write through them cannot reach
        the pages' next owner."""
        req = self._request(row)
        if num_tokens < 0:
            raise ValueError(f"trim: num_tokens must be >= 0, got {num_tokens}")
        keep = self.pages_for(num_tokens)
        if len(req.pages) <= keep:
            return
        freed = req.pages[keep:]
        del req.pages[keep:]
        self._free_pages.extend(reversed(freed))
        self.req_to_token[row, keep * self.page_size:(keep + len(freed)) * self.page_size] = PADDING_PAGE * self.page_size
        self.capacity[row] = len(req.pages) * self.page_size

    def trim_many(self, rows: np.ndarray, num_tokens: np.ndarray) -> None:
        """``trim`` each request ``rows[i]`` to ``num_tokens[i]`` positions."""
        for row, n in zip(rows.tolist(), num_tokens.tolist()):
            self.trim(row, n)

    def spare_pages(self, rows: np.ndarray, num_tokens: np.ndarray) -> int:
        """The pages ``trim_many(rows, num_tokens)`` would return."""
        return int((self.capacity[rows] // self.page_size - self.pages_for(num_tokens)).clip(min=0).sum())

    def shortfall(self, rows: np.ndarray, need: np.ndarray) -> int:
        """The pages ``grow(rows, need, ...)`` would lack: those the requests need beyond what they
        hold, less the free ones and those they hold past their own need (0: grow succeeds)."""
        held = self.capacity[rows] // self.page_size
        wanted = int((self.pages_for(need) - held).clip(min=0).sum())
        return max(0, wanted - self.num_free_pages - self.spare_pages(rows, need))

    def grow(self, rows: np.ndarray, need: np.ndarray, most: np.ndarray) -> None:
        """Pages for every request ``rows[i]`` to hold ``need[i]`` positions: GROW_AHEAD_PAGES more
        (never past ``most[i]`` >= need[i], what it can ever need) while the pool has them, else
        exactly, else after taking back the pages all of them hold past their own need (earlier
        grow-ahead); OutOfPagesError, changing nothing, if even those are too few (shortfall)."""
        short = np.flatnonzero(need > self.capacity[rows])
        if not short.size:
            return
        missing = self.shortfall(rows, need)
        if missing:
            raise OutOfPagesError(f"need {missing} more KV pages than are free or held ahead of need; raise num_pages")
        grow, exact = rows[short].tolist(), need[short].tolist()
        ahead = np.minimum(need[short] + GROW_AHEAD_PAGES * self.page_size, most[short]).tolist()
        for attempt in (ahead, exact):
            try:
                self.ensure_capacity_many(grow, attempt)
                return
            except OutOfPagesError:
                pass
        self.trim_many(rows, need)
        self.ensure_capacity_many(grow, exact)

    def rows_held(self) -> frozenset[int]:
        """The rows alloc_request has handed out (or was handing out when interrupted)."""
        return frozenset(self._requests)

    def free_rows_since(self, held: frozenset[int]) -> None:
        """Free every row taken since rows_held() gave ``held``: a caller interrupted while it took
        rows frees what it may not have received."""
        for row in set(self._requests) - held:
            if row in self._free_rows:  # alloc_request interrupted before the row left the list
                del self._requests[row]
            else:
                self.free_request(row)

    def free_request(self, row: int) -> None:
        """Return every page of request ``row`` and its row."""
        self.trim(row, 0)
        del self._requests[row]
        self._free_rows.append(row)

    def _write_slots(self, writes: list[tuple[int, int]]) -> None:
        """Point each new page's ``page_size`` positions at its slots without a sync: the
        (flat req_to_token index, slot) pairs are expanded on the host and go to the device
        through a persistent staging buffer (pinned on CUDA), then one indexed write. Few torch
        calls: on the host each costs more than the numpy work."""
        firsts, pages = np.asarray(writes, dtype=np.int64).T
        offsets = np.arange(self.page_size, dtype=np.int64)
        n = len(writes) * self.page_size
        on_cuda = self.device.type == "cuda"
        if self._staging is None or self._staging.shape[1] < n:
            if self._staging_done is not None:
                self._staging_done.synchronize()  # the old buffer's last copy is done before it is freed
            with torch.inference_mode(False):  # updated in place later, inside inference mode or not
                self._staging = torch.empty(2, 1 << (n - 1).bit_length(), dtype=torch.int32, pin_memory=on_cuda)
            self._staging_done = torch.cuda.Event() if on_cuda else None
        elif on_cuda:
            self._staging_done.synchronize()  # the last write's copy has left the buffer (long since)
        staged = self._staging.numpy()
        staged[0, :n] = (firsts[:, None] + offsets).ravel()
        staged[1, :n] = (pages[:, None] * self.page_size + offsets).ravel()
        index, slots = self._staging[:, :n].to(self.device, non_blocking=True)
        if on_cuda:
            self._staging_done.record()
        self.req_to_token.view(-1)[index] = slots


def available_memory(device: torch.device) -> int:
    """Bytes ``device`` can still allocate: free CUDA memory and the blocks torch's allocator holds
    unused, else the machine's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(config: SpecConfig, pools: tuple[tuple[int, int], ...], dtype: torch.dtype,
                 device: torch.device) -> None:
    """Refuse, naming the settings, pools of ``config``'s sizes that the device could not hold: one
    a ``(num_layers, index_head_dim)`` of ``pools`` (the worker's target and draft; index_head_dim
    0 for a dense model), a ConfigError with the bytes asked for and the bytes available."""
    asked = sum(MLAKVPool.bytes_for(layers, config.pool_pages, config.page_size, config.max_batch_size,
                                    config.max_context_len, dtype, index_head_dim) for layers, index_head_dim in pools)
    free = available_memory(device)
    if asked > free:
        index = [f"{layers} layers x {width}" for layers, width in pools if width]
        keys = f", plus indexer keys of {' + '.join(index)} values a token" if index else ""
        raise ConfigError(
            f"the KV pools need {asked / 2**30:.1f} GiB ({sum(layers for layers, _ in pools)} layers x "
            f"{config.pool_pages} pages (num_pages) x {config.page_size} tokens x {kv_row_width(dtype)} x {dtype}{keys}, and "
            f"req_to_token's (max_batch_size + 1) x max_context_len int32 a pool) but {device} has "
            f"{free / 2**30:.1f} GiB available; lower num_pages, max_context_len or max_batch_size")
