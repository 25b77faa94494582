"""Tests of the Triton paged MLA kernel (attn/kernels/triton_mla/kernel.py); its launch planning
(attn/kernels/triton_mla/plan.py) is tested in tests/test_triton_mla_plan.py.

CPU: the plan a call makes from its inputs and argument checks; the kernel itself under the
Triton interpreter when Triton is installed. GPU (marked ``gpu``): the kernel against a plain-torch
reference for every use case, CUDA-graph replay and the absence of host synchronisation. On SM90
the 64-row cases (128 heads; 16 heads x q_len 4) with page 64 run the Gluon wgmma kernel.
Tolerance: bf16 output vs an fp32 reference, atol = rtol = 2e-2 (atol times a kv_scale above 1).
"""

import pytest
import torch

from attn.kernels.triton_mla import kernel as triton_mla_kernel
from attn.kernels.triton_mla.kernel import mla_paged_attention, plan_for
from attn.kernels.triton_mla.plan import MAX_SPLITS, plan_launch
from interpreted import run_interpreted

D, DV = 576, 512
SM_SCALE = 192 ** -0.5
ATOL = RTOL = 2e-2

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gpu(test):
    return pytest.mark.gpu(requires_cuda(test))


def reference(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, sm_scale, custom_mask=None, kv_scale=1.0):
    """Loop over requests in fp32: the exact semantics of the contract. Returns [T, H, 512] fp32."""
    q, kv_cache, block_tables = q.cpu().float(), kv_cache.cpu().float() * kv_scale, block_tables.cpu()
    seq_lens, cu = seq_lens.cpu().tolist(), cu_seqlens_q.cpu().tolist()
    page_size = kv_cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], DV)
    for b, kv_len in enumerate(seq_lens):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        idx = torch.arange(kv_len)
        kv = kv_cache[block_tables[b, idx // page_size].long(), idx % page_size]  # [L, 576]
        if custom_mask is None:
            pos = kv_len - q_len + torch.arange(q_len)
            visible = idx[None, :] <= pos[:, None]
        else:
            start = kv_len - custom_mask.shape[2]
            bits = custom_mask.cpu()[b, :q_len][:, (idx - start).clamp(min=0)]
            visible = (idx[None, :] < start) | ((idx[None, :] >= start) & bits)
        scores = torch.einsum("ihd,jd->ihj", q[cu[b]:cu[b + 1]], kv) * sm_scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[cu[b]:cu[b + 1]] = torch.einsum("ihj,jd->ihd", probs, kv[:, :DV])
    return out


def make_inputs(seq_lens, q_lens, num_heads, page_size, device, kv_dtype=torch.bfloat16, max_q_len=None,
                extra_pages=3, gen=None, q_dtype=torch.bfloat16):
    """Random queries and a shuffled paged cache; table entries past each length are garbage."""
    gen = gen or torch.Generator().manual_seed(0)
    batch = len(seq_lens)
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    max_pages = max(max(pages_per_req, default=0), 1) + extra_pages
    num_pages = sum(pages_per_req) + 4
    perm = torch.randperm(num_pages, generator=gen)
    block_tables = torch.randint(0, num_pages, (batch, max_pages), generator=gen, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_req):
        block_tables[b, :n] = perm[used:used + n]
        used += n
    kv = torch.randn(num_pages, page_size, D, generator=gen)
    kv_cache = kv.to(kv_dtype)
    tokens = sum(q_lens)
    q = torch.randn(tokens, num_heads, D, generator=gen).to(q_dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    args = dict(q=q, kv_cache=kv_cache, block_tables=block_tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), cu_seqlens_q=cu)
    args = {k: v.to(device) for k, v in args.items()}
    return args, (max_q_len or max(max(q_lens), 1))


def random_mask(batch, max_q_len, mask_len, gen, device):
    return (torch.rand(batch, max_q_len, mask_len, generator=gen) < 0.5).to(device)


def check(args, max_q_len, custom_mask=None, kv_scale=1.0, num_splits=None, max_kv_len=None):
    """The kernel against reference(). V, and so the error of each 16-bit rounding (output and
    split partials, where partials of either sign can cancel), scales with kv_scale: atol grows with it."""
    out = mla_paged_attention(**args, max_q_len=max_q_len, sm_scale=SM_SCALE, custom_mask=custom_mask,
                              kv_scale=kv_scale, num_splits=num_splits, max_kv_len=max_kv_len)
    ref = reference(args["q"], args["kv_cache"], args["block_tables"], args["seq_lens"], args["cu_seqlens_q"],
                    SM_SCALE, custom_mask, kv_scale)
    got = out.float().cpu()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=ATOL * max(kv_scale, 1.0), rtol=RTOL)
    return got


# ----------------------------------------------------------------------------- CPU


def test_plan_for_plans_from_the_inputs_bounds(monkeypatch):
    """mla_paged_attention's plan: the longest sequence is the shorter of the block table's width and
    the cache (in pages) times the page size (it caps the splits here); off SM90 no wgmma kernel."""
    monkeypatch.setattr(triton_mla_kernel, "_num_sms", lambda device: 132)
    q = torch.zeros(12, 16, D, dtype=torch.bfloat16)
    kv = torch.zeros(40, 64, D, dtype=torch.bfloat16)
    for width, pages, splits in ((64, 40, 40), (16, 16, 16)):
        plan, config = plan_for(q, kv, torch.zeros(3, width, dtype=torch.int32), 4)
        assert plan == plan_launch(3, 16, 4, pages * 64, 132) and plan.num_splits == splits and not config.wgmma
    # A caller's bound on the lengths, where it is below them: the plan is for the bound.
    table = torch.zeros(3, 64, dtype=torch.int32)
    assert plan_for(q, kv, table, 4, max_kv_len=1000)[0] == plan_launch(3, 16, 4, 1000, 132)
    assert plan_for(q, kv, table, 4, max_kv_len=10**6)[0] == plan_launch(3, 16, 4, 40 * 64, 132)


def _valid_args():
    args, _ = make_inputs([5, 3], [1, 1], 16, 4, "cpu")
    return dict(args, max_q_len=1, sm_scale=SM_SCALE)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"][..., :512]), r"q must be \[T, H, 576\]"),
        (lambda a: a.update(q=a["q"].float()), "q must be bfloat16 or float16"),
        (lambda a: a.update(kv_cache=a["kv_cache"].half()), "kv_cache dtype must be q's"),
        (lambda a: a.update(kv_cache=a["kv_cache"][:, :, :512]), "kv_cache must be"),
        # rows 2**29 elements apart (untouched storage): page offsets past 2**31 in the kv loop
        (lambda a: a.update(kv_cache=torch.empty(3 * 2**29 + 576, dtype=torch.bfloat16).as_strided(
            (1, 4, 576), (4 * 2**29, 2**29, 1))), "kv_cache's row stride 536870912 x page size 4"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), r"seq_lens must be \[B=2\]"),
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q must be"),
        (lambda a: a.update(max_q_len=0), "max_q_len must be a positive int"),
        (lambda a: a.update(custom_mask=torch.ones(2, 1, 4, dtype=torch.int32)), "custom_mask must be bool"),
        (lambda a: a.update(custom_mask=torch.ones(2, 2, 4, dtype=torch.bool)), r"custom_mask must be \[B=2"),
        (lambda a: a.update(out=torch.empty(2, 16, 576, dtype=torch.bfloat16)), r"out must be \[2, 16, 512\]"),
        (lambda a: a.update(num_splits=0), "num_splits must be"),
        (lambda a: a.update(num_splits=MAX_SPLITS + 1), "num_splits must be"),
        (lambda a: a.update(max_kv_len=0), "max_kv_len must be a positive int"),
        (lambda a: a.update(max_kv_len=2.0), "max_kv_len must be a positive int"),
        # bools are no ints here (num_splits=True would reach the kernel as a 1-bit argument)
        (lambda a: a.update(num_splits=True), "num_splits must be"),
        (lambda a: a.update(max_q_len=True), "max_q_len must be a positive int"),
        (lambda a: a.update(max_kv_len=True), "max_kv_len must be a positive int"),
        # a tensor scale would fail inside Triton, a NaN one make the output NaN
        (lambda a: a.update(kv_scale=torch.tensor(1.0)), "kv_scale must be a finite positive float"),
        (lambda a: a.update(kv_scale=float("nan")), "kv_scale must be a finite positive float"),
        (lambda a: a.update(sm_scale=float("inf")), "sm_scale must be a finite positive float"),
        (lambda a: a.update(sm_scale=0.0), "sm_scale must be a finite positive float"),
    ],
)
def test_argument_checks(change, message):
    args = _valid_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        mla_paged_attention(**args)


