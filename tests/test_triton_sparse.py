"""Tests of triton_mla's sparse variant (DeepSeek-V3.2 DSA): the indexer's top-k
(attn/kernels/triton_mla/indexer.py) and the sparse decode (attn/kernels/triton_mla/sparse.py)
against torch_ref's indexer_topk_reference and sparse_mla_reference, and TritonMLABackend's sparse
passes against TorchRefBackend's.

CPU: argument checks, the sm_90 compile of every kernel variant a launch picks (no spills past the
dense Triton tile's), and the kernels under the Triton interpreter at small sizes. GPU (marked
``gpu``): real sizes (topk 2048, 8k contexts, 16-128 heads, q_len 1 and 4), CUDA-graph replay ==
eager and no host sync.

Selections: over integer-valued queries and keys (exact scores, many ties) the slots equal the
reference's in order; over random ones, the scores of the selected slots equal the reference's
(sorted, up to fp32 rounding: a near-tie at the k-th score may pick either) and every selected slot
is one the token sees. Attention: bf16 output vs fp32, atol = rtol = 2e-2 (atol times a kv_scale
above 1).
"""

import pytest
import torch

from attn.backends.torch_ref import indexer_topk_reference, sparse_mla_reference
from attn.kernels.triton_mla.indexer import indexer_topk
from attn.kernels.triton_mla.sparse import sparse_mla_decode
from interpreted import run_interpreted
from test_triton_mla_kernel import gpu, make_inputs, random_mask

SM_SCALE = 192 ** -0.5
ATOL = RTOL = 2e-2


def index_inputs(seq_lens, q_lens, heads, dim, page_size, device, cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
                 exact=False, padding=0, gen=None):
    """Indexer inputs over make_inputs' shuffled block tables (entries past each length: other pages):
    q ``[T + padding, heads, dim]``, weights, an index cache of the same pages; exact: small
    integers (queries, keys) and quarters (weights), whose scores every summation order gets exactly."""
    gen = gen or torch.Generator().manual_seed(0)
    args, max_q_len = make_inputs(seq_lens, q_lens, 1, page_size, "cpu", gen=gen)
    tokens, pages = sum(q_lens) + padding, args["kv_cache"].shape[0]
    if exact:
        q = torch.randint(-3, 4, (tokens, heads, dim), generator=gen).float()
        keys = torch.randint(-3, 4, (pages, page_size, dim), generator=gen).float()
        weights = torch.randint(-8, 9, (tokens, heads), generator=gen).float() / 4
    else:
        q, keys = torch.randn(tokens, heads, dim, generator=gen), torch.randn(pages, page_size, dim, generator=gen)
        weights = torch.randn(tokens, heads, generator=gen)
    index = dict(q=q.to(q_dtype), weights=weights, index_cache=keys.to(cache_dtype), block_tables=args["block_tables"],
                 seq_lens=args["seq_lens"], cu_seqlens_q=args["cu_seqlens_q"])
    return {k: v.to(device) for k, v in index.items()}, max_q_len


def slot_scores(index, slots):
    """fp64 indexer scores ``[T, K]`` of the slots (-inf for -1)."""
    keys = index["index_cache"].double().flatten(0, 1)[slots.clamp(min=0).long()]  # [T, K, D]
    per_head = torch.einsum("thd,tkd->thk", index["q"].double(), keys).relu()
    scores = torch.einsum("th,thk->tk", index["weights"].double(), per_head)
    return scores.masked_fill(slots < 0, float("-inf"))


def check_topk(index, topk, custom_mask=None, exact=False, max_kv_len=None):
    """indexer_topk (scoring max_kv_len positions, if given) against indexer_topk_reference
    (assert_same_selection); returns its slots."""
    got = indexer_topk(**index, topk=topk, custom_mask=custom_mask, max_kv_len=max_kv_len)
    assert_same_selection(index, got, indexer_topk_reference(**index, topk=topk, custom_mask=custom_mask),
                          custom_mask, exact)
    return got


