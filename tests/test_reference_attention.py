"""The vectorised reference against a per-request loop written from the definition."""

import dataclasses

import numpy as np
import pytest
import torch

from attn.backends.torch_ref import TorchRefBackend, paged_mla_reference
from attn.base import AttnBatch, ForwardMode, LayerSpec
from attn.paged import PagedMLABackend
from specdec.kv import MLAKVPool


def naive(q, kv_cache, block_tables, seq_lens, cu, scale, mask=None):
    out = torch.zeros(q.shape[0], q.shape[1], 512)
    ps = kv_cache.shape[1]
    for b in range(len(seq_lens)):
        L, s, e = int(seq_lens[b]), int(cu[b]), int(cu[b + 1])
        kv = torch.stack([kv_cache[block_tables[b, j // ps], j % ps] for j in range(L)]) if L else torch.zeros(0, 576)
        for i in range(e - s):
            p = L - (e - s) + i
            vis = [j for j in range(L) if (j <= p if mask is None else (j < L - mask.shape[2] or bool(mask[b, i, j - (L - mask.shape[2])])))]
            if not vis:
                continue
            k = kv[vis]
            w = torch.softmax(q[s + i] @ k.T * scale, dim=-1)
            out[s + i] = w @ k[:, :512]
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk_bytes", [None, 1])  # 1: a chunk of one query position
def test_matches_naive(page_size, masked, chunk_bytes, monkeypatch):
    if chunk_bytes is not None:
        monkeypatch.setattr("attn.backends.torch_ref._CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(page_size)
    heads, num_pages, bs = 3, 40, 3
    kv_cache = torch.randn(num_pages, page_size, 576, generator=g)
    max_pages = 64 // page_size
    block_tables = torch.randint(0, num_pages, (bs, max_pages), generator=g, dtype=torch.int32)
    q_len = 3
    seq_lens = torch.tensor([5, 3, 17], dtype=torch.int32)
    cu = torch.arange(0, (bs + 1) * q_len, q_len, dtype=torch.int32)
    q = torch.randn(bs * q_len, heads, 576, generator=g)
    mask = torch.rand(bs, q_len, 3, generator=g) > 0.5 if masked else None
    got = paged_mla_reference(q, kv_cache, block_tables, seq_lens, cu, q_len, 0.1, custom_mask=mask)
    torch.testing.assert_close(got, naive(q, kv_cache, block_tables, seq_lens, cu, 0.1, mask), rtol=1e-5, atol=1e-5)


def test_ragged_and_empty_requests():
    g = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(8, 4, 576, generator=g)
    block_tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    seq_lens = torch.tensor([0, 6], dtype=torch.int32)  # a padding row sees nothing
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    q = torch.randn(4, 2, 576, generator=g)
    got = paged_mla_reference(q, kv_cache, block_tables, seq_lens, cu, 3, 0.2)
    assert torch.equal(got[0], torch.zeros(2, 512))
    torch.testing.assert_close(got, naive(q, kv_cache, block_tables, seq_lens, cu, 0.2), rtol=1e-5, atol=1e-5)


def test_padding_rows_past_the_last_request_are_left_alone():
    """Query rows from cu_seqlens_q[B] on belong to no request (the kernels' contract): 0 in a new
    result, untouched in ``out``; the others as without them."""
    g = torch.Generator().manual_seed(1)
    kv_cache = torch.randn(8, 4, 576, generator=g)
    block_tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    seq_lens = torch.tensor([3, 6], dtype=torch.int32)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    q = torch.randn(5, 2, 576, generator=g)
    mask = torch.rand(2, 2, 3, generator=g) > 0.3
    for custom_mask in (None, mask):
        unpadded = paged_mla_reference(q[:3], kv_cache, block_tables, seq_lens, cu, 2, 0.2, custom_mask=custom_mask)
        got = paged_mla_reference(q, kv_cache, block_tables, seq_lens, cu, 2, 0.2, custom_mask=custom_mask)
        torch.testing.assert_close(got[:3], unpadded)
        assert torch.equal(got[3:], torch.zeros(2, 2, 512))
        out = torch.full((5, 2, 512), 7.0)
        paged_mla_reference(q, kv_cache, block_tables, seq_lens, cu, 2, 0.2, custom_mask=custom_mask, out=out)
        torch.testing.assert_close(out[:3], unpadded)
        assert torch.equal(out[3:], torch.full((2, 2, 512), 7.0))


def test_backend_writes_kv_then_attends():
    pool = MLAKVPool(1, 8, 4, 2, 16, torch.float32)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 6)
    backend = TorchRefBackend(pool.view(), LayerSpec(num_heads=2, sm_scale=0.3), max_batch_size=2, max_q_len=1)
    kv_new = torch.randn(6, 576)
    loc = pool.req_to_token[row, :6].long()
    batch = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([6], dtype=torch.int32), loc,
                      torch.tensor([0, 6], dtype=torch.int32), 6, False)
    backend.init_forward_metadata(batch)
    q = torch.randn(6, 2, 576)
    out = backend.forward(q, kv_new, 0, batch)
    assert torch.equal(pool.kv_buffers[0].view(-1, 576)[loc], kv_new)
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    scores = torch.einsum("thd,kd->thk", q, kv_new) * 0.3
    expected = torch.softmax(scores.masked_fill(~causal[:, None, :], float("-inf")), -1) @ kv_new[:, :512]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_kv_rows_take_the_models_own_write():
    """kv_rows checks the pass and names the cache rows and slots; a forward with kv_new None then
    attends over what the model wrote there, as a forward that writes kv_new itself would."""
    pool = MLAKVPool(1, 8, 4, 2, 16, torch.float32)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 6)
    backend = TorchRefBackend(pool.view(), LayerSpec(num_heads=2, sm_scale=0.3), max_batch_size=2, max_q_len=1)
    g = torch.Generator().manual_seed(3)
    kv_new, q = torch.randn(6, 576, generator=g), torch.randn(6, 2, 576, generator=g)
    loc = pool.req_to_token[row, :6].long()
    batch = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([6], dtype=torch.int32), loc,
                      torch.tensor([0, 6], dtype=torch.int32), 6, False)
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
        backend.kv_rows(0, batch, torch.float32, 6, 2)  # checked before anything is written
    backend.init_forward_metadata(batch)
    with pytest.raises(ValueError, match="layer_id must lie in"):
        backend.kv_rows(1, batch, torch.float32, 6, 2)
    for tokens, heads in ((5, 2), (6, 3)):  # q's shape as forward would refuse it
        with pytest.raises(ValueError, match="6 new tokens .* over 2 heads"):
            backend.kv_rows(0, batch, torch.float32, tokens, heads)
    assert backend.kv_rows(0, batch, torch.bfloat16, 6, 2) is None  # the cache holds fp32: forward writes kv_new
    rows, slots = backend.kv_rows(0, batch, torch.float32, 6, 2)
    assert rows.shape == (pool.kv_buffers[0].numel() // 576, 576) and slots is loc
    rows.index_copy_(0, slots, kv_new)
    assert torch.equal(pool.kv_buffers[0].view(-1, 576)[loc], kv_new)
    written = backend.forward(q, None, 0, batch)
    assert torch.equal(written, backend.forward(q, kv_new, 0, batch))


def test_kv_rows_leave_fp8_caches_and_empty_passes_to_forward():
    pool = MLAKVPool(1, 8, 4, 2, 16, torch.float8_e4m3fn, kv_scale=2.0)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 2)
    backend = TorchRefBackend(pool.view(), LayerSpec(num_heads=2, sm_scale=0.3), max_batch_size=2, max_q_len=2)
    for n in (2, 0):
        batch = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([n], dtype=torch.int32),
                          pool.req_to_token[row, :n].long(), torch.tensor([0, n], dtype=torch.int32), n, False)
        backend.init_forward_metadata(batch)
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):  # no dtype of the model is the cache's rows as stored
            assert backend.kv_rows(0, batch, dtype, n, 2) is None