def test_reference_matches_dense_softmax():
    """The test's own reference on a trivial case: one request, page size 1, identity table."""
    gen = torch.Generator().manual_seed(1)
    args, _ = make_inputs([6], [2], 2, 1, "cpu", gen=gen)
    got = reference(args["q"], args["kv_cache"], args["block_tables"], args["seq_lens"], args["cu_seqlens_q"], 0.1)
    kv = args["kv_cache"][args["block_tables"][0, :6].long(), 0].float()
    for i, pos in enumerate((4, 5)):
        probs = torch.softmax(args["q"][i].float() @ kv[: pos + 1].T * 0.1, dim=-1)
        torch.testing.assert_close(got[i], probs @ kv[: pos + 1, :DV])


_INTERPRETED = """
import numpy as np
import torch

from attn.kernels.triton_mla.kernel import mla_paged_attention
from tests.test_triton_mla_kernel import SM_SCALE, check, make_inputs, random_mask

# bf16 products go through tests/interpreted.py's fix of the interpreter's bf16 tl.dot.
for dtype in (torch.float16, torch.bfloat16):
    half = dict(kv_dtype=dtype, q_dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    args, q = make_inputs([300, 0, 9, 1], [2, 1, 3, 0], 16, 4, "cpu", gen=gen, **half)
    check(args, q)
    check(args, q, num_splits=3)
    check(args, q, custom_mask=random_mask(4, q, 3, gen, "cpu"), num_splits=2)
    check(args, q, max_kv_len=16)  # planned for 16 rows: the 300-row request in more, longer chunks
    args, q = make_inputs([40, 7], [4, 4], 8, 1, "cpu", gen=gen, **half)
    mask = random_mask(2, q, 9, gen, "cpu")
    expected = check(args, q, custom_mask=mask, kv_scale=0.5)
# numpy scales (float32 reached Triton as a type it refuses)
got = mla_paged_attention(**args, max_q_len=q, sm_scale=np.float32(SM_SCALE), kv_scale=np.float32(0.5), custom_mask=mask)
torch.testing.assert_close(got.float(), expected, atol=2e-3, rtol=2e-3)
print("ok")
"""


