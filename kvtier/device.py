"""Host values onto a device without waiting for it.

A CUDA copy from pageable host memory (`torch.tensor(..., device=cuda)`, `cpu_tensor.to(cuda)`)
synchronizes the stream first: it waits for every kernel queued before it, which stalls overlap
scheduling (engine/engine.py plans step n + 1 while step n runs) wherever it happens between
steps. These go through pinned memory instead (torch's caching host allocator keeps the block
until the copy has run), asynchronously.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row values as a tensor on `device`, without waiting for the device."""
    return tensor_to(torch.tensor(values, dtype=dtype), device)


def tensor_to(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`, without waiting for it where `t` is on the CPU and `device` a GPU (other
    moves as `t.to(device)`)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