def test_refused_passes_leave_the_cache_and_metadata_as_they_were():
    pool = MLAKVPool(1, 8, 4, 2, 16, torch.float32)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 6)
    backend = TorchRefBackend(pool.view(), LayerSpec(num_heads=2, sm_scale=0.3), max_batch_size=2, max_q_len=2)
    loc = pool.req_to_token[row, 4:6].long()
    batch = AttnBatch(ForwardMode.TARGET_VERIFY, torch.tensor([row]), torch.tensor([6], dtype=torch.int32), loc,
                      torch.tensor([0, 2], dtype=torch.int32), 2, True)
    cache = pool.kv_buffers[0].clone()
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
        backend.forward(torch.randn(2, 2, 576), torch.randn(2, 576), 0, batch)
    backend.init_forward_metadata(batch)
    metadata = backend.metadata
    with pytest.raises(ValueError, match="needs 2 query rows and kv rows"):
        backend.forward(torch.randn(3, 2, 576), torch.randn(2, 576), 0, batch)
    with pytest.raises(ValueError, match="needs 2 query rows and kv rows"):
        backend.forward(torch.randn(2, 2, 576), torch.randn(3, 576), 0, batch)
    with pytest.raises(ValueError, match=r"q must be \[tokens, 2, 576\]"):
        backend.forward(torch.randn(2, 2, 512), torch.randn(2, 576), 0, batch)
    for mask in (torch.ones(1, 2, 4, dtype=torch.uint8), torch.ones(1, 1, 4, dtype=torch.bool),
                 torch.ones(2, 2, 4, dtype=torch.bool), torch.ones(1, 2, 0, dtype=torch.bool)):
        masked = dataclasses.replace(batch, custom_mask=mask)
        with pytest.raises(ValueError, match="tree mask must be"):
            backend.forward(torch.randn(2, 2, 576), torch.randn(2, 576), 0, masked)
    ragged = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([6], dtype=torch.int32), loc,
                       torch.tensor([0, 2], dtype=torch.int32), 2, False, torch.ones(1, 2, 2, dtype=torch.bool))
    backend.init_forward_metadata(ragged)
    with pytest.raises(ValueError, match="needs a pass of uniform query lengths"):
        backend.forward(torch.randn(2, 2, 576), torch.randn(2, 576), 0, ragged)
    with pytest.raises(ValueError, match="needs 2 query rows"):  # a ragged pass's rows are out_cache_loc's
        backend.forward(torch.randn(1, 2, 576), torch.randn(2, 576), 0, dataclasses.replace(ragged, custom_mask=None))
    backend.init_forward_metadata(batch)
    for bad in (0, True):
        with pytest.raises(ValueError, match="max_kv_len must be None or an int >= 1"):
            backend.init_forward_metadata(dataclasses.replace(batch, max_kv_len=bad))
    # A refused init leaves no metadata: the pass it was for must not run on the previous pass's.
    assert backend.metadata is None
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
        backend.forward(torch.randn(2, 2, 576), torch.randn(2, 576), 0, batch)
    backend.init_forward_metadata(batch)
    metadata = backend.metadata
    for bad in (np.int64(2), 2.0, 0):  # refused before the cache write, not at the kernel's launch
        with pytest.raises(ValueError, match="max_q_len must be an int >= 1"):
            backend.forward(torch.randn(2, 2, 576), torch.randn(2, 576), 0, dataclasses.replace(batch, max_q_len=bad))
    mask = torch.ones(1, 4, 2, dtype=torch.bool).transpose(1, 2)  # [1, 2, 4], last dim strided
    with pytest.raises(ValueError, match="tree mask's last dim must be contiguous"):
        backend.forward(torch.randn(2, 2, 576), torch.randn(2, 576), 0, dataclasses.replace(batch, custom_mask=mask))
    with pytest.raises(ValueError, match="q's last dim must be contiguous"):
        backend.forward(torch.randn(2, 576, 2).transpose(1, 2), torch.randn(2, 576), 0, batch)
    decode = AttnBatch(ForwardMode.DECODE, torch.tensor([row, row]), torch.tensor([5, 6], dtype=torch.int32), loc,
                       torch.tensor([0, 1, 2], dtype=torch.int32), 1, True)
    with pytest.raises(ValueError, match="metadata was built for a batch of 1 requests, this pass has 2"):
        backend.forward(torch.randn(2, 2, 576), torch.randn(2, 576), 0, decode)
    assert backend.metadata is metadata
    three = AttnBatch(ForwardMode.TARGET_VERIFY, torch.tensor([row] * 3), torch.tensor([6] * 3, dtype=torch.int32),
                      loc, torch.tensor([0, 2, 4, 6], dtype=torch.int32), 2, True)
    with pytest.raises(ValueError, match="at most max_batch_size=2"):
        backend.init_forward_metadata(three)
    short = AttnBatch(ForwardMode.TARGET_VERIFY, torch.tensor([row, row]), torch.tensor([6], dtype=torch.int32),
                      loc, torch.tensor([0, 2, 4], dtype=torch.int32), 2, True)
    with pytest.raises(ValueError, match="seq_lens"):
        backend.init_forward_metadata(short)
    assert torch.equal(pool.kv_buffers[0], cache) and backend.metadata is None