def test_kernel_under_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED)


_INTERPRETED_MERGE = """
import math

import torch

from attn.kernels.triton_mla.kernel import _merge_splits

gen = torch.Generator().manual_seed(5)
T, H, S = 4, 2, 200  # past MAX_SPLITS (128, loaded at once): the reduce streams them in blocks of 128
for dtype in (torch.float32, torch.bfloat16):  # partials as the kernels write them: fp32 or 16-bit
    part = torch.randn(T, H, S + 3, 512, generator=gen).to(dtype)[:, :, :S]
    lse = torch.randn(T, H, S, generator=gen) * 8
    empty = torch.rand(T, H, S, generator=gen) < 0.3
    empty[1, 0] = True  # a row whose every chunk is empty
    lse[empty] = float("-inf")
    part[empty] = float("nan")  # empty chunks write no partial: whatever is there must not leak
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)  # token 3 belongs to no request
    out = torch.full((T, H, 512), 7.0)
    _merge_splits(part, lse, out, cu, S, discard=True)  # no discards off the GPU
    weights = torch.softmax(lse * math.log(2), dim=-1).nan_to_num(0.0)  # lse is log2-sum-exp
    expected = torch.einsum("ths,thsd->thd", weights, part.float().nan_to_num(0.0))  # merged in fp32
    torch.testing.assert_close(out[:3], expected[:3], atol=1e-5, rtol=1e-5)
    assert (out[1, 0] == 0).all() and (out[3] == 7.0).all()
print("ok")
"""


