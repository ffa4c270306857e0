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

8-bit summaries (`summary_dtype(..., bits=8)`, `--kvmem-summary-bits 8`): kmin / kmax are int8
codes and `kexp` [L, P, Hkv] int8 holds a power-of-two exponent e per page and kv head, so that

    kmin = cmin * 2^e <= every key's channel,   kmax = cmax * 2^e >= it

with cmin = floor(min / 2^e), cmax = ceil(max / 2^e) and e = `exponents(max |key|)`, the least
e >= E_MIN with max |key| <= 127 * 2^e. Rounded outward, the Quest bound above still holds for
every key of the page (a little looser); the midrange selector reads the same codes. Because
2^e only grows as rows arrive and floor(floor(y) / 2^s) = floor(y / 2^s), a page folded in row
by row (decode: a new row raises e by s, the old codes shift right by s, floor / ceil) ends with
the codes computed from all its keys at once: the summaries do not depend on how the rows were
chunked, so a page's are the same whichever path or tier wrote it. 2 + 1 / D bytes a key channel
instead of 4 (bf16): a 256K Qwen3-8B context's min / max 2.42 GB -> 1.22 GB, read by every decode
step's scoring.

Pages moving between tiers take their summaries with them (`copy_rows`): a host tier has its own
PageSummaries, kept on the compute device (the selection scores host pages without touching them),
filled when pages are copied down and read back when they are copied up, so a page's summary is
always the one computed from the raw keys written into it, whichever tier it sits in. `refresh`
recomputes pages from their stored keys (pages whose summaries were never recorded).
"""

from __future__ import annotations

import torch

from kvtier.config import SUMMARY_BITS
from kvtier.device import tensor_to


# Least exponent of 8-bit summaries (module docstring): pages whose keys are all below 127 * 2^E_MIN
# in magnitude share it (their codes round outward to -1 / 0 / 1).
E_MIN = -100
# The codes' largest magnitude (2^b - 1 for b-bit codes); the kernels' `_exponent` assumes 127.
CODE_MAX = 127


def summary_dtype(device: torch.device | str, key_dtype: torch.dtype, bits: int = 16) -> torch.dtype:
    """The summaries' dtype for keys of `key_dtype` on `device` (module docstring): bits 8, int8
    codes; 16, on CUDA with 16-bit keys the keys' own dtype, else fp32; 0, 8 on CUDA, else 16."""
    if bits not in SUMMARY_BITS:
        raise ValueError(f"summary bits must be one of {SUMMARY_BITS}, got {bits}")
    cuda = torch.device(device).type == "cuda"
    if bits == 8 or (bits == 0 and cuda):
        return torch.int8
    if cuda and key_dtype in (torch.bfloat16, torch.float16):
        return key_dtype
    return torch.float32


def summary_bytes_per_token(kv_heads: int, head_dim: int, page_size: int, num_layers: int,
                            dtype: torch.dtype, sums: bool = True) -> float:
    """Summary bytes per context token, all layers (the memory plan counts them on the GPU);
    sums: the key sums kept too; int8 `dtype`: codes and a one-byte exponent per kv head."""
    item = torch.empty((), dtype=dtype).element_size()
    exps = kv_heads if dtype == torch.int8 else 0
    return num_layers * ((2 * item + 4 * sums) * kv_heads * head_dim + exps + 4) / page_size


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e, exactly, in fp32 (e: integer tensor within -126 .. 127): its bits built directly."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def exponents(amax: torch.Tensor) -> torch.Tensor:
    """The least e >= E_MIN with amax <= CODE_MAX * 2^e (amax >= 0, fp32) -> int32, as the kernels
    (kernels/retrieval_attention.py _exponent) compute it: from amax's binary exponent x (amax in
    [2^(x-1), 2^x); x = -126 below the normal range), e is x - 7 or x - 6 (CODE_MAX 127)."""
    amax = amax.float()
    x = torch.frexp(amax).exponent.to(torch.int32)
    x = torch.where(amax < 2.0 ** -126, -126, x)
    e0 = (x - CODE_MAX.bit_length()).clamp_min(E_MIN)
    return e0 + (amax > CODE_MAX * pow2(e0)).to(torch.int32)