class ChunkedDecodeBackend(TorchRefBackend):
    """Prefill through the paged default: the (reference) decode kernel over chunks of 3 query tokens."""

    max_decode_q_len = 3
    _run_prefill_kernel = PagedMLABackend._run_prefill_kernel
    kv_lens: list[list[int]] = []  # the kv lengths each decode-kernel call got

    def _run_decode_kernel(self, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask):
        self.kv_lens.append(seq_lens.tolist())
        return super()._run_decode_kernel(query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask)


def test_chunked_prefill_through_the_decode_kernel_matches_ragged():
    g = torch.Generator().manual_seed(3)
    pool = MLAKVPool(1, 16, 4, 4, 32, torch.float32)
    rows = [pool.alloc_request() for _ in range(4)]
    lens, q_lens = [9, 5, 4, 11], [7, 0, 1, 11]  # prefixes of 2, 5, 3 and 0 tokens already cached
    for row, n in zip(rows, lens):
        pool.ensure_capacity(row, n)
    spec = LayerSpec(num_heads=2, sm_scale=0.2)
    loc = torch.cat([pool.req_to_token[r, n - q:n] for r, n, q in zip(rows, lens, q_lens)]).long()
    cu = torch.tensor([0, 7, 7, 8, 19], dtype=torch.int32)
    batch = AttnBatch(ForwardMode.EXTEND, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), loc, cu, 11, False)
    pool.kv_buffers[0].copy_(torch.randn(pool.kv_buffers[0].shape, generator=g))
    q = torch.randn(19, 2, 576, generator=g)
    kv_new = torch.randn(19, 576, generator=g)
    outs = []
    for cls in (TorchRefBackend, ChunkedDecodeBackend):
        backend = cls(pool.view(), spec, 4, 1)
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q, kv_new, 0, batch))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    # Four chunks of 3 query tokens from the end, right-aligned at each request's length: a chunk
    # with a request's tokens sees its kv up to the chunk's last position, the earliest from
    # position 0 (request 3's first two tokens, position 2 being the next chunk's); a chunk of
    # padding alone sees the first 3 kv rows, not the cached prefix (request 1, no new tokens; request
    # 2 past its one token). No chunk sees fewer kv rows than its 3 query tokens.
    assert ChunkedDecodeBackend.kv_lens == [[9, 3, 4, 11], [6, 3, 3, 8], [3, 3, 3, 5], [3, 3, 3, 3]]