def assert_same_selection(index, got, ref, custom_mask=None, exact=False):
    """Slots ``got`` [T, topk] int32 against the reference's ``ref`` over the indexer inputs
    ``index``, in the module docstring's terms (exact: equal, in order)."""
    assert got.shape == ref.shape and got.dtype == torch.int32
    if exact:
        assert torch.equal(got, ref)
        return
    assert torch.equal((got >= 0).sum(1), (ref >= 0).sum(1))
    width = index["block_tables"].shape[1] * index["index_cache"].shape[1]
    seen = indexer_topk_reference(**index, topk=width, custom_mask=custom_mask).cpu().tolist()  # every slot it sees
    for row, seen_row in zip(got.cpu().tolist(), seen):
        picked = [s for s in row if s >= 0]
        assert len(set(picked)) == len(picked) and set(picked) <= set(seen_row)
        assert all(s < 0 for s in row[len(picked):])  # -1 only past the selection
    # Scores relative to a bound of each token's (|w|_1 x D x the largest |q|, |k|): a wrong pick
    # among thousands of rows moves them by far more than fp32 rounding does.
    scale = (index["weights"].abs().sum(1, keepdim=True).double() * index["q"].shape[2]
             * index["q"].double().abs().amax() * index["index_cache"].double().abs().amax())
    got_scores, ref_scores = slot_scores(index, got), slot_scores(index, ref)
    valid = ref >= 0  # (best first: a prefix of each row)
    torch.testing.assert_close((got_scores.sort(1, descending=True).values / scale)[valid],
                               (ref_scores.sort(1, descending=True).values / scale)[valid], atol=1e-7, rtol=0)


def sparse_inputs(seq_lens, q_lens, heads, page_size, device, kv_dtype=torch.bfloat16, topk=32, gen=None):
    """Attention inputs: make_inputs' queries and cache, and each token's slots from the reference
    indexer over random keys (best first, -1 past what it sees); then some slots dropped to -1 and
    the last token's all."""
    gen = gen or torch.Generator().manual_seed(0)
    q_dtype = kv_dtype if kv_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    args, _ = make_inputs(seq_lens, q_lens, heads, page_size, "cpu", kv_dtype=kv_dtype, gen=gen, q_dtype=q_dtype)
    index, _ = index_inputs(seq_lens, q_lens, 2, 16, page_size, "cpu", gen=gen)
    index["block_tables"] = args["block_tables"]
    slots = indexer_topk_reference(**index, topk=topk)
    slots[torch.rand(slots.shape, generator=gen) < 0.2] = -1
    slots[-1] = -1
    return args["q"].to(device), args["kv_cache"].to(device), slots.to(device)


def check_sparse(q, kv_cache, slots, kv_scale=1.0, num_splits=None):
    out = sparse_mla_decode(q, kv_cache, slots, SM_SCALE, kv_scale, num_splits=num_splits)
    ref = sparse_mla_reference(q, kv_cache, slots, SM_SCALE, kv_scale).float()
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=ATOL * max(kv_scale, 1.0), rtol=RTOL)
    assert (out[(slots < 0).all(1)] == 0).all()  # a token with no row: exactly 0
    return out


# ----------------------------------------------------------------------------- CPU