def test_split_merge_under_triton_interpreter():
    """The reduce alone, over fp32 and 16-bit partials, against an fp32 softmax over the chunks'
    lse: two split blocks (a running maximum across them), NaN in empty chunks, an all-empty row,
    a token of no request."""
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED_MERGE)


_INTERPRETED_STRIDES = """
import torch

from attn.kernels.triton_mla.kernel import mla_paged_attention
from test_triton_mla_kernel import make_inputs, reference

STRIDE = 2 ** 30  # int32, but head 2 of a view with this head stride lies past 2 ** 31 elements
args, q_len = make_inputs([20], [1], 3, 16, "cpu", q_dtype=torch.float16, kv_dtype=torch.float16)
expected = mla_paged_attention(**args, max_q_len=q_len, sm_scale=0.07)
torch.testing.assert_close(expected.float(), reference(**args, sm_scale=0.07), atol=2e-3, rtol=2e-3)


def head_strided(rows):
    # rows [1, 3, n] as a view of heads STRIDE elements apart (untouched pages cost no memory)
    view = torch.empty(2 * STRIDE + rows.shape[2], dtype=rows.dtype).as_strided(rows.shape, (rows.shape[2], STRIDE, 1))
    view.copy_(rows)
    return view


for num_splits in (1, 2):  # the attention kernel's own store, and the reduce's
    got = mla_paged_attention(**{**args, "q": head_strided(args["q"])}, max_q_len=q_len, sm_scale=0.07, num_splits=num_splits)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
    out = head_strided(torch.zeros(1, 3, 512, dtype=torch.float16))
    mla_paged_attention(**args, max_q_len=q_len, sm_scale=0.07, num_splits=num_splits, out=out)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
print("ok")
"""


def test_head_strides_past_int32_offsets_under_triton_interpreter():
    """q and out as views whose head offsets pass 2**31 elements (e.g. a transposed [H, T, 576]
    buffer) give what contiguous ones give, split and not: head x stride must not wrap as an int32
    product would (reading and writing out of bounds)."""
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED_STRIDES)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@gpu
def test_decode(num_heads, page_size, num_splits):
    args, q = make_inputs([1, 700, 0, 129, 2048], [1] * 5, num_heads, page_size, "cuda")
    got = check(args, q, num_splits=num_splits)
    assert (got[2] == 0).all()  # seq_len 0 padding row


@pytest.mark.parametrize("num_heads", [16, 128])
@gpu
def test_decode_with_max_splits(num_heads):
    """MAX_SPLITS chunks, over 64 of them holding kv: the reduce merges them in one load of
    32-dim row slices."""
    args, q = make_inputs([20000, 9000, 1], [1] * 3, num_heads, 64, "cuda")
    check(args, q, num_splits=MAX_SPLITS)


@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("q_len", [4, 8])
@gpu
def test_verify_causal(num_heads, q_len):
    args, q = make_inputs([q_len, 300, 1000, 5000], [q_len] * 4, num_heads, 64, "cuda")
    check(args, q)
    check(args, q, num_splits=1)