@pytest.mark.parametrize("compiles_per_q_len", [False, True])
def test_chunked_prefill_of_short_prompts_keeps_the_chunk_width_where_the_kernel_compiles_per_q_len(compiles_per_q_len):
    """Prompts shorter than max_decode_q_len go through chunks of max_decode_q_len query tokens
    where the kernel compiles per q_len (one prefill variant), else of the longest prompt's (fewer
    kv rows read past a short request); either attends as ragged."""
    g = torch.Generator().manual_seed(4)
    pool = MLAKVPool(1, 16, 4, 2, 32, torch.float32)
    rows = [pool.alloc_request() for _ in range(2)]
    lens, q_lens = [2, 6], [2, 1]  # a 2-token prompt; a request with 5 cached tokens and one new
    for row, n in zip(rows, lens):
        pool.ensure_capacity(row, n)
    pool.kv_buffers[0].copy_(torch.randn(pool.kv_buffers[0].shape, generator=g))
    loc = torch.cat([pool.req_to_token[r, n - q:n] for r, n, q in zip(rows, lens, q_lens)]).long()
    batch = AttnBatch(ForwardMode.EXTEND, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), loc,
                      torch.tensor([0, 2, 3], dtype=torch.int32), 2, False)
    q, kv_new = torch.randn(3, 2, 576, generator=g), torch.randn(3, 576, generator=g)
    ChunkedDecodeBackend.kv_lens = []

    class Chunked(ChunkedDecodeBackend):
        pass

    Chunked.compiles_per_q_len = compiles_per_q_len
    outs = []
    for cls in (TorchRefBackend, Chunked):
        backend = cls(pool.view(), LayerSpec(num_heads=2, sm_scale=0.2), 2, 1)
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q, kv_new, 0, batch))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    # One call of 3 query tokens a request (2, the longest prompt's, unpadded): the 2-token prompt
    # sees 3 kv rows (the third hidden by the causal mask), the other request its 6.
    assert ChunkedDecodeBackend.kv_lens == [[3 if compiles_per_q_len else 2, 6]]


