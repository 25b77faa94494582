"""Decode's overlap helpers: specdec/models/l2.py (weights prefetched into L2) and
specdec/models/side.py (work on a side stream, joined).

CPU: the prefetch is a no-op where its kernel does not serve (CPU tensors, a tensor under a chunk,
a strided one), its kernel compiles for sm_90 with the bulk prefetch in its PTX; Beside runs its
function in place. GPU (marked ``gpu``): the prefetch changes nothing and captures in a CUDA graph;
Beside orders its work after the current stream's and before the join, eagerly and in a graph.
"""

from __future__ import annotations

import pytest
import torch

from specdec.models import l2
from specdec.models.side import Beside

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_prefetch_serves_only_contiguous_cuda_tensors_of_a_chunk():
    weight = torch.ones(64, 64)  # 16 KB on the CPU
    assert not l2.serves(weight)
    l2.prefetch(weight, weight[:, :3])  # a no-op, and no error
    assert torch.equal(weight, torch.ones(64, 64))


def test_prefetch_kernel_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"a_ptr": "*bf16", "a_chunks": "i32", "b_ptr": "*bf16", "b_chunks": "i32", "CHUNK": "constexpr",
                 "LANES": "constexpr"}
    source = ASTSource(l2._prefetch_kernel, signature, {"CHUNK": l2.CHUNK, "LANES": l2.LANES},
                       {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4})
    assert compiled.asm["ptx"].count("cp.async.bulk.prefetch.L2.global") == 1


def test_beside_runs_in_place_off_cuda():
    x = torch.arange(4.0)
    job = Beside(lambda t: t * 2, x)
    assert torch.equal(job.join(), torch.tensor([0.0, 2.0, 4.0, 6.0]))


@pytest.mark.gpu
@requires_cuda
def test_prefetch_on_gpu_changes_nothing_and_captures():
    a = torch.randn(7168, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(3072, 1536 + 8, device="cuda", dtype=torch.bfloat16)  # trailing bytes past a chunk
    want_a, want_b = a.clone(), b.clone()
    l2.prefetch(a, b)
    l2.prefetch(b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2.prefetch(a, b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(a, want_a) and torch.equal(b, want_b)


def _slow_double(x: torch.Tensor) -> torch.Tensor:
    torch.cuda._sleep(2_000_000)  # ~1 ms: the join must wait for it
    return x * 2


@pytest.mark.gpu
@requires_cuda
def test_beside_orders_its_work_on_gpu():
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(2_000_000)
    x.fill_(3.0)  # queued before the side work starts: it must see 3
    job = Beside(_slow_double, x)
    out = job.join() + 1  # after the join: waits for the side stream
    assert torch.equal(out, torch.full_like(x, 7.0))
    static = torch.ones(1 << 20, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = Beside(_slow_double, static).join() + 1
    static.fill_(5.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, torch.full_like(static, 11.0))
