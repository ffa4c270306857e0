"""PageTransfers: page copies out of one PagePool (kv/pool.py) into another, and their accounting.

Pools of one format and page geometry (a GPU pool and its pinned host tier, or two pools of one
device) move whole pages: every layer's tensors of the format's layout, and the sink rows that
follow their pages (kv/sinks.py `SinkSlots.moves`). Two paths:

    GPU <-> pinned host (or within one GPU):  the page-copy kernel (kernels/page_copy.py), one
        launch per layout tensor for all layers, the GPU reading or writing the host pages in place;
    otherwise:  per layer and tensor, gather [n, H, S, ...] -> copy -> scatter.

With a CUDA side the copies run on a stream of their own that first waits for the current stream;
the current stream then waits for them, so the next forward sees the pages. Nothing waits on the
host except the staged GPU -> host path (its host scatter needs the bytes); `sync` waits for all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.device import tensor_to

if TYPE_CHECKING:
    from kvtier.kv.pool import PagePool


class PageTransfers:
    """Copies out of `pool` (the source), timed: CUDA copies by events read once they completed."""

    def __init__(self, pool: "PagePool"):
        self.pool = pool
        self._stream: torch.cuda.Stream | None = None
        # Page-copy accounting, this pool as the source (GPU pool: swap-out; host pool: swap-in).
        self.copy_bytes = 0
        self.copy_seconds = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA-timed copies

    def copy(self, dst: "PagePool", src_ids: Sequence[int] | torch.Tensor,
             dst_ids: Sequence[int] | torch.Tensor) -> None:
        """Copy pages `src_ids` of the pool into pages `dst_ids` of `dst`, batched (module
        docstring): never per-page copies. `dst_ids` must be distinct."""
        src = self.pool
        src_idx, dst_idx = self._check(dst, src_ids, dst_ids)
        if src_idx.numel() == 0:
            return
        self.copy_bytes += src.bytes_per_page() * src_idx.numel()
        cuda_dev = next((p.device for p in (src, dst) if p.device.type == "cuda"), None)
        if cuda_dev is None:
            t0 = time.perf_counter()
            self._copy_layers(dst, src_idx, dst_idx, non_blocking=False)
            self.copy_seconds += time.perf_counter() - t0
            return
        stream = self._side_stream(cuda_dev)
        stream.wait_stream(torch.cuda.current_stream(cuda_dev))
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self._copy_layers(dst, src_idx, dst_idx, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
        torch.cuda.current_stream(cuda_dev).wait_event(done)
        self._pending.append((start, done))  # timed when done: no sync here

    def sync(self) -> None:
        """Wait until every page copy out of the pool has landed (e.g. before the CPU reads host pages)."""
        if self._stream is not None:
            self._stream.synchronize()

    def stats(self) -> dict[str, float]:
        """Bytes, seconds and GB/s of the copies so far. CUDA copies count their seconds once
        completed (never waited for here), so very recent copies may count only their bytes."""
        still: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for start, done in self._pending:
            if done.query():
                self.copy_seconds += start.elapsed_time(done) / 1e3
            else:
                still.append((start, done))
        self._pending = still
        t = self.copy_seconds
        return {"copy_bytes": self.copy_bytes, "copy_seconds": t,
                "copy_gbps": self.copy_bytes / t / 1e9 if t > 0 else 0.0}

    def _copy_layers(self, dst: "PagePool", src_idx: torch.Tensor, dst_idx: torch.Tensor,
                     non_blocking: bool) -> None:
        """Between a GPU and pinned host memory: the page-copy kernel, one launch per layout
        tensor for all layers, the GPU reading (or writing) the host pages directly (2,048
        scattered 1 KiB pages: 48 GB/s against 18-20 for the staged path below).

        Otherwise per layer and layout tensor: gather [n, H, S, ...] -> copy -> scatter
        (per layer, not one [L, n, ...] gather of the whole storage: on the host side a
        page-axis gather inside one contiguous layer measured ~4x faster).
        """
        src = self.pool
        s_idx, d_idx = tensor_to(src_idx, src.device), tensor_to(dst_idx, dst.device)  # no wait for the GPU
        to_host = dst.device.type == "cpu" and src.device.type == "cuda"
        from_host = src.device.type == "cpu" and dst.device.type == "cuda"
        staged_host: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = []

        def move(src_t: torch.Tensor, dst_t: torch.Tensor, dim: int, si: torch.Tensor, di: torch.Tensor) -> None:
            shape = (*src_t.shape[:dim], si.numel(), *src_t.shape[dim + 1:])
            staged = torch.empty(shape, dtype=src_t.dtype, device=src.device, pin_memory=from_host)
            torch.index_select(src_t, dim, si, out=staged)
            if to_host:  # device->host lands in pinned memory, else the copy is synchronous
                moved = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
                moved.copy_(staged, non_blocking=True)
                staged_host.append((dst_t, dim, di, moved))
            else:
                dst_t.index_copy_(dim, di, staged.to(dst.device, non_blocking=non_blocking))

        sinks = src.sinks.moves(dst.sinks, src_idx, dst_idx)
        if self.kernel_copy(dst):  # one launch per tensor for all layers, host side zero-copy
            from kvtier.kernels import page_copy
            for name, src_t in src.storage.items():
                page_copy.copy_pages(src_t, dst.storage[name], s_idx, d_idx)
            if sinks is not None:  # [L, slots, H, D]: slots play the page axis
                for a, b in ((src.sink_k, dst.sink_k), (src.sink_v, dst.sink_v)):
                    page_copy.copy_pages(a, b, sinks[0], sinks[1])
            return  # no host sync: the host pages are read only by later GPU work, stream-ordered
        for src_st, dst_st in zip(src.layers, dst.layers):
            for name, src_t in src_st.items():
                move(src_t, dst_st[name], 0, s_idx, d_idx)  # [n, H, S, ...] per layer
        if sinks is not None:  # [L, n, H, D]: all layers' sink rows in one gather
            s_slots, d_slots = sinks
            for a, b in ((src.sink_k, dst.sink_k), (src.sink_v, dst.sink_v)):
                move(a, b, 1, tensor_to(s_slots, src.device), tensor_to(d_slots, dst.device))
        if to_host:  # the host scatter must wait for the device->host copies
            torch.cuda.current_stream(src.device).synchronize()
            for t, dim, di, moved in staged_host:
                t.index_copy_(dim, di, moved)

    def kernel_copy(self, dst: "PagePool") -> bool:
        """Whether copies to `dst` go through the Triton page-copy kernel (kernels/page_copy.py):
        a CUDA pool on one side and pinned host memory (or the same GPU) on the other."""
        src = self.pool
        if "cuda" not in (src.device.type, dst.device.type):
            return False
        from kvtier.kernels import page_copy
        return all(page_copy.available(t, dst.storage[name]) for name, t in src.storage.items())

    def _check(self, dst: "PagePool", src_ids: Sequence[int] | torch.Tensor,
               dst_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src = self.pool
        if not src.compatible_with(dst):
            raise ValueError("copy_to between pools of different format or page geometry")
        src_idx = torch.as_tensor(src_ids, dtype=torch.long).cpu().reshape(-1)
        dst_idx = torch.as_tensor(dst_ids, dtype=torch.long).cpu().reshape(-1)
        if src_idx.numel() != dst_idx.numel():
            raise ValueError(f"copy_to: {src_idx.numel()} source pages but {dst_idx.numel()} destinations")
        if src_idx.numel() == 0:
            return src_idx, dst_idx
        if int(src_idx.min()) < 0 or int(src_idx.max()) >= src.num_pages:
            raise ValueError(f"copy_to: source page ids out of range [0, {src.num_pages})")
        if int(dst_idx.min()) < 0 or int(dst_idx.max()) >= dst.num_pages:
            raise ValueError(f"copy_to: destination page ids out of range [0, {dst.num_pages})")
        if dst is src and bool((src_idx[:, None] == dst_idx[None, :]).any()):
            raise ValueError("copy_to within one pool: source and destination pages overlap")
        if torch.unique(dst_idx).numel() != dst_idx.numel():
            raise ValueError("copy_to: destination page ids must be distinct")
        return src_idx, dst_idx

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream
