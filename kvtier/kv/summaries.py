"""PageSummaries: per-page key summaries for retrieval attention (layers/retrieval.py).

Per layer, per compute-pool page and per kv head the summaries hold, over the rows written into
the page so far:

    kmin, kmax  [L, P, Hkv, D] dtype  channel-wise min / max of the keys
    ksum        [L, P, Hkv, D] fp32   their sum (mean key = ksum / count: the baseline selector);
                                      kept only for the selectors that read it (config.SUM_SELECTORS;
                                      None otherwise: half the bytes)
    count       [L, P]         int32  rows written

dtype (`summary_dtype`): on CUDA with 16-bit keys, the keys' own dtype; else fp32. A min or max of
bf16 keys is one of those keys, so 16-bit kmin / kmax lose nothing. The sums stay fp32: in bf16
every add rounds, so a page's sum would depend on the order of the adds (atomics in the scatter
path, the kernel's fp32 add against a bf16 add), and two runs over the same keys would rank pages
differently. This matters on a small GPU: the host tier's summaries live on the GPU too; all in
fp32 a 256K Qwen3-8B context's took 7.2 GB (27.6 KB a token, half its k8v4 KV), now 4.8 GB.

Keys are raw, as the model produced them (what `backend.forward(layer, q, k, v, meta)` receives,
before any KV-format smoothing or rotation), so for every query q and key k of the page

    q . k  <=  sum_d max(q_d * kmin_d, q_d * kmax_d)       (the Quest bound)

holds exactly (min / max are exact copies of key values, in either dtype).

Updates come from the same `slot_mapping` the pool is written with, all torch scatter ops (no
Python loop over tokens), on the pool's device. A write of row 0 of a page resets that page's
summaries first: pages are reused, and every occupant writes its page from row 0.

Memory: ((2 * itemsize + 4) * kv_heads * head_dim + 4) bytes per page per layer, without the sums
(2 * itemsize * kv_heads * head_dim + 4) (page_size does not enter; `summary_bytes_per_token` for
the memory plan): Qwen2.5-1.5B (2 kv heads x 128) in fp32
3,076 B a page-layer against 16 KiB of bf16 K/V for a 16-token page (19%).

Pages moving between tiers take their summaries with them (`copy_rows`): a host tier has its own
PageSummaries, kept on the compute device (the selection scores host pages without touching them),
filled when pages are copied down and read back when they are copied up, so a page's summary is
always the one computed from the raw keys written into it, whichever tier it sits in. `refresh`
recomputes pages from their stored keys (pages whose summaries were never recorded).
"""

from __future__ import annotations

import torch


def summary_dtype(device: torch.device | str, key_dtype: torch.dtype) -> torch.dtype:
    """The summaries' dtype for keys of `key_dtype` on `device` (module docstring)."""
    if torch.device(device).type == "cuda" and key_dtype in (torch.bfloat16, torch.float16):
        return key_dtype
    return torch.float32


def summary_bytes_per_token(kv_heads: int, head_dim: int, page_size: int, num_layers: int,
                            dtype: torch.dtype, sums: bool = True) -> float:
    """Summary bytes per context token, all layers (the memory plan counts them on the GPU);
    sums: the key sums kept too."""
    item = torch.empty((), dtype=dtype).element_size()
    return num_layers * ((2 * item + 4 * sums) * kv_heads * head_dim + 4) / page_size


