"""PagePool: the tensors of every layer's K/V pages on one device.

The pool owns storage (through its KVFormat); it does not know which
sequence owns a page: that bookkeeping is kv/manager.py, torch-free.

Per layer, every tensor of the format's layout has a leading page axis:
`[num_pages, kv_heads, page_size, ...]`, so moving pages between pools is
format-agnostic: gather -> copy -> scatter per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.kernels import cpu_ops, fused, kv_quant, kv_transform
from kvtier.kv.formats import KVFormat
from kvtier.kv.sinks import SinkSlots
from kvtier.kv.transfer import PageTransfers

# K smoothing: a channel's scale is at least this fraction of its head's median spread.
SPREAD_FLOOR = 0.1
# ... and at least this (fp16-safe; all-equal first rows give a uniform scale).
MIN_CHANNEL_SCALE = 1e-2
# channel_scale = spread ** SPREAD_POWER: 1 equalises the channels fully, 0 turns the scaling off;
# 0.5 measured best across SmolLM2 and Qwen2.5 (int4 KL 0.041 / 0.037 vs 0.062 / 0.048 at 1.0).
SPREAD_POWER = 0.5
# Sink rows (quantized formats): one exact row slot per this many pages (at least MIN_SINK_SLOTS).
SINK_SLOT_RATIO = 16
MIN_SINK_SLOTS = 16


def kv_bytes_per_token(fmt: KVFormat, kv_heads: int, head_dim: int, page_size: int,
                       compute_dtype: torch.dtype) -> float:
    """Bytes one token of one layer costs a pool: its page share plus its share of the sink slots
    (one unquantized K+V row per SINK_SLOT_RATIO pages; quantized formats only)."""
    page = fmt.bytes_per_token(kv_heads, head_dim)
    if not fmt.quantized:
        return page
    row = 2 * kv_heads * head_dim * torch.empty((), dtype=compute_dtype).element_size()
    return page + row / (SINK_SLOT_RATIO * page_size)


class PagePool:
    """K/V page storage of all layers on one device (GPU, or pinned host memory)."""

    def __init__(self, fmt: KVFormat, num_layers: int, num_pages: int, kv_heads: int,
                 page_size: int, head_dim: int, device: torch.device | str,
                 compute_dtype: torch.dtype = torch.float32, pin: bool = False):
        for name, val in (("num_layers", num_layers), ("num_pages", num_pages), ("kv_heads", kv_heads),
                          ("page_size", page_size), ("head_dim", head_dim)):
            if val < 1:
                raise ValueError(f"PagePool {name} must be >= 1, got {val}")
        self.fmt = fmt
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.kv_heads = kv_heads
        self.page_size = page_size
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        # One tensor per layout name holds every layer ([L, P, ...]) so page copies move all
        # layers in one gather/copy/scatter; layers[i][name] is its contiguous view [P, ...].
        flat = fmt.allocate(num_pages * num_layers, kv_heads, page_size, head_dim, self.device, pin)
        self.storage = {name: t.view(num_layers, num_pages, *t.shape[1:]) for name, t in flat.items()}
        self.layers = [{name: t[i] for name, t in self.storage.items()} for i in range(num_layers)]
        # K smoothing (formats with smooth_k), per layer, fixed at the layer's first write:
        # K is stored as (k - k_shift) / k_channel_scale, both [kv_heads, head_dim].
        self.k_shift: list[torch.Tensor | None] = [None] * num_layers
        self.k_channel_scale: list[torch.Tensor | None] = [None] * num_layers
        # rows stored as they are (plain_pages): fixed by the format
        self._plain_format = not (fmt.quantized or fmt.smooth_k or fmt.rotate_k or fmt.rotate_v)
        # Sink rows (quantized formats only): exact position-0 rows beside their quantized pages,
        # one slot per SINK_SLOT_RATIO pages (kv/sinks.py)
        count = max(MIN_SINK_SLOTS, -(-num_pages // SINK_SLOT_RATIO)) if fmt.quantized else 0
        self.sinks = SinkSlots(num_layers, num_pages, kv_heads, head_dim, count, compute_dtype, self.device,
                               pin and self.device.type == "cpu" and torch.cuda.is_available())
        self.transfers = PageTransfers(self)  # page copies out of this pool (kv/transfer.py)

    @property
    def sink_slots(self) -> int:
        """Slots of exact position-0 rows (0: a format without them)."""
        return self.sinks.count

    @property
    def sink_k(self) -> torch.Tensor:
        """[L, sink_slots, Hkv, D] exact position-0 K rows (SinkSlots.k)."""
        return self.sinks.k

    @property
    def sink_v(self) -> torch.Tensor:
        """[L, sink_slots, Hkv, D] exact position-0 V rows (SinkSlots.v)."""
        return self.sinks.v

    @property
    def sink_slot(self) -> torch.Tensor:
        """[num_pages] int64 page -> sink slot, -1 for none (SinkSlots.slot)."""
        return self.sinks.slot

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              sink: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """slots: [T] int64 (page * page_size + offset); k, v: [T, kv_heads, head_dim].

        sink: (rows, sink slots) from `assign_sinks`: rows of k/v at sequence position 0, also
        kept exactly in those slots.

        With a smoothing format, K is stored as (k - shift) / channel_scale: shift
        is the per-channel median of the calibration rows (`calibrate`), channel_scale the
        per-channel spread around it (floored, see `calibrate`); both are fixed
        from then on. `read` multiplies the scale back but not the shift: every
        page of this pool (and every page copied from it) shares the shift, and
        attention over them is exact (softmax is shift-invariant per query).
        """
        if self.fmt.smooth_k and k.shape[0] > 0 and self.k_shift[layer] is None:
            self.calibrate(layer, k)  # not calibrated in advance (engine/calibrate.py)
        if sink is not None and self.sink_slots:  # kept in the stored (rotated) domain, unquantized
            rows, sslots = sink
            ks, vs = self._stored_domain(layer, k.index_select(0, rows), v.index_select(0, rows))
            self.sink_k[layer].index_copy_(0, sslots, ks.to(self.compute_dtype))
            self.sink_v[layer].index_copy_(0, sslots, vs.to(self.compute_dtype))
        if slots.is_cuda and self._fused_store(layer, slots, k, v):
            return
        plain = self.plain_pages(layer)
        if plain is not None and (ops := cpu_ops.usable(slots, k, v, plain[0])) is not None:
            ops.kv_store(plain[0], plain[1], slots, k, v)  # one call for K and V (kernels/cpu_ops.py)
            return
        k = self._smoothed(layer, k)
        self._store(self.layers[layer], slots, k, v)

    def plain_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V) pages [P, kv_heads, page_size, head_dim] of one layer when they hold the rows as
        they are (a plain format: no quantization, smoothing, rotation or sink rows), for kernels
        that read or write them in place; else None."""
        if not self._plain_format or self.k_channel_scale[layer] is not None:
            return None
        st = self.layers[layer]
        return st["k"], st["v"]

    def _smoothed(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """k [T, H, D] -> (k - shift) / channel_scale in fp32 (formats without smoothing: k)."""
        if self.fmt.smooth_k:
            kf = k.to(torch.promote_types(k.dtype, torch.float32))
            k = kf - self.k_shift[layer].to(kf.dtype)
        if self.k_channel_scale[layer] is not None:
            k = k / self.k_channel_scale[layer].to(k.dtype)
        return k

    def _stored_domain(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows as the format encodes them: smoothed K, then rotated K / V (rotating formats)."""
        k = self._smoothed(layer, k)
        return (self.fmt.rotate(k) if self.fmt.rotate_k else k), (self.fmt.rotate(v) if self.fmt.rotate_v else v)

    def _fused_store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """On CUDA: smooth + rotate + encode + scatter of K and V in one launch (kernels/kv_transform.py;
        plain formats: the cast and scatter of both); False where it does not apply (head dims
        other than a power of two >= 16: the store kernels of kv_quant, else the reference)."""
        if not kv_transform.transform_supported(k):
            return False
        ok, smooth = self._kernel_smoothing(layer)
        if ok:
            kv_transform.transform_store(self.fmt, self.layers[layer], slots, k, v, smooth)
        return ok

    def _kernel_smoothing(self, layer: int) -> tuple[bool, tuple[torch.Tensor, torch.Tensor] | None]:
        """(whether the store kernels can write this layer, its K smoothing (shift, channel_scale)
        or None): not before a smoothing format's layer is calibrated (`write` calibrates)."""
        if not (self.fmt.smooth_k or self.k_channel_scale[layer] is not None):
            return True, None
        shift, scale = self.k_shift[layer], self.k_channel_scale[layer]
        if shift is None or scale is None:
            return False, None
        return True, (shift, scale)

    def rope_store(self, layer: int, slots: torch.Tensor, qkv: torch.Tensor,
                   rope: fused.QKRope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A step's qkv rows [T, (Hq + 2 Hkv) * D] -> q, k (per-head norm + rotary, as
        `fused.qk_norm_rope`), v, with K / V written at slots as `write` writes them, in one launch
        (kernels/kv_transform.py rope_store); None (nothing done) where that kernel does not apply:
        not CUDA, a head dim other than a power of two >= 16, an uncalibrated smoothing layer. The
        caller keeps rows at sequence position 0 (sink rows) away from it."""
        if not slots.is_cuda or rope.head_dim != self.head_dim or not kv_transform.head_dim_supported(self.head_dim):
            return None
        ok, smooth = self._kernel_smoothing(layer)
        if not ok:
            return None
        return kv_transform.rope_store(self.fmt, self.layers[layer], slots, qkv, rope, smooth)

    def _store(self, st: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """KVFormat.store: rotate (rotating formats), then the store kernel on CUDA, else the codecs."""
        fmt = self.fmt
        if fmt.rotate_k:
            k = fmt.rotate(k)
        if fmt.rotate_v:
            v = fmt.rotate(v)
        if slots.is_cuda and kv_quant.store_rows(fmt, st, slots, k, v):
            return
        fmt.store_codes(st, slots, k, v)

    def _load_codes(self, st: dict[str, torch.Tensor], rows: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """KVFormat.load_codes through the load kernels on CUDA where a codec has one."""
        if rows.is_cuda:
            got = kv_quant.load_pages(self.fmt, st, rows, dtype)
            if got is not None:
                return got
        return self.fmt.load_codes(st, rows, dtype)

    def kernel_sink(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(sink_k, sink_v, sink_slot) of one layer, as the paged kernels take them; None for
        formats without sink rows."""
        return (self.sink_k[layer], self.sink_v[layer], self.sink_slot) if self.sink_slots else None

    def kernel_native(self, layer: int, head_dim: int):
        """The stored-domain moves the decode kernels fold in for one layer (NativeDomain: K
        smoothing, q and output rotations), or None when the kernels cannot fold them at this
        head_dim (then q goes through native_q and the output through native_out)."""
        from kvtier.kernels.paged_attention import NativeDomain, fold_native_supported
        if not fold_native_supported(head_dim):
            return None
        return NativeDomain(self.k_channel_scale[layer], self.fmt.rotate_k, self.fmt.rotate_v)

    def kernel_alts(self, pool: "PagePool") -> list | None:
        """This pool's layers as the paged kernels' second page source for `pool`'s (AltPages, one a
        layer: a negative id -1 - h names page h here), or None when the kernels cannot read it in
        place: it must be pinned host memory beside a CUDA pool of the same format and geometry,
        at a whole number of rows from it (kernels/paged_attention.py alt_offsets). Fixed for the
        pools' lifetime: callers keep the list."""
        from kvtier.kernels.paged_attention import HAVE_TRITON, AltPages, alt_offsets
        if not HAVE_TRITON or pool.device.type != "cuda" or self.device.type != "cpu" \
                or not self.compatible_with(pool):
            return None
        if not all(t.is_pinned() for t in self.storage.values()) or (self.sink_slots and not self.sink_slot.is_pinned()):
            return None
        alts = [AltPages(self.layers[layer], self.kernel_sink(layer)) for layer in range(self.num_layers)]
        try:
            for layer, alt in enumerate(alts):
                alt_offsets(pool.layers[layer], pool.kernel_sink(layer), alt)
        except ValueError:
            return None
        return alts

    def assign_sinks(self, pages: Sequence[int]) -> torch.Tensor | None:
        """Sink slots for pages whose row 0 is about to be written at sequence position 0
        (SinkSlots.assign): [n] int64 on this device, None for formats without sink rows."""
        return self.sinks.assign(pages)

    def clear_sinks(self, pages: Sequence[int]) -> None:
        """Pages whose row 0 is no longer a position-0 row kept exactly (copy_to targets)."""
        self.sinks.clear(pages)

    def sink_pages(self) -> set[int]:
        """Pages whose position-0 row is kept exactly now."""
        return self.sinks.pages()

    def _apply_sinks(self, pool: PagePool, layer: int, k: torch.Tensor, v: torch.Tensor,
                     page_ids: torch.Tensor, starts: torch.Tensor | None) -> None:
        """Row 0 of the pages at `starts` (indices into page_ids) <- `pool`'s exact sink rows.

        k, v: decoded [P, H, S, D] on this device; page_ids are `pool`'s page ids.
        """
        if starts is None or not pool.sink_slots or starts.numel() == 0:
            return
        sel = page_ids.index_select(0, starts.to(page_ids.device))
        sidx = pool.sink_slot.index_select(0, sel.to(pool.device))  # [n], -1: no sink row
        ok = (sidx >= 0).to(self.device, non_blocking=True)[:, None, None]
        sidx = sidx.clamp_min(0)
        if pool is not self and pool.transfers.kernel_copy(self):  # pinned host rows, gathered by the GPU
            from kvtier.kernels import page_copy
            rows = torch.arange(sidx.numel(), device=self.device)
            sk, sv = (torch.empty((1, sidx.numel(), *t.shape[2:]), dtype=t.dtype, device=self.device)
                      for t in (pool.sink_k, pool.sink_v))
            page_copy.copy_pages(pool.sink_k[layer:layer + 1], sk, sidx, rows)
            page_copy.copy_pages(pool.sink_v[layer:layer + 1], sv, sidx, rows)
            sk, sv = sk[0], sv[0]
        else:
            sk = pool.sink_k[layer].index_select(0, sidx).to(self.device, non_blocking=True)
            sv = pool.sink_v[layer].index_select(0, sidx).to(self.device, non_blocking=True)
        st = starts.to(self.device)
        k[st, :, 0] = torch.where(ok, sk.to(k.dtype), k[st, :, 0])
        v[st, :, 0] = torch.where(ok, sv.to(v.dtype), v[st, :, 0])

    def calibrate(self, layer: int, k: torch.Tensor) -> None:
        """K smoothing constants of one layer from K rows k: [T, H, D], fixed from then on.

        The engine calls it for every layer before serving (engine/calibrate.py: a fixed text,
        so the codes do not depend on which request came first); a pool nobody calibrated
        takes each layer's first write.

        The scale is floored at a tenth of the head's median spread (a few rows
        give noisy spreads; the floor bounds how much any channel is amplified)
        and at MIN_CHANNEL_SCALE (all-equal rows: a uniform, harmless scale).
        """
        k = k.to(torch.promote_types(k.dtype, torch.float32))
        shift = k.median(dim=0).values  # [H, D]
        spread = (k - shift).std(dim=0, unbiased=False)  # [H, D]
        floor = (spread.median(dim=-1, keepdim=True).values * SPREAD_FLOOR).clamp_min(MIN_CHANNEL_SCALE)
        self.k_shift[layer] = shift.to(self.compute_dtype)
        self.k_channel_scale[layer] = torch.maximum(spread, floor).pow(SPREAD_POWER).to(self.compute_dtype)

    @property
    def rotated(self) -> bool:
        """Whether pages hold K/V in a transformed domain that attention can work in directly."""
        return self.fmt.rotate_k or self.fmt.rotate_v

    def read(self, layer: int, page_ids: torch.Tensor, starts: torch.Tensor | None = None,
             native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """page_ids: [P] -> k, v: [P, kv_heads, page_size, head_dim] in compute_dtype.

        K comes back minus `k_shift[layer]` (smoothing formats). starts: indices into
        page_ids of pages that begin a sequence: their row 0 comes from the sink slots.
        native: K and V as stored, i.e. R((k - shift) / channel_scale) and R v (rotating
        formats), for attention that moves q and its output instead (`native_q`,
        `native_out`): one small matmul per query row instead of one per cached row.
        """
        return self._decode(self, layer, self.layers[layer], page_ids, page_ids, starts, native)

    def read_from(self, src: PagePool, layer: int, page_ids: torch.Tensor, starts: torch.Tensor | None = None,
                  native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages of `src` (a lower tier holding copies of this pool's pages), decoded here.

        page_ids: [P] page ids of `src` -> k, v: [P, kv_heads, page_size, head_dim] on this
        pool's device: the stored codes are gathered, moved (quantized bytes cross the bus,
        not decoded values) and decoded with this pool's K smoothing, which wrote them.
        starts / native: as for `read` (sink rows come from `src`).
        """
        if not self.compatible_with(src):
            raise ValueError("read_from a pool of different format or page geometry")
        idx = page_ids.to(src.device)
        if src.transfers.kernel_copy(self):  # the GPU gathers the pinned host pages itself
            from kvtier.kernels import page_copy
            rows = torch.arange(idx.numel(), device=self.device)
            staged = {}
            for name, t in src.storage.items():
                staged[name] = torch.empty((1, idx.numel(), *t.shape[2:]), dtype=t.dtype, device=self.device)
                page_copy.copy_pages(t[layer:layer + 1], staged[name], idx, rows)
                staged[name] = staged[name][0]
        else:
            staged = {name: t.index_select(0, idx).to(self.device, non_blocking=True)
                      for name, t in src.layers[layer].items()}
        return self._decode(src, layer, staged, torch.arange(idx.numel(), device=self.device), idx, starts, native)

    def _decode(self, pool: PagePool, layer: int, st: dict[str, torch.Tensor], rows: torch.Tensor,
                page_ids: torch.Tensor, starts: torch.Tensor | None,
                native: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages `rows` of storage `st` (pages `page_ids` of `pool`, whose sink rows apply)."""
        fmt = self.fmt
        back = not native and self.rotated  # rotate back here: decode in fp32 first
        k, v = self._load_codes(st, rows, torch.float32 if back else self.compute_dtype)
        self._apply_sinks(pool, layer, k, v, page_ids, starts)
        if native:
            return k, v
        if fmt.rotate_k:
            k = fmt.rotate(k)
        if fmt.rotate_v:
            v = fmt.rotate(v)
        scale = self.k_channel_scale[layer]
        if scale is not None:
            k = k * scale[:, None, :]  # [P, H, S, D] * [H, 1, D]
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def native_q(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D] -> R (channel_scale * q), so that native_q . native k == q . (k - shift)."""
        scale = self.k_channel_scale[layer]
        if scale is None and not self.fmt.rotate_k:
            return q
        if q.is_cuda and kv_transform.transform_supported(q):  # one kernel
            return kv_transform.transform_rows(q, self.fmt.rotate_k, scale)
        qf = q.float()
        if scale is not None:  # [Hkv, D]: query head h reads kv head h // (Hq / Hkv)
            qf = (qf.unflatten(1, (self.kv_heads, -1)) * scale.float()[:, None, :]).flatten(1, 2)
        return (self.fmt.rotate(qf) if self.fmt.rotate_k else qf).to(q.dtype)

    def native_out(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output over native V -> over V (o: [..., D])."""
        if not self.fmt.rotate_v:
            return o
        if o.is_cuda and o.dim() == 3 and kv_transform.transform_supported(o):
            return kv_transform.transform_rows(o, True)
        return self.fmt.rotate(o).to(o.dtype)

    def bytes_per_page(self) -> int:
        """Bytes one page takes across all layers (K, V and scales)."""
        return int(self.fmt.bytes_per_token(self.kv_heads, self.head_dim)) * self.page_size * self.num_layers

    def bytes_total(self) -> int:
        """Bytes of the page storage (the sink slots are `sink_bytes`)."""
        return sum(t.numel() * t.element_size() for st in self.layers for t in st.values())

    def sink_bytes(self) -> int:
        return 2 * self.sink_k.numel() * self.sink_k.element_size()

    def check_integrity(self) -> None:
        """Raise ValueError if any stored tensor disagrees with the format's layout."""
        want = self.fmt.layout(self.kv_heads, self.page_size, self.head_dim)
        if len(self.layers) != self.num_layers or set(self.storage) != set(want):
            raise ValueError(f"pool has {len(self.layers)} layers, expected {self.num_layers}")
        for i, st in enumerate(self.layers):
            if set(st) != set(want):
                raise ValueError(f"layer {i} tensors {sorted(st)} != format layout {sorted(want)}")
            for name, (shape, dtype) in want.items():
                t = st[name]
                if tuple(t.shape) != (self.num_pages, *shape) or t.dtype != dtype or t.device != self.device:
                    raise ValueError(f"layer {i} {name}: {tuple(t.shape)} {t.dtype} on {t.device}, expected "
                                     f"{(self.num_pages, *shape)} {dtype} on {self.device}")
                if t.data_ptr() != self.storage[name][i].data_ptr() or not t.is_contiguous():
                    raise ValueError(f"layer {i} {name} is not the contiguous view of the pool storage")
        if self.bytes_total() != self.bytes_per_page() * self.num_pages:
            raise ValueError("bytes_total disagrees with bytes_per_page * num_pages")
        self.sinks.check()

    def compatible_with(self, other: PagePool) -> bool:
        return (self.fmt.name == other.fmt.name and self.num_layers == other.num_layers
                and self.kv_heads == other.kv_heads and self.page_size == other.page_size
                and self.head_dim == other.head_dim)

    def copy_to(self, dst: PagePool, src_ids: Sequence[int] | torch.Tensor,
                dst_ids: Sequence[int] | torch.Tensor) -> None:
        """Copy pages `src_ids` of this pool into pages `dst_ids` of `dst`, batched, sink rows with
        them (kv/transfer.py PageTransfers.copy: the streams, the paths, the checks)."""
        self.transfers.copy(dst, src_ids, dst_ids)

    def sync(self) -> None:
        """Wait until every page copy out of this pool has landed (e.g. before the CPU reads host pages)."""
        self.transfers.sync()

    def transfer_stats(self) -> dict[str, float]:
        """Bytes, seconds and GB/s of the page copies out of this pool (`copy_to`)."""
        return self.transfers.stats()