def encode_bounds(lo: torch.Tensor, hi: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(floor(lo / 2^e), ceil(hi / 2^e)) as int32 codes; lo / hi [..., D] fp32, e [...] int32."""
    inv = pow2(-e)[..., None]
    return torch.floor(lo * inv).to(torch.int32), torch.ceil(hi * inv).to(torch.int32)


def encode_pages(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 8-bit summaries of pages whose channel min / max are lo / hi [..., D] fp32 -> (cmin, cmax
    [..., D], e [...]) int32: e from the pages' largest magnitude, the codes rounded outward."""
    e = exponents(torch.maximum(lo.abs(), hi.abs()).amax(-1))
    return (*encode_bounds(lo, hi, e), e)


def shift_codes(cmin: torch.Tensor, cmax: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes at exponent e -> at e + s (s >= 0, [...] int32; codes [..., D] int32): floor / ceil of
    code / 2^s, which equals the codes computed from the keys at e + s (module docstring)."""
    s = s.clamp(0, 31)[..., None]
    return cmin >> s, -((-cmax) >> s)


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
        # 8-bit codes (module docstring): empty pages are recognised by count == 0, not by +-inf
        self.codes = dtype == torch.int8
        lo, hi = (0, 0) if self.codes else (float("inf"), float("-inf"))
        self.kmin = torch.full(shape, lo, dtype=dtype, device=self.device)
        self.kmax = torch.full(shape, hi, dtype=dtype, device=self.device)
        self.kexp = torch.full(shape[:3], E_MIN, dtype=torch.int8, device=self.device) if self.codes else None
        # fp32 always (docstring); None where no selector reads them
        self.ksum = torch.zeros(shape, dtype=torch.float32, device=self.device) if sums else None
        self.count = torch.zeros(num_layers, num_pages, dtype=torch.int32, device=self.device)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (slots, pages, reset)

    @classmethod
    def for_pool(cls, pool: object, sums: bool = True, bits: int = 16) -> "PageSummaries":
        """Summaries shaped for a PagePool (kv/pool.py), on its device, in `summary_dtype`."""
        return cls.like(pool, pool.num_pages, pool.device, sums, bits)  # type: ignore[attr-defined]

    @classmethod
    def like(cls, pool: object, num_pages: int, device: torch.device | str, sums: bool = True,
             bits: int = 16) -> "PageSummaries":
        """Summaries of `num_pages` pages of `pool`'s geometry on `device` (a host tier's: on the
        compute device); sums: keep the key sums; bits: 8 for int8 codes (module docstring)."""
        p = pool
        return cls(p.num_layers, num_pages, p.kv_heads, p.head_dim, p.page_size, device,  # type: ignore[attr-defined]
                   summary_dtype(device, p.compute_dtype, bits), sums)  # type: ignore[attr-defined]

    @property
    def sums(self) -> bool:
        return self.ksum is not None

    @property
    def bits(self) -> int:
        return 8 if self.codes else 16

    def values(self, name: str, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """kmin or kmax (`name`) of pages `ids` [...] of one layer as fp32 [..., Hkv, D] (8-bit codes
        scaled by their 2^e: exact)."""
        v = getattr(self, name)[layer][ids].float()
        if not self.codes:
            return v
        return v * pow2(self.kexp[layer][ids].to(torch.int32))[..., None]  # type: ignore[index]

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
                                 self.page_size, self.kexp[layer] if self.kexp is not None else None)
                return
        pages, reset = self._written(layer, slots)
        if self.codes:
            self._update_codes(layer, pages, reset, k)
            return
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

    def _update_codes(self, layer: int, pages: torch.Tensor, reset: torch.Tensor, k: torch.Tensor) -> None:
        """update()'s scatter path for 8-bit codes (module docstring): each written page's exponent
        becomes the max of its old one (unless the page starts over) and its new rows'; its old codes
        shift to it; the new rows' codes fold in by scatter min / max."""
        kmin, kmax, kexp, count = self.kmin[layer], self.kmax[layer], self.kexp[layer], self.count[layer]  # type: ignore[index]
        t, hkv, d = k.shape
        kf = k.float()
        old = (~reset) & (count.index_select(0, pages) > 0)  # [T] the page keeps its earlier rows
        e_old = kexp.index_select(0, pages).to(torch.int32)  # [T, Hkv]
        e_all = kexp.to(torch.int32)  # [P, Hkv]: the written pages' new exponents, scattered
        e_all.index_copy_(0, pages, torch.where(old[:, None], e_old, E_MIN))
        e_all.scatter_reduce_(0, pages[:, None].expand(t, hkv), exponents(kf.abs().amax(-1)), "amax")
        e_new = e_all.index_select(0, pages)  # [T, Hkv]
        lo, hi = shift_codes(kmin.index_select(0, pages).to(torch.int32), kmax.index_select(0, pages).to(torch.int32),
                             e_new - e_old)
        keep = old[:, None, None]
        kmin.index_copy_(0, pages, torch.where(keep, lo, 127).to(torch.int8))  # 127 / -127: no rows yet
        kmax.index_copy_(0, pages, torch.where(keep, hi, -127).to(torch.int8))
        kexp.index_copy_(0, pages, e_new.to(torch.int8))
        lo, hi = encode_bounds(kf, kf, e_new)  # [T, Hkv, D]
        idx = pages[:, None].expand(t, hkv * d)
        kmin.view(self.num_pages, -1).scatter_reduce_(0, idx, lo.view(t, -1).to(torch.int8), "amin")
        kmax.view(self.num_pages, -1).scatter_reduce_(0, idx, hi.view(t, -1).to(torch.int8), "amax")
        count.index_copy_(0, pages, count.index_select(0, pages).masked_fill(reset, 0))
        count.index_add_(0, pages, torch.ones_like(pages, dtype=torch.int32))
        if self.ksum is not None:
            ksum = self.ksum[layer]
            ksum.index_copy_(0, pages, ksum.index_select(0, pages).masked_fill(reset[:, None, None], 0.0))
            ksum.view(self.num_pages, -1).index_add_(0, pages, kf.reshape(t, -1))

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
        lo, hi = kf.masked_fill(~m, float("inf")).amin(dim=2), kf.masked_fill(~m, float("-inf")).amax(dim=2)
        if self.codes:  # [P, Hkv, D] -> codes at each (page, head)'s exponent; empty pages: zeros
            some = (rows > 0)[:, None, None]
            lo, hi = torch.where(some, lo, 0.0), torch.where(some, hi, 0.0)
            lo, hi, e = encode_pages(lo, hi)
            self.kexp[layer, page_ids] = e.to(torch.int8)  # type: ignore[index]
        self.kmin[layer, page_ids] = lo.to(dt)
        self.kmax[layer, page_ids] = hi.to(dt)
        if self.ksum is not None:
            self.ksum[layer, page_ids] = kf.masked_fill(~m, 0.0).sum(dim=2)
        self.count[layer, page_ids] = rows.to(torch.int32)

    def copy_rows(self, src: "PageSummaries", src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Every layer's summaries of pages `src_ids` of `src` -> pages `dst_ids` here (the pages'
        K/V were copied the same way between two pools of one geometry)."""
        if (src.num_layers, src.kv_heads, src.head_dim) != (self.num_layers, self.kv_heads, self.head_dim):
            raise ValueError("copy_rows between summaries of different geometry")
        si, di = tensor_to(src_ids, src.device), tensor_to(dst_ids, self.device)  # no wait: pages move between steps
        if self.sums and not src.sums:
            raise ValueError("copy_rows: these summaries keep key sums, the source does not")
        if self.codes != src.codes:
            raise ValueError("copy_rows between 8-bit and 16/32-bit summaries")
        for name in ("kmin", "kmax", "kexp", "ksum", "count"):
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