class PageSummaries:
    """Channel-wise key min / max / sum and row counts of every page of one pool (module docstring)."""

    def __init__(self, num_layers: int, num_pages: int, kv_heads: int, head_dim: int, page_size: int,
                 device: torch.device | str, dtype: torch.dtype = torch.float32, sums: bool = True):
        for name, val in (("num_layers", num_layers), ("num_pages", num_pages), ("kv_heads", kv_heads),
                          ("head_dim", head_dim), ("page_size", page_size)):
            if val < 1:
                raise ValueError(f"PageSummaries {name} must be >= 1, got {val}")
        self.num_layers, self.num_pages, self.kv_heads = num_layers, num_pages, kv_heads
        self.head_dim, self.page_size = head_dim, page_size
        self.device = torch.device(device)
        shape = (num_layers, num_pages, kv_heads, head_dim)
        self.kmin = torch.full(shape, float("inf"), dtype=dtype, device=self.device)
        self.kmax = torch.full(shape, float("-inf"), dtype=dtype, device=self.device)
        # fp32 always (docstring); None where no selector reads them
        self.ksum = torch.zeros(shape, dtype=torch.float32, device=self.device) if sums else None
        self.count = torch.zeros(num_layers, num_pages, dtype=torch.int32, device=self.device)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (slots, pages, reset)

    @classmethod
    def for_pool(cls, pool: object, sums: bool = True) -> "PageSummaries":
        """Summaries shaped for a PagePool (kv/pool.py), on its device, in `summary_dtype`."""
        return cls.like(pool, pool.num_pages, pool.device, sums)  # type: ignore[attr-defined]

    @classmethod
    def like(cls, pool: object, num_pages: int, device: torch.device | str, sums: bool = True) -> "PageSummaries":
        """Summaries of `num_pages` pages of `pool`'s geometry on `device` (a host tier's: on the
        compute device); sums: keep the key sums."""
        p = pool
        return cls(p.num_layers, num_pages, p.kv_heads, p.head_dim, p.page_size, device,  # type: ignore[attr-defined]
                   summary_dtype(device, p.compute_dtype), sums)  # type: ignore[attr-defined]

    @property
    def sums(self) -> bool:
        return self.ksum is not None

    def bytes_per_page_layer(self) -> int:
        return int(summary_bytes_per_token(self.kv_heads, self.head_dim, 1, 1, self.kmin.dtype, self.sums))

    def update(self, layer: int, slots: torch.Tensor, k: torch.Tensor, one_row_per_page: bool = False) -> None:
        """Fold newly written rows into their pages' summaries.

        slots: [T] int64 page * page_size + offset (the pool's slot_mapping); k: [T, Hkv, D] raw keys.
        one_row_per_page: the step writes at most one row a page (a decode step), so off the CPU
        one kernel updates each row's page in place (kernels/retrieval_attention.py
        update_summaries) instead of the ~18 scatter ops below.
        """
        if slots.numel() == 0:
            return
        if one_row_per_page and self.device.type != "cpu":
            from kvtier.kernels.retrieval_attention import HAVE_TRITON, update_summaries
            if HAVE_TRITON:
                update_summaries(self.kmin[layer], self.kmax[layer], self._sums(layer), self.count[layer], slots, k,
                                 self.page_size)
                return
        pages, reset = self._written(layer, slots)
        kmin, kmax, ksum, count = self.kmin[layer], self.kmax[layer], self._sums(layer), self.count[layer]
        # only the written pages are read and rewritten (the whole layer's summaries were, per step)
        for field, empty in ((kmin, float("inf")), (kmax, float("-inf")), (ksum, 0.0)):
            if field is not None:
                field.index_copy_(0, pages, field.index_select(0, pages).masked_fill(reset[:, None, None], empty))
        count.index_copy_(0, pages, count.index_select(0, pages).masked_fill(reset, 0))
        flat = k.reshape(k.shape[0], -1).float()  # [T, Hkv * D]
        idx = pages[:, None].expand_as(flat)
        low = flat.to(kmin.dtype)  # 16-bit summaries: the min of rounded keys is the rounded min
        kmin.view(self.num_pages, -1).scatter_reduce_(0, idx, low, "amin", include_self=True)
        kmax.view(self.num_pages, -1).scatter_reduce_(0, idx, low, "amax", include_self=True)
        if ksum is not None:
            ksum.view(self.num_pages, -1).index_add_(0, pages, flat)
        count.index_add_(0, pages, torch.ones_like(pages, dtype=torch.int32))

    def _written(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages [T], reset [T]) of the rows a step writes: each row's page, and whether that page
        starts over (its row 0 is written now: its previous occupant's rows are gone), through a
        per-page flag (no host sync for the mask on CUDA). The same for every layer of a step, so
        computed at layer 0 (or for another `slots` tensor) and reused by the other layers; inside
        a CUDA-graph capture layer 0's ops are recorded and replayed with it."""
        step = self._step
        if layer == 0 or step is None or step[0] is not slots:
            pages = torch.div(slots, self.page_size, rounding_mode="floor")
            first = slots.remainder(self.page_size) == 0
            hit = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=pages.device)
            hit.index_fill_(0, torch.where(first, pages, -1) + 1, True)  # 0: no reset
            step = self._step = (slots, pages, hit[1:].index_select(0, pages))
        return step[1], step[2]

    def refresh(self, layer: int, page_ids: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> None:
        """Recompute whole pages from their keys (pages copied in from another tier).

        page_ids: [P] int64; k: [P, Hkv, page_size, D] keys of those pages; rows: [P] valid rows each.
        """
        valid = torch.arange(self.page_size, device=k.device)[None, :] < rows[:, None]  # [P, S]
        m = valid[:, None, :, None]
        kf, dt = k.float(), self.kmin.dtype
        self.kmin[layer, page_ids] = kf.masked_fill(~m, float("inf")).amin(dim=2).to(dt)
        self.kmax[layer, page_ids] = kf.masked_fill(~m, float("-inf")).amax(dim=2).to(dt)
        if self.ksum is not None:
            self.ksum[layer, page_ids] = kf.masked_fill(~m, 0.0).sum(dim=2)
        self.count[layer, page_ids] = rows.to(torch.int32)

    def copy_rows(self, src: "PageSummaries", src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Every layer's summaries of pages `src_ids` of `src` -> pages `dst_ids` here (the pages'
        K/V were copied the same way between two pools of one geometry)."""
        if (src.num_layers, src.kv_heads, src.head_dim) != (self.num_layers, self.kv_heads, self.head_dim):
            raise ValueError("copy_rows between summaries of different geometry")
        si, di = src_ids.to(src.device), dst_ids.to(self.device)
        if self.sums and not src.sums:
            raise ValueError("copy_rows: these summaries keep key sums, the source does not")
        for name in ("kmin", "kmax", "ksum", "count"):
            dst = getattr(self, name)
            if dst is not None:
                dst[:, di] = getattr(src, name)[:, si].to(self.device, dst.dtype)

    def _sums(self, layer: int) -> torch.Tensor | None:
        return None if self.ksum is None else self.ksum[layer]

    def mean(self, layer: int, page_ids: torch.Tensor) -> torch.Tensor:
        """Mean key of pages: page_ids [...] -> [..., Hkv, D] (zeros for empty pages)."""
        if self.ksum is None:
            raise ValueError("these summaries keep no key sums (a selector without the mean key)")
        s = self.ksum[layer][page_ids].float()
        n = self.count[layer][page_ids].clamp_min(1).to(s.dtype)
        return s / n[..., None, None]
