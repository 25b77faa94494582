"""A Blackwell device described without one: what the CuTe-DSL MLA kernels ask of the device.

tokenspeed-mla's and FlashInfer's cute-dsl MLA decode kernels compile for ``sm_100a`` / ``sm_103a``
on any machine once the few device queries they make (capability, properties, SM count, cluster
capacity, the DSL's default arch) are answered with a fixed description: :data:`B200`,
:data:`B300`, installed by :func:`fake_b200`. devtools/sm100_compile.py captures and compiles the
variants the backends launch under it. It patches torch (unittest.mock), so runtime code never
imports it; the backends take their SM count from attn.backends.blackwell.device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any, Iterator
from unittest import mock

import torch

from attn.backends.blackwell.device import B200_SM_COUNT

__all__ = ["B200", "B300", "DeviceDescription", "fake_b200"]


@dataclasses.dataclass(frozen=True)
class DeviceDescription:
    """What the kernels' device queries are answered with inside :func:`fake_b200`.

    The attribute names mirror ``torch.cuda.get_device_properties()`` so an instance can stand in
    for it. ``max_active_clusters(cluster_size)`` answers ``cutlass.utils.HardwareInfo``'s
    occupancy query for a kernel that fills one SM per CTA: ``multi_processor_count //
    cluster_size`` (74 for the 2-CTA MLA decode clusters on a B200).
    """

    name: str
    major: int
    minor: int
    multi_processor_count: int
    total_memory: int
    L2_cache_size: int
    shared_memory_per_block_optin: int
    max_threads_per_multi_processor: int = 2048
    warp_size: int = 32
    regs_per_multiprocessor: int = 65536
    is_integrated: bool = False

    def max_active_clusters(self, cluster_size: int) -> int:
        if not 1 <= cluster_size <= 32:
            raise ValueError(f"cluster_size must be in [1, 32], got {cluster_size}")
        return self.multi_processor_count // cluster_size


#: NVIDIA B200 (SM 10.0): 148 SMs, ~180 GiB HBM3e usable, 126 MiB L2, 227 KiB opt-in smem/block.
B200 = DeviceDescription(
    name="NVIDIA B200",
    major=10,
    minor=0,
    multi_processor_count=B200_SM_COUNT,
    total_memory=180 * 1024**3,
    L2_cache_size=126 * 1024**2,
    shared_memory_per_block_optin=232448,
)

#: NVIDIA B300 (Blackwell Ultra, SM 10.3), assumed to enable 148 SMs like the B200 (the count cuDNN's
#: SDPA heuristics quote for the B300 they were fitted on; the die has 160, and split-KV, hence
#: which variants compile, follows the enabled count), 288 GB HBM3e (268 GiB); L2 and shared memory
#: assumed the B200's. The MLA decode kernels read only the capability and the SM count.
B300 = dataclasses.replace(B200, name="NVIDIA B300", minor=3, total_memory=268 * 1024**3)


# Library caches that memoise device answers. They are emptied on entry (so a real GPU's answers
# never leak into a fake-B200 compile) and on exit (so fake answers never leak out). Only modules
# already imported are touched; nothing is imported for this.
_MEMOISED_DEVICE_QUERIES: tuple[tuple[str, str], ...] = (
    ("flashinfer.utils", "get_device_properties"),
    ("flashinfer.utils", "get_compute_capability"),
    ("flashinfer.utils", "get_device_name"),
    ("flashinfer.cute_dsl.utils", "get_max_active_clusters"),
    ("tokenspeed_mla.utils", "get_num_sm"),
    ("tokenspeed_mla.utils", "get_max_active_clusters"),
)
# Module globals holding a cached ``cutlass.utils.HardwareInfo`` instance.
_HARDWARE_INFO_SINGLETONS: tuple[tuple[str, str], ...] = (
    ("flashinfer.cute_dsl.utils", "_hardware_info_cache"),
    ("tokenspeed_mla.utils", "_hardware_info_cache"),
)


def _clear_memoised_device_queries() -> None:
    for module_name, attr in _MEMOISED_DEVICE_QUERIES:
        fn = getattr(sys.modules.get(module_name), attr, None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()


def _cute_dsl_environment() -> Any:
    """The CuTe DSL's environment settings object (holds the default ``arch``), if reachable."""
    try:
        from cutlass.cutlass_dsl import BaseDSL

        env = BaseDSL._get_dsl().envar
    except (ImportError, AttributeError):
        return None
    return env if isinstance(getattr(type(env), "arch", None), property) else None