def _sparse_args():
    q, kv, slots = torch.zeros(2, 16, 576, dtype=torch.bfloat16), torch.zeros(4, 16, 576, dtype=torch.bfloat16), \
        torch.zeros(2, 8, dtype=torch.int32)
    return dict(q=q, kv_cache=kv, slots=slots, sm_scale=SM_SCALE)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(q=a["q"].float()), r"q must be \[T, H, 576\] bf16/fp16"),
    (lambda a: a.update(kv_cache=a["kv_cache"].half()), "kv_cache must be .* in q's dtype"),
    (lambda a: a.update(slots=a["slots"].long()), r"slots must be \[T=2, K\] int32"),
    (lambda a: a.update(slots=a["slots"][:1]), r"slots must be \[T=2, K\] int32"),
    (lambda a: a.update(sm_scale=float("nan")), "sm_scale must be a finite positive float"),
    (lambda a: a.update(kv_scale=0.0), "kv_scale must be a finite positive float"),
    (lambda a: a.update(out=torch.empty(2, 16, 512)), r"out must be \[2, 16, 512\] torch.bfloat16"),
    (lambda a: a.update(num_splits=0), "num_splits must be an int in"),
])
def test_sparse_argument_checks(change, message):
    args = _sparse_args()
    change(args)
    with pytest.raises(ValueError, match="sparse_mla_decode: " + message):
        sparse_mla_decode(**args)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(q=a["q"].to(torch.float64)), r"q must be \[T, heads, D\]"),
    (lambda a: a.update(weights=a["weights"].bfloat16()), r"weights must be \[4, 2\] fp32"),
    (lambda a: a.update(index_cache=a["index_cache"][..., :8]), r"index_cache must be \[num_pages, page_size, 16\]"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be"),
    (lambda a: a.update(seq_lens=a["seq_lens"][:1]), r"seq_lens must be \[2\] int32"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), r"cu_seqlens_q must be \[3\] int32"),
    (lambda a: a.update(topk=0), "topk must be an int >= 1"),
    (lambda a: a.update(custom_mask=torch.ones(2, 2, 3, dtype=torch.int32)), "custom_mask must be"),
    (lambda a: a.update(max_kv_len=0), "max_kv_len must be None or an int >= 1"),
])
def test_indexer_argument_checks(change, message):
    args, _ = index_inputs([5, 3], [2, 2], 2, 16, 4, "cpu")
    args["topk"] = 4
    change(args)
    with pytest.raises(ValueError, match="indexer_topk: " + message):
        indexer_topk(**args)


def _compile_report(kernel, signature, constants, num_warps, num_stages, tmp_path):
    """Compile a kernel for sm_90a as the launcher specialises it (pointers 16-byte aligned):
    (shared memory bytes, ptxas spill-store bytes)."""
    import re
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constants}}
    attrs = {(list(signature).index(name),): [["tt.divisibility", 16]] for name in signature if name.endswith("_ptr")}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    (tmp_path / "k.ptx").write_text(compiled.asm["ptx"])
    report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(tmp_path / "k.ptx"), "-o",
                             str(tmp_path / "k.o")], capture_output=True, text=True, check=True).stderr
    return compiled.metadata.shared, sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


H100_SMEM_PER_BLOCK = 227 * 1024


# Spill stores the dense Triton tiles of as many rows have (Triton 3.6, sm_90a): 16 rows 392 bytes,
# 64 rows 2852 (the [64, 512] fp32 accumulator, 128 registers a thread of 8 warps).
@pytest.mark.parametrize("num_heads, kv, direct, spill_bound", [
    (16, "bf16", False, 128), (16, "fp8e4nv", True, 128), (64, "bf16", False, 1024), (128, "fp8e4nv", True, 1024)])
def test_sparse_kernel_compiles_for_sm90(tmp_path, num_heads, kv, direct, spill_bound):
    pytest.importorskip("triton.backends.nvidia")
    from attn.kernels.triton_mla import sparse
    from attn.kernels.triton_mla.plan import plan_launch

    plan = plan_launch(4, num_heads, 1, 2048, 132)
    ints = ["stride_qt", "stride_qh", "stride_kv_page", "stride_kv_row", "stride_st", "stride_ot", "stride_oh",
            "stride_os", "stride_lt", "stride_lh", "num_slots", "chunk"]
    signature = dict(q_ptr="*bf16", kv_ptr="*" + kv, slots_ptr="*i32", o_ptr="*bf16", lse_ptr="*fp32",
                     **{name: "i32" for name in ints}, qk_scale="fp32", v_scale="fp32")
    constants = dict(PAGE_SIZE=64, NUM_HEADS=num_heads, BLOCK_H=plan.tile.rows, BLOCK_N=plan.config.block_n,
                     D_NOPE=512, D_PE=64, DIRECT=direct, PDL=True)
    shared, spills = _compile_report(sparse._sparse_mla_kernel, signature, constants, plan.config.num_warps,
                                     plan.config.num_stages, tmp_path)
    assert shared <= H100_SMEM_PER_BLOCK and spills <= spill_bound


