"""What the Blackwell backends ask of their device: its SM count, which sizes their workspaces.

On the CPU (the backends' seam tests, and devtools' fake B200) a B200's count stands in.
"""

from __future__ import annotations

import torch

# NVIDIA B200 (SM 10.0): 148 SMs. devtools.fake_blackwell describes the whole device from this.
B200_SM_COUNT = 148


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; on the CPU the B200's (B200_SM_COUNT)."""
    if torch.device(device).type != "cuda":
        return B200_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count