@pytest.mark.parametrize("seed", range(16))
def test_chunked_prefill_of_random_batches_matches_ragged(seed):
    """Random prefixes (0 to 9 cached tokens), new-token counts (0 to 13) and chunk sizes (1 to 8),
    on odd seeds with a loose max_q_len (the host bound, 5 past the longest) and max_kv_len the
    longest request: the chunked prefill equals the ragged reference, and every decode-kernel call
    sees between its query tokens and max(its request's kv length, its query tokens) kv rows, and
    at most max_seq_len."""
    g = torch.Generator().manual_seed(seed)
    chunk = int(torch.randint(1, 9, (1,), generator=g))
    batch_size = int(torch.randint(1, 5, (1,), generator=g))
    # Odd seeds: short requests, which a chunk can outgrow (no chunk may reach past max_seq_len).
    prefixes = torch.randint(0, 10 if seed % 2 == 0 else 2, (batch_size,), generator=g).tolist()
    q_lens = torch.randint(0, 14 if seed % 2 == 0 else 4, (batch_size,), generator=g).tolist()
    q_lens[0] = max(q_lens[0], 1)
    lens = [p + n for p, n in zip(prefixes, q_lens)]
    pool = MLAKVPool(1, 32, 4, batch_size, 24, torch.float32)
    rows = [pool.alloc_request() for _ in range(batch_size)]
    for row, n in zip(rows, lens):
        pool.ensure_capacity(row, n)
    pool.kv_buffers[0].copy_(torch.randn(pool.kv_buffers[0].shape, generator=g))
    loc = torch.cat([pool.req_to_token[r, n - q:n] for r, n, q in zip(rows, lens, q_lens)]).long()
    cu = torch.tensor([0] + q_lens).cumsum(0).int()
    batch = AttnBatch(ForwardMode.EXTEND, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), loc, cu,
                      max(q_lens) + 5 * (seed % 2), False, max_kv_len=max(lens) if seed % 2 else None)
    q = torch.randn(sum(q_lens), 2, 576, generator=g)
    kv_new = torch.randn(sum(q_lens), 576, generator=g)
    calls = []

    class Chunked(ChunkedDecodeBackend):
        max_decode_q_len = chunk
        compiles_per_q_len = seed % 4 < 2

        def _run_decode_kernel(self, query, kv_cache, block_tables, seq_lens, max_seq_len, custom_mask):
            calls.append((query.shape[1], seq_lens.tolist(), max_seq_len))
            return TorchRefBackend._run_decode_kernel(self, query, kv_cache, block_tables, seq_lens, max_seq_len,
                                                      custom_mask)

    outs = []
    for cls in (TorchRefBackend, Chunked):
        backend = cls(pool.view(), LayerSpec(num_heads=2, sm_scale=0.2), batch_size, 1)
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q, kv_new, 0, batch))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    # One width: max_decode_q_len where the kernel compiles per q_len, whatever the requests' lengths.
    max_seq_len = max(lens) if seed % 2 else 24
    width = min(chunk, max_seq_len) if Chunked.compiles_per_q_len else min(chunk, batch.max_q_len, max_seq_len)
    assert {(q_len, m) for q_len, _, m in calls} == {(width, max_seq_len)}
    for q_len, kv_lens, max_seq_len in calls:
        assert all(q_len <= n <= min(max(length, q_len), max_seq_len) for n, length in zip(kv_lens, lens)), (
            q_len, kv_lens, lens, max_seq_len)


def plain_causal(q, kv, scale):
    """Causal attention of q ``[T, H, 576]`` over kv ``[T, 576]`` fp32 (the first 512 columns are V)."""
    causal = torch.tril(torch.ones(q.shape[0], kv.shape[0], dtype=torch.bool))
    s = torch.einsum("thd,kd->thk", q, kv) * scale
    return torch.softmax(s.masked_fill(~causal[:, None], float("-inf")), -1) @ kv[:, :512]