@pytest.mark.parametrize("cache, has_mask", [("bf16", False), ("fp8e4nv", True), ("fp32", False)])
def test_indexer_kernels_compile_for_sm90_without_spills(tmp_path, cache, has_mask):
    """V3.2's indexer: 64 heads of 128 dims."""
    pytest.importorskip("triton.backends.nvidia")
    from attn.kernels.triton_mla import indexer

    ieee = cache == "fp32"
    ints = ["first_token", "batch_size", "num_positions", "tiles_per_program", "mask_len", "stride_qt", "stride_qh",
            "stride_wt", "stride_k_page", "stride_k_row", "stride_bt", "stride_mb", "stride_mq", "stride_st"]
    signature = dict(q_ptr="*fp32" if ieee else "*bf16", w_ptr="*fp32", k_ptr="*" + cache, bt_ptr="*i32",
                     seq_lens_ptr="*i32", cu_q_ptr="*i32", mask_ptr="*u8" if has_mask else "*i32", score_ptr="*fp32",
                     **{name: "i32" for name in ints})
    constants = dict(PAGE_SIZE=64, NUM_HEADS=64, HEAD_DIM=128, BLOCK_H=64, BLOCK_D=128,
                     BLOCK_N=indexer.BLOCK_N // 2 if ieee else indexer.BLOCK_N, BLOCK_B=8, HAS_MASK=has_mask,
                     DOT_PRECISION="ieee" if ieee else "tf32")
    assert _compile_report(indexer._index_score_kernel, signature, constants, 8 if ieee else 4, 3, tmp_path)[1] == 0
    signature = dict(pos_ptr="*i64", val_ptr="*fp32", bt_ptr="*i32", cu_q_ptr="*i32", out_ptr="*i32",
                     **{name: "i32" for name in ["first_token", "batch_size", "found", "topk", "stride_pt",
                                                 "stride_vt", "stride_bt", "stride_ot"]})
    constants = dict(PAGE_SIZE=64, BLOCK_K=indexer.SLOTS_BLOCK, BLOCK_B=8)
    assert _compile_report(indexer._slots_kernel, signature, constants, 4, 3, tmp_path)[1] == 0


