"""PagePool: the tensors of every layer's K/V pages on one device.

The pool owns storage (through its KVFormat); it does not know which
sequence owns a page: that bookkeeping is kv/manager.py, torch-free.
"""

from __future__ import annotations

import torch

from kvtier.kv.formats import KVFormat


class PagePool:
    def __init__(self, fmt: KVFormat, num_layers: int, num_pages: int, kv_heads: int,
                 page_size: int, head_dim: int, device: torch.device | str,
                 compute_dtype: torch.dtype = torch.float32, pin: bool = False):
        self.fmt = fmt
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.kv_heads = kv_heads
        self.page_size = page_size
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.layers = [fmt.allocate(num_pages, kv_heads, page_size, head_dim, self.device, pin)
                       for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.fmt.store(self.layers[layer], slots, k, v)

    def read(self, layer: int, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fmt.load(self.layers[layer], page_ids, self.compute_dtype)

    def bytes_total(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.layers for t in st.values())
