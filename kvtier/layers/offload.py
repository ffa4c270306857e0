"""Decoder layers whose weights live in host RAM and cross the bus every step (a model larger than
the GPU's memory limit, as llama.cpp's partial `-ngl` offload, but computed on the GPU).

`LayerOffload.take(i, layer)` moves a built layer's large tensors (its matmul weights in whatever
packing they have; norms and biases under MIN_STREAM_BYTES stay) into one flat host buffer per
layer (pinned on CUDA), at 256-byte aligned offsets. `finish()` allocates ONE staging buffer on the
device, the size of the largest streamed layer, and points every streamed layer's tensors at views
of it with the same offsets. `before(i)`, called by Decoder.forward before layer i runs, copies that
layer's host buffer into the staging buffer on the current stream: stream order puts the copy after
the previous streamed layer's kernels and before this layer's, so one buffer serves all, and the
addresses never change (CUDA graphs capture the copies with the kernels).

The copy is not overlapped with compute: a streamed layer costs its bytes over the bus (~50 GB/s
on PCIe 5) on top of its compute, which for a 4-bit model is the larger part anyway. What the
memory plan counts (engine/plan.py): resident layers + one staging layer on the GPU, the streamed
layers' bytes in host RAM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Tensors smaller than this stay on the device (norm weights, biases): not worth a copy each.
MIN_STREAM_BYTES = 1 << 16
# Byte alignment of each tensor in the flat buffers (any dtype's view, and aligned device copies).
ALIGN = 256


@dataclass
class _Slot:
    module: torch.nn.Module
    name: str
    is_param: bool
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _view(flat: torch.Tensor, s: _Slot) -> torch.Tensor:
    return flat[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)


def _bind(s: _Slot, t: torch.Tensor) -> None:
    if s.is_param:
        s.module._parameters[s.name] = torch.nn.Parameter(t, requires_grad=False)
    else:
        s.module._buffers[s.name] = t


class LayerOffload:
    """Streamed layers' weights: host buffers, one device staging buffer (module doc)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.host: dict[int, torch.Tensor] = {}  # layer index -> flat uint8 host buffer
        self.slots: dict[int, list[_Slot]] = {}
        self.staging: torch.Tensor | None = None

    def take(self, index: int, layer: torch.nn.Module) -> None:
        """Move layer `index`'s large tensors to host RAM (the module holds the host copies until
        `finish`). Frees their device memory as the last reference goes."""
        if self.staging is not None:
            raise RuntimeError("LayerOffload.take after finish")
        entries, seen, size = [], set(), 0
        for mod in layer.modules():
            for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
                for name, t in table.items():
                    if t is None or t.numel() * t.element_size() < MIN_STREAM_BYTES:
                        continue
                    if t.data_ptr() in seen:
                        raise ValueError(f"LayerOffload: layer {index} shares a tensor between two modules")
                    seen.add(t.data_ptr())
                    size = -(-size // ALIGN) * ALIGN
                    entries.append((_Slot(mod, name, is_param, size, t.dtype, tuple(t.shape)), t))
                    size += t.numel() * t.element_size()
        flat = torch.empty(max(size, 1), dtype=torch.uint8, device="cpu",
                           pin_memory=self.device.type == "cuda")
        for s, t in entries:
            host = _view(flat, s)
            host.copy_(t)
            _bind(s, host)
        self.host[index] = flat
        self.slots[index] = [s for s, _ in entries]

    def finish(self) -> None:
        """Allocate the staging buffer and point every streamed layer at it."""
        if not self.host:
            return
        self.staging = torch.empty(max(f.numel() for f in self.host.values()), dtype=torch.uint8, device=self.device)
        for layout in self.slots.values():
            for s in layout:
                _bind(s, _view(self.staging, s))

    def before(self, index: int) -> None:
        """Bring layer `index`'s weights into the staging buffer (nothing for a resident layer)."""
        flat = self.host.get(index)
        if flat is not None:
            self.staging[:flat.numel()].copy_(flat, non_blocking=True)  # type: ignore[index]

    @property
    def layers(self) -> list[int]:
        return sorted(self.host)

    def host_bytes(self) -> int:
        """Host RAM the streamed layers hold (each step copies all of it to the device)."""
        return sum(f.numel() for f in self.host.values())