def test_reference_dequantises_an_fp8_cache_with_its_scale():
    """paged_mla_reference over an fp8 cache reads kv * kv_scale: plain attention over the dequantised rows."""
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(6, 576, generator=g) * 4).to(torch.float8_e4m3fn)
    cache = kv.view(6, 1, 576)  # page size 1, identity table
    q = torch.randn(6, 2, 576, generator=g)
    got = paged_mla_reference(q, cache, torch.arange(6, dtype=torch.int32)[None], torch.tensor([6], dtype=torch.int32),
                              torch.tensor([0, 6], dtype=torch.int32), 6, 0.05, kv_scale=0.25)
    torch.testing.assert_close(got, plain_causal(q, kv.float() * 0.25, 0.05), rtol=1e-5, atol=1e-5)


def test_torch_ref_backend_over_a_scaled_fp8_pool():
    """TorchRefBackend over a pool with kv_scale 4 stores kv / 4 in e4m3 and attends to it times 4."""
    pool = MLAKVPool(1, 8, 4, 2, 16, torch.float8_e4m3fn, kv_scale=4.0)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 6)
    backend = TorchRefBackend(pool.view(), LayerSpec(num_heads=2, sm_scale=0.05), max_batch_size=2, max_q_len=1)
    g = torch.Generator().manual_seed(1)
    kv_new, q = torch.randn(6, 576, generator=g) * 8, torch.randn(6, 2, 576, generator=g)
    loc = pool.req_to_token[row, :6].long()
    batch = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([6], dtype=torch.int32), loc,
                      torch.tensor([0, 6], dtype=torch.int32), 6, False)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, kv_new, 0, batch)
    stored = (kv_new / 4.0).to(torch.float8_e4m3fn).float() * 4.0  # what the cache holds, dequantised
    # fp32 scores of magnitude ~100 (kv up to ~30): 1e-4, not 1e-5; a wrong scale is off by far more.
    torch.testing.assert_close(out, plain_causal(q, stored, 0.05), rtol=1e-4, atol=1e-4)


def test_an_fp8_cache_write_and_query_saturate_at_448(monkeypatch):
    """An fp8 cache stores kv / kv_scale clamped to +-448, inf included, and attention over it
    stays finite; the Blackwell adapters' fp8 queries (to_cache_dtype, scale 1) saturate the same
    way. The test casts as torch before 2.12 does (a value past 464, and inf, become NaN; 2.12
    saturates itself), so the clamp must be the code's own: no NaN is stored, not even in pages
    later freed."""
    from attn.base import to_cache_dtype

    cast = torch.Tensor.to

    def unsaturated_cast(self, *args, **kwargs):
        if torch.float8_e4m3fn in (*args, kwargs.get("dtype")) and self.dtype != torch.float8_e4m3fn:
            self = self.masked_fill(self.abs() > 464, float("nan"))
        return cast(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", unsaturated_cast)

    pool = MLAKVPool(1, 8, 4, 2, 16, torch.float8_e4m3fn, kv_scale=0.5)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 3)
    backend = TorchRefBackend(pool.view(), LayerSpec(num_heads=2, sm_scale=0.05), max_batch_size=2, max_q_len=1)
    kv_new, q = torch.zeros(3, 576), torch.randn(3, 2, 576, generator=torch.Generator().manual_seed(2))
    kv_new[:, :5] = torch.tensor([1000.0, -1e4, float("inf"), float("-inf"), 3.0])
    loc = pool.req_to_token[row, :3].long()
    batch = AttnBatch(ForwardMode.EXTEND, torch.tensor([row]), torch.tensor([3], dtype=torch.int32), loc,
                      torch.tensor([0, 3], dtype=torch.int32), 3, False)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, kv_new, 0, batch)
    stored = pool.kv_buffers[0].view(-1, 576)[loc].float()
    assert stored[:, :5].tolist() == [[448.0, -448.0, 448.0, -448.0, 6.0]] * 3
    assert not stored.isnan().any() and out.isfinite().all()
    query = torch.tensor([500.0, -1e5, float("inf"), 1.5], dtype=torch.bfloat16)
    assert to_cache_dtype(query, torch.float8_e4m3fn).float().tolist() == [448.0, -448.0, 448.0, 1.5]
    assert to_cache_dtype(query, torch.bfloat16) is query