_INTERPRETED_INDEXER = """
import torch

from attn.kernels.triton_mla import indexer
from test_triton_sparse import check_topk, index_inputs, random_mask

gen = torch.Generator().manual_seed(1)
# Ragged causal queries (a request of none, one longer than topk's reach) and two padding tokens;
# exact scores (ties everywhere, -0.0 among them) and random ones; contexts shorter and longer
# than topk, topk past the table width (-1 padding); bf16, fp32 and fp8 caches.
for exact in (True, False):
    for cache, q_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                           (torch.float8_e4m3fn, torch.bfloat16)):
        index, _ = index_inputs([70, 3, 0, 21], [4, 3, 0, 2], 3, 24, 8, "cpu", cache, q_dtype, exact, 2, gen)
        for topk in (1, 16, 200):
            check_topk(index, topk, exact=exact)
# Tree verify: 4 tokens a request over a mask of the last 4 (or 6: a draft step) positions; a token
# whose mask row is empty, of a request holding no more than the mask, sees nothing (all -1); a
# padding token neither.
for mask_len in (4, 6):
    mask = random_mask(3, 4, mask_len, gen, "cpu")
    mask[0, 1] = False
    for exact in (True, False):
        index, _ = index_inputs([mask_len, 40, 90], [4, 4, 4], 4, 16, 16, "cpu", exact=exact, padding=1, gen=gen)
        got = check_topk(index, 8, mask, exact=exact)
        assert (got[1] == -1).all() and (got[-1] == -1).all()
# Scoring only up to the pass's bound (the longest request's 90 positions of the tables' wider
# span, and one more) selects what scoring the tables' width does (random scores: torch.topk may
# break ties otherwise over a narrower buffer).
index, _ = index_inputs([90, 33], [4, 2], 2, 16, 8, "cpu", gen=gen)
assert index["block_tables"].shape[1] * 8 > 90
for bound in (90, 91):
    check_topk(index, 40, max_kv_len=bound)
# Score buffers of two tokens: the tokens in chunks, the last one shorter
index, _ = index_inputs([100, 9], [3, 2], 2, 16, 8, "cpu", exact=True, gen=gen)
indexer.SCORE_BUFFER_BYTES = 2 * 4 * index["block_tables"].shape[1] * 8
check_topk(index, 20, exact=True)
print("ok")
"""


def test_indexer_under_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED_INDEXER)


_INTERPRETED_SPARSE = """
import torch

from test_triton_sparse import check_sparse, sparse_inputs

gen = torch.Generator().manual_seed(2)
# 16, 64 (one 64-row tile) and 128 heads (two), and 3 (a 16-row tile of 13 masked heads); bf16,
# fp16 and fp8 caches; -1 slots scattered and at the tail, a token of none; one split (direct),
# several, and the plan's.
for heads, page_size, kv_dtype, kv_scale in ((16, 16, torch.bfloat16, 1.0), (64, 1, torch.float8_e4m3fn, 0.5), (64, 4, torch.bfloat16, 1.0),
                                             (128, 64, torch.float16, 1.0), (3, 4, torch.float8_e4m3fn, 2.0)):
    q, kv, slots = sparse_inputs([90, 5, 33], [2, 1, 2], heads, page_size, "cpu", kv_dtype, 40, gen)
    for num_splits in (1, 3) if heads < 128 else (None,):
        check_sparse(q, kv, slots, kv_scale, num_splits)
print("ok")
"""


def test_sparse_decode_under_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED_SPARSE)


_INTERPRETED_BACKEND = """
import torch

from test_triton_sparse import compare_sparse_backends

compare_sparse_backends("cpu", torch.bfloat16, heads=16, lens=(9, 40), q_len=3, topk=8, index_heads=4, index_dim=16)
compare_sparse_backends("cpu", torch.float8_e4m3fn, heads=16, lens=(9, 40), q_len=1, topk=8, index_heads=4,
                        index_dim=16, kv_scale=0.5)
print("ok")
"""


