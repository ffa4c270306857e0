"""A GPU cache of the host pages retrieval decode selects (`HotPages`), kept in reserved pool pages.

Past the GPU pool, retrieval decode reads each selected host page over the bus, every step (the
selected kernel reads pinned pages in place). Consecutive steps of real text choose mostly the same
pages, so a page brought up once can serve the next steps from the GPU. The cache lives in C pool
pages no sequence owns (`first` .. `first` + C - 1, the engine's reserve), and is kept per (layer,
kv head): slot s of (layer l, head h) is head h's rows of pool page first + s in layer l, so each
head caches only the pages it chose, and a rewritten page id reads exactly those rows.

Before the selected kernel reads a layer's lists, `lookup` rewrites their host ids (-1 - p):

    entry (r, h, j) names host page p  --map[l, h, p] = s, s outside this launch's claim window-->
                                            first + s (a hit: read on the GPU)
                                        --else: claim the next ring slot, copy head h's rows of
                                            page p into it (over the bus, once)--> first + s
                                        --no slot left in the window--> -1 - p (read in place)

Entries of page index 0 keep their host id (the split kernel looks a sequence's sink row up by
the first page's id). Slots form a ring per (layer, head), claimed in order by atomics:

    ring of C slots:   ... | base .. base + Q - 1 | ...          (mod C)
                             this launch's claims:  slots here may be overwritten now, so a map
                             entry pointing into the window counts as a miss; Q = C // 2

A step claims at most Q slots a (layer, head); `begin_step` (once a step, before layer 0's lookup)
moves `base` past the slots the last step filled. A page cached at slot s thus stays until about
C - Q further claims, and a page still hot then is brought up again. Concurrent programs never
read a slot another program of the same launch writes (the window), and a slot whose owner lost
its map entry (two rows claimed the same page; the page was invalidated) is dropped by compare-and-
swap, not by a blind clear. `invalidate` forgets host pages whose contents change (the manager
reuses them). Everything is device ops of fixed shapes: captured in CUDA graphs like the rest.

`hot_lookup_reference` is the same walk in PyTorch, entry by entry in program order (what the
interpreter runs), beside the kernel.
"""

from __future__ import annotations

import math

import torch

from kvtier.device import tensor_to
from kvtier.kernels.paged_attention import HAVE_TRITON, AltPages, _pow2, alt_offsets

