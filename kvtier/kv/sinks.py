"""SinkSlots: the exact position-0 rows of a quantized pool's pages (kv/pool.py PagePool.sinks).

The K/V row at sequence position 0 (offset 0 of a sequence's first page) draws much of every
layer's attention, and its quantization error dominated the measured KL (fp8 3.4e-3 -> 2.5e-3 with
it exact; docs/benchmarks.md). The pool stores it quantized in its page as usual and, in one of
`count` slots, exactly (compute dtype, K minus the pool's shift, unscaled); readers say which pages
begin a sequence and take that row from the slot.

    k, v   [L, count, Hkv, D]  the rows, per layer
    slot   [num_pages] int64   page -> its slot, -1 for none (on the pool's device, pinned with a
                               pinned pool: the GPU kernels read a host pool's table in place)

A page keeps its slot; a new one takes a free slot, else the oldest assignment's (that page falls
back to its quantized row 0: approximate, not wrong). Slots follow their pages through page copies
(`moves`, used by kv/transfer.py). Formats without sink rows have count 0.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch


class SinkSlots:
    """`count` exact rows and the page -> slot table of one pool (module docstring)."""

    def __init__(self, num_layers: int, num_pages: int, kv_heads: int, head_dim: int, count: int,
                 dtype: torch.dtype, device: torch.device, pin: bool):
        self.count = count
        shape = (num_layers, count, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        self.slot = torch.full((num_pages,), -1, dtype=torch.long, device=device, pin_memory=pin)
        self._of_page: OrderedDict[int, int] = OrderedDict()  # host mirror, oldest assignment first
        self._free = list(range(count - 1, -1, -1))

    def pages(self) -> set[int]:
        """Pages that hold a sink row now."""
        return set(self._of_page)

    def assign(self, pages: Sequence[int]) -> torch.Tensor | None:
        """Slots for pages whose row 0 is about to be written at sequence position 0.

        -> [n] int64 slots on the pool's device (None without slots). A page keeps its slot; else
        a free one, else the oldest assignment's (that page loses its sink row).
        """
        if not self.count or not pages:
            return None
        out, changed = [], {}
        for p in pages:
            s = self._of_page.pop(p, None)
            if s is None:
                if self._free:
                    s = self._free.pop()
                else:
                    old, s = self._of_page.popitem(last=False)
                    changed[old] = -1
            self._of_page[p] = s  # (re)inserted last: the newest assignment
            changed[p] = s
            out.append(s)
        self._set(changed)
        return torch.tensor(out, dtype=torch.long).to(self.slot.device, non_blocking=True)

    def clear(self, pages: Sequence[int]) -> None:
        """Pages whose row 0 is no longer a position-0 row kept exactly (page-copy targets)."""
        changed = {}
        for p in pages:
            s = self._of_page.pop(p, None)
            if s is not None:
                self._free.append(s)
                changed[p] = -1
        self._set(changed)

    def moves(self, dst: "SinkSlots", src_idx: torch.Tensor,
              dst_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Slots that follow pages copied from these pages `src_idx` to `dst`'s `dst_idx`:
        (source slots, destination slots), or None. Destination pages whose source has no sink row
        lose theirs."""
        if not dst.count:
            return None
        have = [(d, self._of_page[s]) for s, d in zip(src_idx.tolist(), dst_idx.tolist()) if s in self._of_page]
        with_sink = {d for d, _ in have}
        dst.clear([d for d in dst_idx.tolist() if d not in with_sink])
        if not have:
            return None
        d_slots = dst.assign([d for d, _ in have])
        return torch.tensor([s for _, s in have], dtype=torch.long), d_slots

    def check(self) -> None:
        """Raise ValueError unless each slot is assigned to one page or free, and `slot` agrees."""
        want = torch.full((self.slot.numel(),), -1, dtype=torch.long)
        for page, slot in self._of_page.items():
            want[page] = slot
        if sorted([*self._of_page.values(), *self._free]) != list(range(self.count)):
            raise ValueError("sink slots are not each either assigned to one page or free")
        if not torch.equal(self.slot.cpu(), want):
            raise ValueError("sink_slot disagrees with the sink assignments")

    def _set(self, changed: dict[int, int]) -> None:
        if changed:
            pages = torch.tensor(list(changed), dtype=torch.long)
            slots = torch.tensor(list(changed.values()), dtype=torch.long)
            self.slot.index_copy_(0, pages.to(self.slot.device), slots.to(self.slot.device))