@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("q_len", [1, 16, 64])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@gpu
def test_few_heads_over_pages_of_whole_wgmma_tiles(num_heads, q_len, kv_dtype):
    """Up to 8 heads (a tensor-parallel shard of 32-128 heads) over pages of 64. On SM90 the
    wgmma tile serves their 64-row tiles but for 3 heads (serves_heads): 1, 2 and 4 heads in query
    boxes of 8 rows, several tokens' heads each (4 heads x 16 tokens make one 64-row tile); 3 heads
    on the Triton 64-row tile. Decodes (q_len 1) plan narrower tiles here."""
    args, q = make_inputs([q_len, 300, 2048], [q_len] * 3, num_heads, 64, "cuda", kv_dtype=kv_dtype)
    plan, config = plan_for(args["q"], args["kv_cache"], args["block_tables"], q)
    sm90 = torch.cuda.get_device_capability()[0] == 9
    assert (plan.tile.rows == 64) == (q_len >= 16 and (num_heads >= 3 or q_len == 64))
    assert config.wgmma == (sm90 and plan.tile.rows == 64 and num_heads != 3)
    check(args, q)
    check(args, q, num_splits=1)


@pytest.mark.parametrize("num_heads, q_lens, masked", [
    (4, [1, 1, 1], False), (4, [3, 3, 3], True), (4, [15, 15, 15], False), (2, [5, 5, 5], True), (1, [7, 7, 7], False),
    (4, [3, 0, 8, 5], False), (2, [1, 8, 0, 3], False), (4, [17, 17, 17], False), (2, [37, 37, 37], True)])
@gpu
def test_query_boxes_of_several_tokens_reach_past_each_request(num_heads, q_lens, masked):
    """1, 2 and 4 heads on the wgmma tile: a query box holds 8 // num_heads tokens' heads, so with
    query lengths that are not a multiple of that (and ragged ones: draft-extend) a request's last
    box reaches into the next request's tokens, and the last request's past the query (TMA fills
    zeros); with more tokens than a tile holds, in a request's second query block too. Those rows
    are never stored. On SM90 a 16k context makes the plan widen the tile to 64 rows."""
    gen = torch.Generator().manual_seed(5)
    seq_lens = [max(q, 1) for q in q_lens[:1]] + [300 + q for q in q_lens[1:-1]] + [16384]
    args, q = make_inputs(seq_lens, q_lens, num_heads, 64, "cuda", gen=gen)
    plan, config = plan_for(args["q"], args["kv_cache"], args["block_tables"], q)
    sm90 = torch.cuda.get_device_capability()[0] == 9
    assert config.wgmma == sm90 and (plan.tile.rows == 64 or not sm90)
    mask = random_mask(len(q_lens), q, q, gen, "cuda") if masked else None
    check(args, q, custom_mask=mask)
    check(args, q, custom_mask=mask, num_splits=1)


@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("page_size", [1, 64])
@gpu
def test_verify_tree_mask(num_heads, page_size):
    gen = torch.Generator().manual_seed(7)
    q_len = 8
    args, q = make_inputs([8, 90, 1000, 3000], [q_len] * 4, num_heads, page_size, "cuda", gen=gen)
    mask = random_mask(4, q_len, q_len, gen, "cuda")
    mask[0, 3] = False  # kv_len == M: this row sees no key at all and must output 0
    got = check(args, q, custom_mask=mask)
    assert (got[3] == 0).all()
    check(args, q, custom_mask=mask, num_splits=4)


@gpu
def test_draft_tree_step_mask_longer_than_q_len():
    """Draft step 3 of a topk=4 tree: 4 queries, mask over the last 12 kv positions."""
    gen = torch.Generator().manual_seed(11)
    args, q = make_inputs([12, 40, 2000], [4, 4, 4], 16, 16, "cuda", gen=gen)
    check(args, q, custom_mask=random_mask(3, 4, 12, gen, "cuda"))