# The pool tensors a page holds, in kernel argument order (formats without scales have k, v only).
TENSORS = ("k", "k_scale", "v", "v_scale")

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_rows(ptr, ad, src_page, dst_page, h, Hkv, S: tl.constexpr, RE: tl.constexpr, BLK: tl.constexpr):
        """Head h's S rows (RE elements each) of alternate page src_page (ad rows from ptr's tensor)
        -> pool page dst_page."""
        off = tl.arange(0, BLK)
        m = off < S * RE
        src = ptr + ((src_page * Hkv + h) * S + ad) * RE + off
        dst = ptr + (dst_page * Hkv + h) * S * RE + off
        tl.store(dst, tl.load(src, mask=m), mask=m)

    @triton.jit(do_not_specialize=["Hkv", "n_sel", "num_host", "first", "C", "Q", "ad0", "ad1", "ad2", "ad3"])
    def _hot_kernel(ids_ptr, idx_ptr, out_ptr, map_ptr, owner_ptr, claim_ptr, base_ptr, stats_ptr,
                    t0, t1, t2, t3, ad0, ad1, ad2, ad3, Hkv, n_sel, num_host, first, C, Q,
                    S: tl.constexpr, RE0: tl.constexpr, RE1: tl.constexpr, RE2: tl.constexpr, RE3: tl.constexpr,
                    BLK0: tl.constexpr, BLK1: tl.constexpr, BLK2: tl.constexpr, BLK3: tl.constexpr):
        """One list entry e = (r * Hkv + h) * n_sel + j (module docstring); RE_i: elements a row
        of tensor i (0: the format has no such tensor), BLK_i: a power of two >= S * RE_i."""
        e = tl.program_id(0)
        h = ((e // n_sel) % Hkv).to(tl.int64)
        pid = tl.load(ids_ptr + e).to(tl.int64)
        pidx = tl.load(idx_ptr + e)
        out = pid
        if (pid < 0) & (pidx > 0):
            hp = -1 - pid
            mrow = map_ptr + h * num_host + hp
            slot = tl.load(mrow, volatile=True).to(tl.int64)
            base = tl.load(base_ptr + h)
            ahead = (slot - base % C + C) % C  # slots base .. base + Q - 1 may be rewritten by this launch
            tl.atomic_add(stats_ptr + h * 3, 1)  # this (layer, head)'s counters: no one address for all
            if (slot >= 0) & (ahead >= Q):
                tl.atomic_add(stats_ptr + h * 3 + 1, 1)
                out = first + slot
            else:
                c = tl.atomic_add(claim_ptr + h, 1) - base
                if c < Q:
                    new = (base + c) % C
                    orow = owner_ptr + h * C + new
                    old = tl.load(orow)
                    if old >= 0:  # its page leaves the cache, unless its map entry moved on already
                        tl.atomic_cas(map_ptr + h * num_host + old, new.to(tl.int32), -1)
                    tl.store(orow, hp.to(tl.int32))
                    dst = first + new
                    if RE0 > 0:
                        _copy_rows(t0, ad0, hp, dst, h, Hkv, S, RE0, BLK0)
                    if RE1 > 0:
                        _copy_rows(t1, ad1, hp, dst, h, Hkv, S, RE1, BLK1)
                    if RE2 > 0:
                        _copy_rows(t2, ad2, hp, dst, h, Hkv, S, RE2, BLK2)
                    if RE3 > 0:
                        _copy_rows(t3, ad3, hp, dst, h, Hkv, S, RE3, BLK3)
                    tl.store(mrow, new.to(tl.int32))
                    tl.atomic_add(stats_ptr + h * 3 + 2, 1)
                    out = dst
        tl.store(out_ptr + e, out)


def launch_constants(st: dict[str, torch.Tensor]) -> dict[str, int]:
    """The lookup kernel's constexprs for one pool layer `st`: S, and per TENSORS entry i the
    elements of a row (RE_i, 0 where the format has no such tensor) and a power of two >= S * RE_i."""
    const = {"S": st["k"].shape[2]}
    for i, name in enumerate(TENSORS):
        t = st.get(name)
        re = math.prod(t.shape[3:]) if t is not None else 0
        const[f"RE{i}"], const[f"BLK{i}"] = re, _pow2(const["S"] * max(re, 1))
    return const


class HotPages:
    """The cache's state (module docstring): per (layer, kv head) a map host page -> slot and a ring
    of `num_slots` slots over pool pages `first` .. `first` + num_slots - 1."""

    def __init__(self, num_layers: int, kv_heads: int, num_host_pages: int, first: int, num_slots: int,
                 device: torch.device | str):
        if num_slots < 2:
            raise ValueError(f"HotPages needs at least 2 slots, got {num_slots}")
        self.first, self.num_slots = first, num_slots
        self.quota = num_slots // 2  # claims a launch may make per (layer, head): the window
        self.num_host = num_host_pages
        dev = torch.device(device)
        self.map = torch.full((num_layers, kv_heads, num_host_pages), -1, dtype=torch.int32, device=dev)
        self.owner = torch.full((num_layers, kv_heads, num_slots), -1, dtype=torch.int32, device=dev)
        self.claim = torch.zeros((num_layers, kv_heads), dtype=torch.int64, device=dev)
        self.base = torch.zeros((num_layers, kv_heads), dtype=torch.int64, device=dev)
        # per (layer, kv head): host entries looked up, hits, pages brought up
        self.stats = torch.zeros((num_layers, kv_heads, 3), dtype=torch.int64, device=dev)
        # per layer: (tensors, their distances from the host pages, constexprs), fixed with the pools
        self._launch: dict[int, tuple[list[torch.Tensor], list[int], dict[str, int]]] = {}

    def begin_step(self) -> None:
        """Once a step before its lookups: each ring's window moves past last step's claims (the
        claims that found no slot counted too: at most Q were real)."""
        torch.minimum(self.claim, self.base + self.quota, out=self.base)
        self.claim.copy_(self.base)

    def invalidate(self, host_pages: list[int] | torch.Tensor) -> None:
        """Host pages about to get new contents: no slot serves them any more (owners keep the stale
        name; the compare-and-swap at eviction ignores it)."""
        idx = tensor_to(torch.as_tensor(host_pages, dtype=torch.long), self.map.device)
        if idx.numel():
            self.map.index_fill_(2, idx, -1)

    def read_stats(self) -> dict[str, int]:
        """(host entries looked up, hits, pages brought up) since the start (a device sync)."""
        asked, hits, brought = self.stats.sum((0, 1)).tolist()
        return {"asked": asked, "hits": hits, "brought": brought}

    def lookup(self, layer: int, st: dict[str, torch.Tensor], alt: AltPages, page_ids: torch.Tensor,
               page_idx: torch.Tensor) -> torch.Tensor:
        """page_ids / page_idx: [R, Hkv, n_sel] (select's lists) -> page ids with the cached host
        pages renamed to their slots' pool pages (module docstring); st: the pool's layer `layer`,
        alt: its host pages (AltPages)."""
        ids = page_ids.contiguous()
        out = torch.empty_like(ids)
        if ids.numel() == 0:
            return out
        if not HAVE_TRITON:
            raise RuntimeError("HotPages.lookup needs Triton; use hot_lookup_reference")
        args, ads, const = self._launch.get(layer) or self._launch_args(layer, st, alt)
        _hot_kernel[(ids.numel(),)](ids, page_idx.contiguous(), out, self.map[layer], self.owner[layer],
                                    self.claim[layer], self.base[layer], self.stats[layer], *args, *ads,
                                    ids.shape[1], ids.shape[2], self.num_host, self.first, self.num_slots,
                                    self.quota, **const, num_warps=2)
        return out

    def _launch_args(self, layer: int, st: dict[str, torch.Tensor],
                     alt: AltPages) -> tuple[list[torch.Tensor], list[int], dict[str, int]]:
        ad = alt_offsets(st, None, alt)
        args = [st.get(name, st["k"]) for name in TENSORS]  # absent tensors: placeholders never read
        ads = [ad[arg] if name in st else 0 for name, arg in zip(TENSORS, ("ad_k", "ad_ks", "ad_v", "ad_vs"))]
        self._launch[layer] = args, ads, launch_constants(st)
        return self._launch[layer]


def hot_lookup_reference(hot: HotPages, layer: int, st: dict[str, torch.Tensor], alt: AltPages,
                         page_ids: torch.Tensor, page_idx: torch.Tensor) -> torch.Tensor:
    """HotPages.lookup in PyTorch, entry by entry in program order (slow; tests)."""
    r, hkv, n_sel = page_ids.shape
    ids, idx = page_ids.reshape(-1).tolist(), page_idx.reshape(-1).tolist()
    out = list(ids)
    hmap, owner, claim = hot.map[layer], hot.owner[layer], hot.claim[layer]
    c_total, q = hot.num_slots, hot.quota
    for e, (pid, pidx) in enumerate(zip(ids, idx)):
        if pid >= 0 or pidx <= 0:
            continue
        h, hp = (e // n_sel) % hkv, -1 - pid
        slot, base = int(hmap[h, hp]), int(hot.base[layer, h])
        stats = hot.stats[layer, h]
        stats[0] += 1
        if slot >= 0 and (slot - base % c_total + c_total) % c_total >= q:
            stats[1] += 1
            out[e] = hot.first + slot
            continue
        c = int(claim[h]) - base
        claim[h] += 1
        if c >= q:
            continue
        new = (base + c) % c_total
        old = int(owner[h, new])
        if old >= 0 and int(hmap[h, old]) == new:
            hmap[h, old] = -1
        owner[h, new] = hp
        for name, t in st.items():
            t[hot.first + new, h] = alt.st[name][hp, h].to(t.device)
        hmap[h, hp] = new
        stats[2] += 1
        out[e] = hot.first + new
    return torch.tensor(out, dtype=page_ids.dtype, device=page_ids.device).view(r, hkv, n_sel)
