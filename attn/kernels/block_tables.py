"""A pass's block tables from the pool's token table, one kernel on a GPU.

Why: torch gathers each request's whole ``req_to_token`` row, then slices every page_size-th
column and divides: two kernels reading page_size times the bytes the table needs (at 128k
tokens of context, 512 KB a request). The torch expression is what CPU runs and the tests
compare to.
"""

from __future__ import annotations

import torch

from attn.kernels.triton_lang import jit as _jit, tl, triton

BLOCK_PAGES = 256  # page columns a program writes


def block_tables(req_to_token: torch.Tensor, rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """Each request's pages: req_to_token ``[R, C]`` int32 (slots, >= 0), rows ``[B]`` int64 ->
    ``[B, ceil(C / page_size)]`` int32, entry [b, p] = req_to_token[rows[b], p * page_size] //
    page_size (the page holding the request's p-th page of tokens). E.g. page_size 4 and a row
    [8, 9, 10, 11, 20, 21, 22, 23, 0, ...] -> [2, 5, 0, ...]."""
    if triton is not None and rows.is_cuda and req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1:
        return triton_block_tables(req_to_token, rows, page_size)
    return (req_to_token[rows][:, ::page_size] // page_size).int()


def triton_block_tables(req_to_token: torch.Tensor, rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """block_tables' kernel (any device Triton runs on, its interpreter included)."""
    pages = -(-req_to_token.shape[1] // page_size)
    out = torch.empty(rows.shape[0], pages, dtype=torch.int32, device=rows.device)
    if out.numel():
        block = min(BLOCK_PAGES, triton.next_power_of_2(pages))
        _block_tables_kernel[(rows.shape[0], triton.cdiv(pages, block))](
            req_to_token, rows, out, req_to_token.stride(0), pages, PAGE_SIZE=page_size, BLOCK=block, num_warps=1)
    return out


@_jit
def _block_tables_kernel(r2t_ptr, rows_ptr, out_ptr, stride_r2t, PAGES, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = p < PAGES
    slot = tl.load(r2t_ptr + row * stride_r2t + p.to(tl.int64) * PAGE_SIZE, mask=keep, other=0)
    tl.store(out_ptr + b.to(tl.int64) * PAGES + p, slot // PAGE_SIZE, mask=keep)
