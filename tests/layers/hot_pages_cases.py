"""Shared checks of the GPU cache of selected host pages (kvtier/kernels/hot_pages.py).

Used by tests/layers/test_hot_pages_interp.py (TRITON_INTERPRET=1 on CPU: the kernel runs its
programs in order, so it must equal hot_lookup_reference exactly, slots and state included) and
tests/gpu/test_hot_pages.py (CUDA: programs race, so the checks are the invariants):

- attention over the rewritten lists == attention over the original ones (host pages read in
  place), every step;
- each rewritten entry's pool page holds, for its kv head, exactly the host page's rows;
- entries of page index 0, of GPU pages, of pages past the window quota keep their ids;
- a repeated selection hits in the next step; a page invalidated after its host copy changed is
  brought up again (a stale slot would change the attention).
"""

from __future__ import annotations

import copy
import dataclasses
from types import ModuleType

import torch

from tests.layers import paged_attention_cases as cases


def _extended(st: dict[str, torch.Tensor], extra: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    """The layer's tensors with `extra` more pages (copies of random other pages: a cache slot read
    by mistake gives other numbers), each 4 KiB aligned (whole rows from the alternate pages)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in st.items():
        fill = t[torch.randint(0, t.shape[0], (extra,), generator=g).to(t.device)]
        out[name] = cases.aligned_copy(torch.cat([t, fill]), device)
    return out


def _attend(ra: ModuleType, case: cases.Case, st: dict[str, torch.Tensor], ids: torch.Tensor,
            sel: cases.Selection, alt: object, kernel: bool) -> torch.Tensor:
    args = (case.q, st, case.pool.fmt, ids, sel.page_idx, sel.valid, case.seq_lens, case.scale)
    if kernel:
        return ra.paged_decode_selected(*args, 2, sink=case.sink, alt=alt)
    return ra.paged_decode_selected_reference(*args, sink=case.sink, alt=alt)


def _check_rows(hot: object, st: dict[str, torch.Tensor], alt: object, before: torch.Tensor,
                after: torch.Tensor, idx: torch.Tensor, tag: str) -> int:
    """Rewritten entries hold their host page's rows; the others kept their ids. -> entries rewritten."""
    n_sel = before.shape[2]
    moved = 0
    for e, (b, a, i) in enumerate(zip(before.reshape(-1).tolist(), after.reshape(-1).tolist(),
                                      idx.reshape(-1).tolist())):
        h = (e // n_sel) % before.shape[1]
        if b >= 0 or i <= 0 or a < 0:
            assert a == b, f"{tag}: entry {e} (id {b}, index {i}) renamed to {a}"
            continue
        assert hot.first <= a < hot.first + hot.num_slots, f"{tag}: entry {e} renamed outside the cache: {a}"
        for name, t in st.items():
            assert torch.equal(t[a, h].cpu(), alt.st[name][-1 - b, h].cpu()), \
                f"{tag}: slot page {a} head {h} {name} differs from host page {-1 - b}"
        moved += 1
    return moved


def check_hot_pages(hp: ModuleType, ra: ModuleType, name: str, dtype: torch.dtype, device: str, seed: int,
                    slots: int, exact: bool, kernel_attention: bool) -> None:
    """Three steps of lookups (a selection, the same again, another) then an invalidation, with
    the kernel (`hp.HotPages.lookup`); exact: also == hot_lookup_reference step by step."""
    case = cases.make_case(name, 2, 2, 4, 64, [37, 29], [True, False], cases.interp_dtype(name, dtype)
                           if device == "cpu" else cases.compute_dtype(name, dtype), device, seed)
    case, alt = cases.with_alt_pages(case, seed=seed + 1, alt_device="pinned" if device == "cuda" else None)
    n_pages = case.st["k"].shape[0]
    n_host = alt.st["k"].shape[0]
    st = _extended(case.st, slots, device, seed + 2)
    sk, sv, slot = case.sink  # the cache pages have no sink rows
    slot = cases.aligned_copy(torch.cat([slot, slot.new_full((slots,), -1)]), device)
    case = dataclasses.replace(case, sink=(sk, sv, slot))
    hot = hp.HotPages(1, 2, n_host, n_pages, slots, device)
    if exact:
        st_ref = {k: cases.aligned_copy(t, device) for k, t in st.items()}
        hot_ref = copy.deepcopy(hot)
    sels = [cases.make_selection(case, 6, seed + 3), None, cases.make_selection(case, 6, seed + 4)]
    sels[1] = sels[0]
    for step, sel in enumerate(sels):
        tag = f"{name} slots={slots} step {step}"
        hot.begin_step()
        before = hot.read_stats()
        asked, hits = before["asked"], before["hits"]
        got = hot.lookup(0, st, alt, sel.page_ids, sel.page_idx)
        if exact:
            hot_ref.begin_step()
            want = hp.hot_lookup_reference(hot_ref, 0, st_ref, alt, sel.page_ids, sel.page_idx)
            assert torch.equal(got, want), f"{tag}: ids {got.tolist()} != reference {want.tolist()}"
            for field in ("map", "owner", "claim", "base", "stats"):
                assert torch.equal(getattr(hot, field), getattr(hot_ref, field)), f"{tag}: {field} differs"
            for k in st:
                assert torch.equal(st[k], st_ref[k]), f"{tag}: pool tensor {k} differs"
        moved = _check_rows(hot, st, alt, sel.page_ids, got, sel.page_idx, tag)
        out = _attend(ra, case, st, got, sel, alt, kernel_attention)
        ref = _attend(ra, case, st, sel.page_ids, sel, alt, kernel_attention)
        assert torch.equal(out, ref), f"{tag}: attention over the cache differs from reading in place"
        stats = hot.read_stats()
        host_entries = int(((sel.page_ids < 0) & (sel.page_idx > 0)).sum())
        assert stats["asked"] - asked == host_entries, tag
        if slots >= 4 * host_entries:  # room for every entry
            assert moved == host_entries, f"{tag}: {moved} of {host_entries} host entries cached"
            if step == 1:  # the same lists again: every entry hits
                assert stats["hits"] - hits == host_entries, f"{tag}: {stats['hits'] - hits} hits"
        else:  # a step brings up at most the window's slots a kv head (2 heads)
            brought = stats["brought"] - before["brought"]
            assert brought <= hot.quota * 2, f"{tag}: {brought} brought up"
    # a host page gets new contents: invalidated, it is brought up again; the attention follows
    sel = sels[2]
    host = sel.page_ids[(sel.page_ids < 0) & (sel.page_idx > 0)]
    if host.numel():
        page = int(-1 - host[0])
        for k, t in alt.st.items():
            t[page] = t[(page + 1) % n_host].clone()
        hot.invalidate([page])
        hot.begin_step()
        got = hot.lookup(0, st, alt, sel.page_ids, sel.page_idx)
        _check_rows(hot, st, alt, sel.page_ids, got, sel.page_idx, f"{name} after invalidate")
        out = _attend(ra, case, st, got, sel, alt, kernel_attention)
        ref = _attend(ra, case, st, sel.page_ids, sel, alt, kernel_attention)
        assert torch.equal(out, ref), f"{name}: a stale slot served an invalidated page"
