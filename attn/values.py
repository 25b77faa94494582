"""The checks every number a setting or a kernel argument holds goes through: one family.

``is_*`` say whether a value already is what a plan or a kernel takes as it is (a Python int, a
finite real); ``as_int`` / ``require_int`` / ``int_list`` / ``item_list`` take what a caller may
pass (numpy scalars and arrays, one-value tensors) and return Python values. A bool is never a
number here: True reached kernels as a 1-bit argument, or as 1.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Optional

import numpy as np
import torch

# An fp8 cache's per-tensor scale: kernels take it as an fp32 argument and writes divide by it in
# fp32, where 1e-50 is 0 and 1e39 inf (a NaN or all-zero cache). Calibrated scales lie far inside.
KV_SCALE_RANGE = (2.0**-64, 2.0**64)


def is_int(value: object) -> bool:
    """A Python int, not a bool: what plans and kernels take as it is (a numpy int lacks int
    methods such as bit_length and wraps in size products; as_int converts one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(value: object) -> Optional[int]:
    """value as a Python int where it is an integer (numpy integers and one-value integer tensors
    included, bools of any kind not), else None."""
    if isinstance(value, bool) or getattr(value, "dtype", None) in (torch.bool, np.bool_):
        return None
    try:
        return int(operator.index(value))
    except TypeError:
        return None


def require_int(value: object, rule: str, error: type[ValueError] = ValueError) -> int:
    """value as an int (as_int); else ``error`` stating ``rule``."""
    checked = as_int(value)
    if checked is None:
        raise error(f"{rule}, got {value!r}")
    return checked


def is_real(value: object) -> bool:
    """A real number (numpy's included; inf and NaN too), not a bool nor a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite_real(value: object) -> bool:
    """A finite real number (is_real, and not inf, NaN or an int past fp64)."""
    if not is_real(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past fp64
        return False


def is_positive_finite(value: object) -> bool:
    """A finite real number > 0: a scale a kernel takes as an argument."""
    return is_finite_real(value) and value > 0


def is_kv_scale(value: object) -> bool:
    """A kv_scale the cache writes and the kernels can take: a real number in KV_SCALE_RANGE."""
    return is_positive_finite(value) and KV_SCALE_RANGE[0] <= value <= KV_SCALE_RANGE[1]


def item_list(value: object, rule: str, error: type[ValueError] = ValueError) -> list:
    """value, an iterable (a numpy array or a tensor of one dim or more included), as a list; else
    (None, a number, a string, a dict, one object where a list of them belongs) ``error`` stating
    ``rule``."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable) or getattr(value, "ndim", 1) == 0:
        raise error(f"{rule}, got {type(value).__name__} {value!r}"[:300])
    return list(value)


def int_list(value: object, rule: str, error: type[ValueError] = ValueError) -> list[int]:
    """value, an iterable of ints (a numpy array included), as a list of Python ints (as_int); else
    ``error`` stating ``rule``."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    return [require_int(item, rule, error) for item in item_list(value, rule, error)]