def _fake_hardware_info_class(device: DeviceDescription) -> type:
    class FakeHardwareInfo:
        """Stands in for ``cutlass.utils.HardwareInfo`` (which needs a CUDA driver context)."""

        def __init__(self, device_id: int = 0) -> None:
            self.device_id = device_id

        def get_max_active_clusters(self, cluster_size: int, stream: Any = None) -> int:
            return device.max_active_clusters(cluster_size)

        def get_device_multiprocessor_count(self) -> int:
            return device.multi_processor_count

        def get_l2_cache_size_in_bytes(self) -> int:
            return device.L2_cache_size

    return FakeHardwareInfo


@contextlib.contextmanager
def fake_b200(device: DeviceDescription = B200) -> Iterator[DeviceDescription]:
    """Answer the CuTe-DSL kernels' device queries with ``device`` (a B200 by default, or e.g.
    :data:`B300`) inside the ``with`` block, restored on exit; yields the description in force.

    Patched: ``torch.cuda.get_device_capability`` / ``get_device_properties``; where
    nvidia-cutlass-dsl is installed (imported here), ``cutlass.utils.HardwareInfo`` (cluster
    capacity, SM count, L2) and the DSL's default target arch (``sm_{major}{minor}a``, what kernels
    compiled without ``--gpu-arch`` read). The libraries' memoised device answers
    (_MEMOISED_DEVICE_QUERIES, _HARDWARE_INFO_SINGLETONS) are emptied on entry and exit, so neither
    real nor fake answers cross the boundary. Process-wide: launch no GPU work from other threads
    inside the block; nothing here launches a kernel.
    """
    description = device

    def get_device_capability(device: Any = None) -> tuple[int, int]:
        return (description.major, description.minor)

    def get_device_properties(device: Any = None) -> DeviceDescription:
        return description

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(torch.cuda, "get_device_capability", get_device_capability)
        )
        stack.enter_context(
            mock.patch.object(torch.cuda, "get_device_properties", get_device_properties)
        )
        try:
            import cutlass.utils as cutlass_utils
        except ImportError:
            cutlass_utils = None
        if cutlass_utils is not None:
            stack.enter_context(
                mock.patch.object(cutlass_utils, "HardwareInfo", _fake_hardware_info_class(device))
            )
            # The DSL's default target (used by kernels compiled without --gpu-arch, e.g.
            # tokenspeed-mla's prefill) is CUTE_DSL_ARCH or the detected GPU: pin it.
            dsl_env = _cute_dsl_environment()
            if dsl_env is not None:
                stack.enter_context(
                    mock.patch.object(dsl_env, "arch", f"sm_{device.major}{device.minor}a")
                )
        # Restore HardwareInfo singletons exactly; reset them to None while inside.
        saved = []
        for module_name, attr in _HARDWARE_INFO_SINGLETONS:
            module = sys.modules.get(module_name)
            if module is not None and hasattr(module, attr):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, None)
        _clear_memoised_device_queries()
        try:
            yield device
        finally:
            _clear_memoised_device_queries()
            for module_name, attr in _HARDWARE_INFO_SINGLETONS:
                module = sys.modules.get(module_name)
                if module is not None and hasattr(module, attr):
                    setattr(module, attr, None)  # modules first imported inside the block
            for module, attr, value in saved:
                setattr(module, attr, value)
