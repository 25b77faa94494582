"""Compile checks without a GPU: record a wrapper's kernel launches on CPU stand-ins, then compile
each for sm_90 as Triton's launcher would specialise it (tests/test_moe_compile.py,
tests/test_gemv.py)."""

from __future__ import annotations

import torch

H200_SHARED_MEMORY = 232448  # bytes a block may use on SM90
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64"}


class Recorder:
    """A kernel's stand-in that appends each launch (kernel, args, kwargs) to ``launches``."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel = kernel.kernel if isinstance(kernel, Recorder) else kernel  # one already there: its kernel
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def compile_for_sm90(kernel, args, kwargs):
    """Compile a recorded launch for sm_90 as Triton's launcher would specialise it (pointers 16-byte
    aligned, as the caching allocator gives; integers divisible by 16 marked so)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in kwargs:
            signature[name] = "constexpr"
            continue
        arg = args[i]
        if isinstance(arg, float):
            signature[name] = "fp32"
            continue
        signature[name] = "*" + TRITON_TYPES[arg.dtype] if isinstance(arg, torch.Tensor) else "i32"
        if isinstance(arg, torch.Tensor) or arg % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, kwargs, attrs), target=GPUTarget("cuda", 90, 64),
                          options=options)