@pytest.mark.parametrize("num_heads", [16, 128])
@gpu
def test_draft_extend_variable_q_len(num_heads):
    args, q = make_inputs([3, 50, 0, 800, 8, 4000], [3, 0, 0, 1, 8, 5], num_heads, 16, "cuda", max_q_len=8)
    check(args, q)
    check(args, q, num_splits=5)


@pytest.mark.parametrize("num_heads, q_len, kv_dtype", [
    (128, 1, torch.bfloat16), (16, 4, torch.bfloat16), (128, 4, torch.bfloat16), (16, 1, torch.bfloat16),
    (32, 1, torch.bfloat16), (128, 1, torch.float8_e4m3fn), (16, 4, torch.float8_e4m3fn),
    (16, 1, torch.float8_e4m3fn)])
@gpu
def test_nan_past_each_length_stays_out(num_heads, q_len, kv_dtype):
    """Cache rows past each request's length (inside its last page) hold NaN: the 64-row wgmma
    tile, whose TMA copies whole pages, must keep them out of P @ V (an fp8 tile's NaN survives
    its widening; a widened tile's unloaded query rows are rewritten as fp16 too). 16 and 32 heads
    x q_len 1 reach it widened (three of every four, or every other, query slot empty): at 8k the
    narrow tiles' whole-wave chunks would hold two 64-row kv tiles."""
    args, q = make_inputs([1, 70, 1000, 8191], [q_len] * 4, num_heads, 64, "cuda", kv_dtype=kv_dtype)
    kv, bt = args["kv_cache"], args["block_tables"].cpu()
    for b, n in enumerate(args["seq_lens"].tolist()):
        kv[bt[b, (n - 1) // 64], (n - 1) % 64 + 1:] = float("nan")
    if torch.cuda.get_device_capability()[0] == 9:  # the launch runs the 64-row wgmma kernel
        assert plan_for(args["q"], kv, args["block_tables"], q)[1].wgmma
    check(args, q)
    check(args, q, num_splits=3)


@pytest.mark.parametrize("num_heads, q_len", [(128, 4), (16, 4), (16, 1)])
@gpu
def test_many_programs_with_empty_splits_and_a_padded_query(num_heads, q_len):
    """Several waves of programs (row blocks x splits x requests, 224-1792 of them), many on empty
    splits of short requests or on one partial kv tile; causal and tree-masked; a query with
    padded rows (strides that are not its shape's), which the wgmma kernel still serves on SM90."""
    gen = torch.Generator().manual_seed(5)
    lens = [4, 64, 65, 3000, 5, 200, 129, 4097] * 4
    args, q = make_inputs(lens, [q_len] * len(lens), num_heads, 64, "cuda", gen=gen)
    padded = torch.zeros(args["q"].shape[0], num_heads, 640, dtype=args["q"].dtype, device="cuda")
    padded[..., :D] = args["q"]
    args["q"] = padded[..., :D]
    if torch.cuda.get_device_capability()[0] == 9:  # the launch runs the 64-row wgmma kernel
        assert plan_for(args["q"], args["kv_cache"], args["block_tables"], q)[1].wgmma
    check(args, q, num_splits=7)
    check(args, q, custom_mask=random_mask(len(lens), q_len, q_len, gen, "cuda"), num_splits=7)


@pytest.mark.parametrize("num_heads, q_len", [(16, 1), (16, 4), (128, 1)])
@gpu
def test_a_bound_below_the_lengths_plans_short_and_still_attends_everything(num_heads, q_len):
    """Tables 29k rows wide (an engine's longest context) with a caller's bound of 1k: the plan of a
    1k table (the narrow Triton tile), and requests past the bound still exact."""
    gen = torch.Generator().manual_seed(8)
    lens = [700, 13000]
    args, q = make_inputs(lens, [q_len] * len(lens), num_heads, 64, "cuda", gen=gen, extra_pages=256)
    bounded = plan_for(args["q"], args["kv_cache"], args["block_tables"], q, max_kv_len=1024)[0]
    wide = plan_for(args["q"], args["kv_cache"], args["block_tables"], q)[0]
    assert bounded == plan_for(args["q"], args["kv_cache"], args["block_tables"][:, :16], q)[0]
    assert (bounded.tile, bounded.num_splits) != (wide.tile, wide.num_splits)
    check(args, q, max_kv_len=1024)
    if q_len > 1:
        check(args, q, custom_mask=random_mask(len(lens), q_len, q_len, gen, "cuda"), max_kv_len=1024)


@pytest.mark.parametrize("num_heads, q_len", [(16, 4), (128, 1), (16, 1)])
@gpu
def test_partials_discarded_after_the_merge(num_heads, q_len):
    """A split launch of >= DISCARD_MIN_TOKENS (batch x the block table's reach: 4 x 8192) drops its
    partials from L2 once merged (16-bit partials; fp32 on the widened 16-head tile); launch after
    launch (the partial buffers come back from the allocator) the output stays right."""
    gen = torch.Generator().manual_seed(9)
    args, q = make_inputs([5000, 1, 3000, 8000], [q_len] * 4, num_heads, 64, "cuda", gen=gen)
    plan = plan_for(args["q"], args["kv_cache"], args["block_tables"], q)[0]
    assert plan.discard_partials and plan.num_splits > 1
    for _ in range(3):
        check(args, q)
    check(args, q, custom_mask=random_mask(4, q_len, q_len, gen, "cuda"))


@gpu
def test_short_prefill():
    args, q = make_inputs([300, 1200], [300, 77], 16, 64, "cuda")
    check(args, q)


@pytest.mark.parametrize("num_heads, q_len, q_dtype", [
    (16, 4, torch.bfloat16), (128, 1, torch.bfloat16), (128, 4, torch.bfloat16), (16, 4, torch.float16)])
@gpu
def test_fp8_cache_with_scale(num_heads, q_len, q_dtype):
    """An fp8_e4m3 cache with a per-tensor scale, split and not, causal and tree-masked. On SM90
    these 64-row tiles run the wgmma kernel, which widens each fp8 tile into an fp16 stage and
    rescales a bf16 query into fp16 (2^-8): query rows from 1e-3 to 1e5 (past fp16's 65504) in
    magnitude, and a query of ~1e-2 (mostly below 2^-6, fp16 subnormals once scaled) under a
    cache scale that makes its scores O(1)."""
    gen = torch.Generator().manual_seed(3)
    args, q = make_inputs([1, 500, 3000, 70], [q_len] * 4, num_heads, 64, "cuda", kv_dtype=torch.float8_e4m3fn,
                          gen=gen, q_dtype=q_dtype)
    if torch.cuda.get_device_capability()[0] == 9:
        assert plan_for(args["q"], args["kv_cache"], args["block_tables"], q)[1].wgmma
    small = dict(args, q=(args["q"].float() * 1e-2).to(q_dtype))
    check(small, q, kv_scale=100.0)
    if q_dtype == torch.bfloat16:
        magnitudes = torch.tensor([1e-3, 1.0, 30.0, 1e5], device="cuda").repeat_interleave(q_len)
        args["q"] = (args["q"].float() * magnitudes[:, None, None]).to(q_dtype)
    check(args, q, kv_scale=0.5)
    check(args, q, kv_scale=0.5, num_splits=1)
    check(args, q, custom_mask=random_mask(4, q_len, q_len, gen, "cuda"), kv_scale=0.5, num_splits=7)


@gpu
def test_out_is_written_in_place_and_extra_rows_untouched():
    args, q = make_inputs([100, 200], [1, 1], 16, 16, "cuda")
    out = torch.full((3, 16, DV), 7.0, dtype=torch.bfloat16, device="cuda")  # one row past cu[B]
    args["q"] = torch.cat([args["q"], args["q"][:1]])
    result = mla_paged_attention(**args, max_q_len=q, sm_scale=SM_SCALE, out=out, num_splits=2)
    assert result is out
    assert (out[2] == 7).all()
    ref = reference(args["q"], args["kv_cache"], args["block_tables"], args["seq_lens"], args["cu_seqlens_q"],
                    SM_SCALE)
    torch.testing.assert_close(out[:2].float().cpu(), ref[:2], atol=ATOL, rtol=RTOL)


@gpu
@pytest.mark.parametrize("num_splits", [1, 2])
def test_head_strides_past_int32_offsets(num_splits):
    """16 heads x q_len 4 on pages of 64 (the wgmma tile on SM90): q and out as views whose head
    offsets pass 2**31 elements. A strided q is no TMA row block, so it runs the Triton tile; out
    is stored by whichever kernel runs."""
    stride = 2 ** 28  # head 15: 15 * 2**28 elements in; 8 GB of views a call
    args, q_len = make_inputs([300, 70], [4, 4], 16, 64, "cuda")
    expected = mla_paged_attention(**args, max_q_len=q_len, sm_scale=SM_SCALE, num_splits=num_splits)
    torch.testing.assert_close(expected.float().cpu(), reference(**args, sm_scale=SM_SCALE), atol=ATOL, rtol=RTOL)

    def head_strided(rows):
        tokens, heads, n = rows.shape
        storage = torch.empty((heads - 1) * stride + tokens * n, dtype=rows.dtype, device="cuda")
        return storage.as_strided(rows.shape, (n, stride, 1)).copy_(rows)

    got = mla_paged_attention(**{**args, "q": head_strided(args["q"])}, max_q_len=q_len, sm_scale=SM_SCALE,
                              num_splits=num_splits)
    torch.testing.assert_close(got.float(), expected.float(), atol=ATOL, rtol=RTOL)  # another kernel
    del got
    out = head_strided(torch.zeros_like(expected))
    mla_paged_attention(**args, max_q_len=q_len, sm_scale=SM_SCALE, num_splits=num_splits, out=out)
    assert torch.equal(out, expected)


@gpu
def test_cuda_graph_replay_equals_eager_bitwise():
    gen = torch.Generator().manual_seed(5)
    args, q = make_inputs([900, 3, 4000, 0], [4] * 4, 16, 64, "cuda", gen=gen)
    mask = random_mask(4, 4, 4, gen, "cuda")
    out = torch.empty(16, 16, DV, dtype=torch.bfloat16, device="cuda")

    def step():
        mla_paged_attention(**args, max_q_len=q, sm_scale=SM_SCALE, custom_mask=mask, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_lens in ([900, 3, 4000, 0], [17, 4, 2500, 4]):  # new lengths, same static shapes
        args["seq_lens"].copy_(torch.tensor(new_lens, dtype=torch.int32))
        mask.copy_(random_mask(4, 4, 4, gen, "cuda"))
        step()
        eager = out.clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@gpu
def test_no_host_sync():
    args, q = make_inputs([900, 3, 4000], [2] * 3, 128, 16, "cuda")
    mask = torch.ones(3, 2, 2, dtype=torch.bool, device="cuda")
    mla_paged_attention(**args, max_q_len=q, sm_scale=SM_SCALE)  # compile outside the check
    mla_paged_attention(**args, max_q_len=q, sm_scale=SM_SCALE, custom_mask=mask)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla_paged_attention(**args, max_q_len=q, sm_scale=SM_SCALE)
        mla_paged_attention(**args, max_q_len=q, sm_scale=SM_SCALE, custom_mask=mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
def test_table_entries_past_length_are_never_read():
    """Garbage page ids far outside the cache past each request's length: an out-of-bounds read
    would fault. Last in the file because a fault would poison the CUDA context."""
    args, q = make_inputs([5, 64, 130], [2, 2, 2], 16, 64, "cuda", extra_pages=5)
    bt = args["block_tables"]
    for b, n in enumerate((1, 1, 3)):
        bt[b, n:] = 2 ** 30
    check(args, q)
    torch.cuda.synchronize()


