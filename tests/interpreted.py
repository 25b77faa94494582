"""Run a script under Triton's interpreter on the CPU, in a subprocess (the interpreter is
chosen when kernels are decorated, so it cannot be switched on inside the test process); or the
same script here, on the GPU (run_on_gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_PRELUDE = """
import triton.runtime.interpreter as interpreter

# The interpreter turns loaded scalars into 1-element arrays, which NumPy 2 refuses as loop bounds.
_patch = interpreter._patch_lang_tensor
def _patch_index(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = _patch_index

# Triton 3.6's interpreter multiplies bf16 operands of tl.dot as their raw 16-bit patterns: widen
# them to fp32 first (the products a tensor core makes of bf16 are exact in fp32).
import numpy as _np
import triton.language as _tl
_create_dot = interpreter.InterpreterBuilder.create_dot
def _as_fp32(handle):
    if handle.dtype.scalar != _tl.bfloat16:
        return handle
    data = interpreter._convert_float(handle.data, _tl.bfloat16, _tl.float32, None).view(_np.float32)
    return interpreter.TensorHandle(data, _tl.float32)
def _create_dot_bf16(self, a, b, d, *rest):
    return _create_dot(self, _as_fp32(a), _as_fp32(b), d, *rest)
interpreter.InterpreterBuilder.create_dot = _create_dot_bf16
"""


def run_interpreted(script: str) -> None:
    """Run ``script`` (which can import from the repository and from tests/) with
    TRITON_INTERPRET=1 and no GPU; it must print "ok"."""
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    result = subprocess.run([sys.executable, "-c", _PRELUDE + script], cwd=root, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def run_on_gpu(script: str, call: str) -> None:
    """run_interpreted's twin for the GPU tests: define ``script`` in this process, then evaluate
    ``call`` in it (e.g. ``"check_all('cuda')"``). Skips without Triton (the gpu marker skips
    without CUDA)."""
    import pytest

    pytest.importorskip("triton")
    scope: dict = {}
    exec(script, scope)
    eval(call, scope)