def compare_sparse_backends(device, dtype, heads, lens, q_len, topk, index_heads, index_dim, kv_scale=1.0,
                            page_size=16, tree=True, backend="triton_mla"):
    """``backend``'s index_topk and forward_sparse against TorchRefBackend's over one pool (a verify
    pass of q_len tokens a request, tree-masked where q_len > 1 and ``tree``): the same selections
    (check_topk's terms), and attention over the reference's selection within ATOL (an fp8_v32
    pool, uint8: random rows quantised)."""
    from attn.backends.torch_ref import TorchRefBackend
    from attn.base import ForwardMode, LayerSpec, encode_kv
    from attn.registry import get_backend_class
    from specdec.batch import uniform_batch
    from specdec.kv import MLAKVPool

    gen = torch.Generator().manual_seed(4)
    context = page_size * (max(lens) // page_size + 2)
    pool = MLAKVPool(1, sum(n // page_size + 1 for n in lens) + 2, page_size, len(lens), context, dtype, device,
                     kv_scale=kv_scale, index_head_dim=index_dim, index_dtype=torch.bfloat16)
    rows = [pool.alloc_request() for _ in lens]
    for row, n in zip(rows, lens):
        pool.ensure_capacity(row, n)
    pool.kv_buffers[0].copy_(encode_kv(torch.randn(*pool.kv_buffers[0].shape[:2], 576, generator=gen), dtype))
    pool.index_buffers[0].copy_(torch.randn(pool.index_buffers[0].shape, generator=gen))
    mask = None
    if tree and q_len > 1:
        mask = random_mask(len(lens), q_len, q_len, gen, device) | torch.eye(q_len, dtype=torch.bool, device=device)
    seq = torch.tensor(lens, device=device)
    batch, _ = uniform_batch(ForwardMode.TARGET_VERIFY, pool.req_to_token, torch.tensor(rows, device=device),
                             seq - q_len, q_len, custom_mask=mask)
    tokens = batch.num_tokens
    q_index = torch.randn(tokens, index_heads, index_dim, generator=gen).to(device, torch.bfloat16)
    weights = torch.randn(tokens, index_heads, generator=gen).to(device)
    k_new = torch.randn(tokens, index_dim, generator=gen).to(device, torch.bfloat16)
    q = torch.randn(tokens, heads, 576, generator=gen).to(device, torch.bfloat16)
    kv_new = (torch.randn(tokens, 576, generator=gen) * kv_scale).to(device, torch.bfloat16)
    spec = LayerSpec(num_heads=heads, sm_scale=SM_SCALE, index_topk=topk, index_head_dim=index_dim)
    chosen, outs = [], []
    for cls in (TorchRefBackend, get_backend_class(backend)):
        backend = cls(pool.view(), spec, len(lens), q_len, q_len)
        backend.init_forward_metadata(batch)
        chosen.append(backend.index_topk(q_index, weights, k_new, 0, batch, topk))
        outs.append(backend.forward_sparse(q, kv_new, 0, batch, chosen[0]).float())
    md = backend.metadata
    index = dict(q=q_index, weights=weights, index_cache=pool.index_buffers[0], block_tables=md.block_tables,
                 seq_lens=md.seq_lens, cu_seqlens_q=md.cu_seqlens_q)
    assert torch.equal(chosen[0], indexer_topk_reference(**index, topk=topk, custom_mask=mask))
    assert_same_selection(index, chosen[1], chosen[0], mask)
    torch.testing.assert_close(outs[1], outs[0], atol=ATOL * max(kv_scale, 1.0), rtol=RTOL)


def test_backend_sparse_passes_under_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED_BACKEND)


# ----------------------------------------------------------------------------- GPU
# Real sizes: V3.2's indexer (64 heads of 128 dims, topk 2048) over 8k contexts and one shorter than
# topk, pages of 64; attention of 16, 64 and 128 heads over 2048 rows a token.

LENS = [8192, 1000, 5000]


@pytest.mark.parametrize("q_len, cache, masked", [(1, torch.bfloat16, False), (4, torch.bfloat16, False),
                                                  (4, torch.bfloat16, True), (4, torch.float8_e4m3fn, True)])
@gpu
def test_indexer_topk_at_real_size(q_len, cache, masked):
    gen = torch.Generator().manual_seed(5)
    index, q = index_inputs(LENS, [q_len] * len(LENS), 64, 128, 64, "cuda", cache, padding=3, gen=gen)
    mask = random_mask(len(LENS), q, q, gen, "cuda") if masked else None
    got = check_topk(index, 2048, mask)
    assert (got[1 * q_len:2 * q_len, 1000:] == -1).all() and (got[-3:] == -1).all()


@pytest.mark.parametrize("heads, q_len, kv_dtype, kv_scale", [
    (16, 1, torch.bfloat16, 1.0), (16, 4, torch.float8_e4m3fn, 0.5), (16, 8, torch.bfloat16, 1.0),
    (16, 8, torch.float8_e4m3fn, 0.5), (64, 1, torch.float8_e4m3fn, 0.5), (64, 4, torch.bfloat16, 1.0),
    (128, 1, torch.bfloat16, 1.0), (128, 4, torch.bfloat16, 1.0), (128, 4, torch.float8_e4m3fn, 0.5)])
@gpu
def test_sparse_decode_at_real_size(heads, q_len, kv_dtype, kv_scale):
    q, kv, slots = sparse_inputs(LENS, [q_len] * len(LENS), heads, 64, "cuda", kv_dtype, 2048)
    check_sparse(q, kv, slots, kv_scale)
    check_sparse(q, kv, slots, kv_scale, num_splits=1)


@pytest.mark.parametrize("heads, q_len", [(16, 1), (128, 4)])
@gpu
def test_backend_sparse_passes_on_gpu(heads, q_len):
    compare_sparse_backends("cuda", torch.bfloat16, heads, (3000, 70, 9000), q_len, 2048, 64, 128, page_size=64)
    compare_sparse_backends("cuda", torch.float8_e4m3fn, heads, (3000, 70, 9000), q_len, 2048, 64, 128,
                            kv_scale=0.5, page_size=64)


@pytest.mark.parametrize("heads, q_len", [(16, 1), (64, 4), (128, 4)])
@gpu
def test_flashmla_sparse_passes_on_gpu(heads, q_len):
    """FlashMLA's sparse decode over the fp8_v32 rows against torch_ref over the same rows."""
    pytest.importorskip("flash_mla", reason="flashmla_sparse needs the sgl-flash-mla wheel")
    compare_sparse_backends("cuda", torch.uint8, heads, (3000, 70, 9000), q_len, 2048, 64, 128, page_size=64,
                            backend="flashmla_sparse")


def _sparse_step(index, q, kv, mask):
    slots = indexer_topk(**index, topk=2048, custom_mask=mask)
    return slots, sparse_mla_decode(q, kv, slots, SM_SCALE, 0.5)


@gpu
def test_cuda_graph_replay_equals_eager_bitwise():
    """The indexer and the attention over its slots in one graph; new lengths, keys, queries and mask:
    replay == eager."""
    gen = torch.Generator().manual_seed(6)
    index, q_len = index_inputs(LENS, [4] * len(LENS), 64, 128, 64, "cuda", gen=gen)
    q, kv, _ = sparse_inputs(LENS, [4] * len(LENS), 128, 64, "cuda", torch.float8_e4m3fn, 8)
    mask = random_mask(len(LENS), q_len, q_len, gen, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _sparse_step(index, q, kv, mask)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slots, out = _sparse_step(index, q, kv, mask)
    for lens in (LENS, [100, 8000, 4]):
        index["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        index["index_cache"].copy_(torch.randn(index["index_cache"].shape, generator=gen).to(torch.bfloat16))
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        mask.copy_(random_mask(len(LENS), q_len, q_len, gen, "cuda"))
        eager_slots, eager_out = _sparse_step(index, q, kv, mask)
        slots.fill_(-7)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(slots, eager_slots) and torch.equal(out, eager_out)


@gpu
def test_no_host_sync():
    index, q_len = index_inputs(LENS, [4] * len(LENS), 64, 128, 64, "cuda")
    q, kv, _ = sparse_inputs(LENS, [4] * len(LENS), 16, 64, "cuda", torch.float8_e4m3fn, 8)
    mask = torch.ones(len(LENS), q_len, q_len, dtype=torch.bool, device="cuda")
    for m in (None, mask):  # compile outside the check
        _sparse_step(index, q, kv, m)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for m in (None, mask):
            _sparse_step(index, q, kv, m)
    finally:
        torch.cuda.set_sync_debug_mode("default")