def test_table_entries_past_a_request_are_never_read():
    """The kernels' contract: block-table entries past a request's pages may hold anything (an
    engine's own tables); the reference reads none of them."""
    g = torch.Generator().manual_seed(4)
    kv_cache = torch.randn(8, 4, 576, generator=g)
    seq_lens, cu = torch.tensor([5, 0], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    clean = torch.tensor([[3, 6, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
    stale = torch.tensor([[3, 6, 1 << 20, -7], [1 << 20, -1, 99, 5]], dtype=torch.int32)
    q = torch.randn(2, 2, 576, generator=g)
    expected = naive(q, kv_cache, clean, seq_lens, cu, 0.1)
    got = paged_mla_reference(q, kv_cache, stale, seq_lens, cu, 1, 0.1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Nor do other pages' rows count, even NaN: page 0 above all, which the reference stands in for
    # every position past a request's length with (a pool's padding sink, which padded rows write).
    kv_cache[[0, 1, 2, 4, 5, 7]] = float("nan")
    got = paged_mla_reference(q, kv_cache, stale, seq_lens, cu, 1, 0.1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_cache_views_backends_could_not_write_through_are_refused():
    """Backends write through a rows view of each layer's buffer: one layer's slice of a page-first
    pool is not one (the writes would go to a copy and be lost), so the view refuses it up front."""
    from attn.base import KVCacheView

    pool = MLAKVPool(1, 8, 4, 2, 16, torch.float32)
    page_first = torch.zeros(8, 2, 4, 576)  # [pages, layers, page_size, 576]
    with pytest.raises(ValueError, match="layer 1's kv buffer must be a contiguous \\[num_pages, 4, 576\\]"):
        KVCacheView([pool.kv_buffers[0], page_first[:, 1]], pool.req_to_token, 4)
    with pytest.raises(ValueError, match="must be a contiguous \\[num_pages, 8, 576\\]"):
        KVCacheView(pool.kv_buffers, pool.req_to_token, 8)


def test_scales_a_kernel_would_refuse_after_the_cache_write_are_refused_up_front():
    """NaN, 0, a bool, a tensor or an overflowing int as the softmax scale or the fp8 scale is refused
    when the LayerSpec or KVCacheView is built, naming the field: a kernel would refuse it only at
    its launch, after the pass had written its kv rows, and the reference would return NaN."""
    from attn.base import KVCacheView

    pool = MLAKVPool(1, 8, 4, 2, 16, torch.float32)
    for bad in (float("nan"), 0.0, True, torch.tensor(0.3), 10**400):
        with pytest.raises(ValueError, match="LayerSpec: sm_scale must be a finite positive float"):
            LayerSpec(num_heads=2, sm_scale=bad)
        with pytest.raises(ValueError, match=r"KVCacheView: kv_scale must be a finite positive float in \[2\*\*-64"):
            KVCacheView(pool.kv_buffers, pool.req_to_token, 4, kv_scale=bad)
    with pytest.raises(ValueError, match="LayerSpec: num_heads must be an int >= 1"):
        LayerSpec(num_heads=0, sm_scale=0.3)
    assert LayerSpec(num_heads=2, sm_scale=np.float32(0.3)).sm_scale == np.float32(0.3)


def test_backends_refuse_caches_of_dtypes_their_kernel_does_not_take():
    from attn.backends.triton_mla import TritonMLABackend

    pool = MLAKVPool(1, 8, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="triton_mla takes kv caches of .*not torch.float32"):
        TritonMLABackend(pool.view(), LayerSpec(num_heads=2, sm_scale=0.3), max_batch_size=2, max_q_len=1)
    fp64 = MLAKVPool(1, 8, 4, 2, 16, torch.float64)  # the reference takes any (target-only decoding of an fp64 model)
    TorchRefBackend(fp64.view(), LayerSpec(num_heads=2, sm_scale=0.3), max_batch_size=2, max_q_len=1)


def test_multi_step_draft_takes_one_batch_per_draft_forward():
    from attn.multistep import MultiStepDraftBackend

    pool = MLAKVPool(1, 8, 4, 2, 16, torch.float32)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 12)
    draft = MultiStepDraftBackend(TorchRefBackend, pool.view(), LayerSpec(num_heads=2, sm_scale=0.3), 2, num_steps=4, topk=1)

    def step(n: int) -> AttnBatch:
        return AttnBatch(ForwardMode.DECODE, torch.tensor([row]), torch.tensor([n], dtype=torch.int32),
                         pool.req_to_token[row, n - 1:n].long(), torch.tensor([0, 1], dtype=torch.int32), 1, True)

    draft.init_forward_metadata([step(5), step(6), step(7)])
    assert [b.metadata.seq_lens.tolist() for b in draft.steps] == [[5], [6], [7]]
    for count in (1, 6):  # one batch per draft forward: too few or too many are refused
        with pytest.raises(ValueError, match=f"3 draft forwards take one batch each, got {count}"):
            draft.init_forward_metadata([step(8 + k % 3) for k in range(count)])
    one_step = MultiStepDraftBackend(TorchRefBackend, pool.view(), LayerSpec(num_heads=2, sm_scale=0.3), 2,
                                     num_steps=1, topk=1)
    one_step.init_forward_metadata([])  # no draft forward of its own: nothing to build, no error
    with pytest.raises(ValueError, match="0 draft forwards take one batch each, got 1"):
        one_step.init_forward_metadata([step(5)])


def test_multi_step_draft_refuses_steps_of_other_requests_and_trees_without_masks():
    from attn.multistep import MultiStepDraftBackend
    from attn.backends.blackwell.trtllm_mla import TrtllmMLABackend

    pool = MLAKVPool(1, 8, 4, 2, 16, torch.float32)
    rows = [pool.alloc_request(), pool.alloc_request()]
    for row in rows:
        pool.ensure_capacity(row, 12)
    layer = LayerSpec(num_heads=2, sm_scale=0.3)
    draft = MultiStepDraftBackend(TorchRefBackend, pool.view(), layer, 2, num_steps=3, topk=1)

    def step(reqs: list[int], n: int) -> AttnBatch:
        loc = torch.cat([pool.req_to_token[r, n - 1:n] for r in reqs]).long()
        return AttnBatch(ForwardMode.DECODE, torch.tensor(reqs), torch.tensor([n] * len(reqs), dtype=torch.int32),
                         loc, torch.arange(len(reqs) + 1, dtype=torch.int32), 1, True)

    draft.init_forward_metadata([step(rows, 5), step(rows, 6)])
    # Steps over other requests are refused (a one-row table would broadcast over two requests).
    with pytest.raises(ValueError, match=r"the same requests, got batches of \[1, 2\]"):
        draft.init_forward_metadata([step(rows[:1], 7), step(rows, 8)])
    assert all(b.metadata is None for b in draft.steps)  # none left on the previous spec step's
    with pytest.raises(ValueError, match=r"shared_block_tables must be \[2, 4\] int32"):
        draft.steps[1].init_forward_metadata(step(rows, 6), shared_block_tables=torch.zeros(1, 4, dtype=torch.int32))
    # A tree draft over a backend without tree masks is refused when built (it would fail, or attend causally, later).
    with pytest.raises(ValueError, match="trtllm_mla cannot attend with a tree mask, which a topk=2 draft needs"):
        MultiStepDraftBackend(TrtllmMLABackend, pool.view(), layer, 2, num_steps=3, topk=2)


@pytest.mark.parametrize("mode, q_len", [(ForwardMode.DECODE, 0), (ForwardMode.EXTEND, 0)])
def test_a_pass_of_no_tokens_returns_no_rows(mode, q_len):
    from attn.backends.triton_mla import TritonMLABackend

    pool = MLAKVPool(1, 8, 4, 2, 16, torch.bfloat16)
    row = pool.alloc_request()
    pool.ensure_capacity(row, 4)
    for cls in (TorchRefBackend, TritonMLABackend):  # each returns [0, H, 512], at max_q_len 0 too
        backend = cls(pool.view(), LayerSpec(num_heads=2, sm_scale=0.3), max_batch_size=2, max_q_len=1)
        batch = AttnBatch(mode, torch.tensor([row]), torch.tensor([4], dtype=torch.int32), torch.zeros(0, dtype=torch.long),
                          torch.tensor([0, 0], dtype=torch.int32), q_len, mode is ForwardMode.DECODE)
        backend.init_forward_metadata(batch)
        out = backend.forward(torch.zeros(0, 2, 576, dtype=torch.bfloat16), torch.zeros(0, 576, dtype=torch.bfloat16),
                              0, batch)
        assert out.shape == (0, 2, 512) and out.dtype == torch.bfloat16
