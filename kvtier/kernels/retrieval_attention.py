"""Retrieval decode attention: each (row, kv head) attends to its own list of pages, read in place.

RetrievalAttention.select (kvtier/layers/retrieval.py) gives, per decode row r and kv head h, a
list of n_sel entries: pool page id, page index within the sequence, valid. This is paged_decode
(kvtier/kernels/paged_attention.py) with that list in place of the sequence's block-table row:
the same split kernel in its SELECTED mode (a constexpr; the whole-sequence code is unchanged),
so every KV format, the sink rows, the stored (native) domain and its folding, the split-K merge
and CUDA-graph capture work as there. Each K/V byte of a selected page is read once, by the kv
head that chose it (the PyTorch path reads every selected page for every kv head).

    entries of (r, h):  | split 0        | split 1        | ... | split n-1      |
                        0                pps              2*pps                  n_sel
    pps = cdiv(n_sel, num_splits); entry j: page ids[r, h, j] at page index idx[r, h, j]:

    keys of entry j:  idx*S  idx*S+1  ...  idx*S+S-1     live iff valid and position < ctx[r]
                      (idx == 0 with a sink slot: key 0 is the slot's exact row; the split
                      holding that entry scans its entries' page indices for it first)

Entries of one (r, h) must name distinct pages (select's lists do); their order is free.
`paged_decode_selected_reference` is the same computation in PyTorch (the format's codecs).
"""

from __future__ import annotations

import torch

from kvtier.kernels import pdl
from kvtier.kernels.paged_attention import (HAVE_TRITON, AltPages, NativeDomain, PageLists, Sink, _check_pages,
                                            choose_num_splits, launch_decode, with_alt)
from kvtier.kv.formats import KVFormat
from kvtier.kv.summaries import E_MIN as SUMMARY_E_MIN


def selected_num_splits(rows: int, kv_heads: int, n_sel: int, page_size: int, num_sms: int) -> int:
    """Splits per (row, kv head) for paged_decode_selected: choose_num_splits over the n_sel * S
    keys a list holds (shapes only: capturable; n_sel is fixed by the budget)."""
    return choose_num_splits(rows, kv_heads, n_sel * page_size, page_size, num_sms)


def _check_lists(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat, page_ids: torch.Tensor,
                 page_idx: torch.Tensor, valid: torch.Tensor | None, ctx: torch.Tensor, num_splits: int) -> None:
    who = "paged_decode_selected"
    _check_pages(who, q, st, fmt)
    want = (q.shape[0], st["k"].shape[1])
    if page_ids.dim() != 3 or tuple(page_ids.shape[:2]) != want:
        raise ValueError(f"{who}: page_ids must be [R, Hkv, n_sel] = [{want[0]}, {want[1]}, n], "
                         f"got {tuple(page_ids.shape)}")
    if page_idx.shape != page_ids.shape or (valid is not None and valid.shape != page_ids.shape):
        raise ValueError(f"{who}: page_idx {tuple(page_idx.shape)} / valid "
                         f"{None if valid is None else tuple(valid.shape)} differ from page_ids "
                         f"{tuple(page_ids.shape)}")
    if ctx.shape != (q.shape[0],):
        raise ValueError(f"{who}: ctx {tuple(ctx.shape)} does not match {q.shape[0]} rows")
    for name, t in (("page_ids", page_ids), ("page_idx", page_idx), ("ctx", ctx)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{who}: {name} must be int32 or int64, got {t.dtype}")
    if valid is not None and valid.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"{who}: valid must be bool or uint8, got {valid.dtype}")
    if num_splits < 1:
        raise ValueError(f"{who}: num_splits must be >= 1, got {num_splits}")


def paged_decode_selected(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat, page_ids: torch.Tensor,
                          page_idx: torch.Tensor, valid: torch.Tensor | None, ctx: torch.Tensor, scale: float,
                          num_splits: int, sink: Sink | None = None, out: torch.Tensor | None = None,
                          native: NativeDomain | None = None, alt: AltPages | None = None) -> torch.Tensor:
    """One decode row per sequence over per-kv-head page lists, read in place.

    q: [R, Hq, D] (bf16 / fp16 / fp32) in the stored domain (PagePool.native_q), or raw with
    `native` (folded as in paged_decode);
    st: one pool layer (`pool.layers[layer]`), [num_pages, Hkv, S, ...];
    page_ids: [R, Hkv, n_sel] int32/int64 pool page ids (entries that read nothing: any value);
    page_idx: [R, Hkv, n_sel] int32/int64 page index within the sequence (< 0: no entry);
    valid: [R, Hkv, n_sel] bool/uint8 (False: no entry), or None;
    ctx: [R] int32/int64 context length (keys 0 .. ctx-1 exist; the last page is partial);
    sink: (sink_k, sink_v, sink_slot) of the pool's layer: key 0 of a page-index-0 entry whose
    page has a slot comes from the slot; num_splits: `selected_num_splits`;
    out: optional [R, Hq, D] destination (last dim contiguous);
    alt: the pages negative ids name (AltPages): the pinned host tier, read over the bus in place.
    -> [R, Hq, D] in q.dtype, in the stored domain (PagePool.native_out maps it back); a row
    (kv head) with no live key gives zeros.

    No host synchronisation and no data-dependent shapes: capturable in a CUDA graph.
    """
    if not HAVE_TRITON:
        raise RuntimeError("paged_decode_selected needs Triton; use paged_decode_selected_reference on CPU")
    _check_lists(q, st, fmt, page_ids, page_idx, valid, ctx, num_splits)
    ok = None
    if valid is not None:
        ok = valid.contiguous()
        ok = ok.view(torch.uint8) if ok.dtype == torch.bool else ok
    lists = PageLists(page_idx.contiguous(), ok)
    return launch_decode(q, st, fmt, page_ids.contiguous(), ctx, scale, num_splits, sink, out, native, lists, alt)


def _entry_rows(st: dict[str, torch.Tensor], fmt: KVFormat, ids: torch.Tensor, head_dim: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: [R, Hkv, n] page ids -> k, v: [R, Hkv, n, S, D] in dtype, entry (r, h, j) reading
    only kv head h of its page (decoded by the reference codecs)."""
    heads = torch.arange(ids.shape[1], device=ids.device)[None, :, None].expand_as(ids)
    return tuple(c.decode({suffix: st[kv + suffix][ids, heads] for suffix in c.parts(head_dim)}, dtype)
                 for kv, c in (("k", fmt.k_codec), ("v", fmt.v_codec)))


def paged_decode_selected_reference(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat,
                                    page_ids: torch.Tensor, page_idx: torch.Tensor, valid: torch.Tensor | None,
                                    ctx: torch.Tensor, scale: float, sink: Sink | None = None,
                                    alt: AltPages | None = None) -> torch.Tensor:
    """paged_decode_selected in plain PyTorch (same arguments; any device; no host sync).

    Each entry's page decoded to q.dtype for its own kv head (as PagePool.read(native=True)),
    key 0 of page-index-0 entries from the sink slot, then an fp32 softmax over the live keys:
    q: [R, Hq, D] -> [R, Hq, D] in q.dtype (zeros where a kv head has no live key).
    """
    st, sink, page_ids = with_alt(st, sink, page_ids, alt)
    r, hq, d = q.shape
    hkv, s = st["k"].shape[1], st["k"].shape[2]
    ok = page_idx >= 0
    if valid is not None:
        ok = ok & valid.bool()
    ids = torch.where(ok, page_ids.long(), 0)
    k, v = _entry_rows(st, fmt, ids, d, q.dtype)  # [R, Hkv, n, S, D]
    if sink is not None:
        slot = sink[2][ids]  # [R, Hkv, n]
        first = ok & (page_idx == 0) & (slot >= 0)
        heads = torch.arange(hkv, device=q.device)[None, :, None].expand_as(ids)
        for rows, exact in ((k, sink[0]), (v, sink[1])):
            rows[..., 0, :] = torch.where(first[..., None], exact[slot.clamp_min(0), heads].to(q.dtype),
                                          rows[..., 0, :])
    pos = page_idx.long()[..., None] * s + torch.arange(s, device=q.device)  # [R, Hkv, n, S]
    live = (ok[..., None] & (pos < ctx.long()[:, None, None, None])).flatten(2)  # [R, Hkv, n * S]
    qg = q.float().view(r, hkv, hq // hkv, d)  # query head h reads kv head h // (Hq / Hkv)
    sc = qg @ k.float().flatten(2, 3).transpose(-1, -2) * scale  # [R, Hkv, G, n * S]
    p = sc.masked_fill(~live[:, :, None, :], float("-inf")).softmax(-1).nan_to_num(0.0)  # no key: 0
    return (p @ v.float().flatten(2, 3)).reshape(r, hq, d).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Quest scores of the candidate pages: one pass over their summaries, nothing gathered first.
#
# The PyTorch scorer (layers/retrieval.py page_scores) gathers kmin / kmax of every candidate
# into [R, C, Hkv, D] copies (and both tiers' when a host tier exists) before its einsums: about
# three times the summary bytes, which at fp32 are 1/8 of the candidates' bf16 K/V (16-token
# pages) and so outweigh the selected pages' reads at small budgets. Grid (R, Hkv, cdiv(C,
# BLOCK_C)): each program reads its kv head's [D] min / max rows of BLOCK_C candidates once.
# ---------------------------------------------------------------------------------------------

# Summary values per [BLOCK_C, D] tile (BLOCK_C = this // D candidates a program). H100,
# tools/sweep_quest.py, one layer of 8 kv heads x 4, bf16 min / max, us a launch at 128K / 256K
# (16-token pages; % of the bandwidth for the bytes read): 2048 15.7 / 32.6 (74% / 71%), with the
# midrange scores 18.1 / 36.7; 4096 16.4 / 35.9, midrange 19.4 / 41.6; 8192 20.3 / 43.6. The bound
# as two tensor-core products over the group's heads (tf32x3) instead of a shuffle reduction per
# head was 3-5x slower at every tile (80-170 us at 256K): the launch is bound by its loads.
# Compiled for sm_90 offline, 4 warps, 4096: 123 registers (165 with a host tier) at D = 128, no
# spills; 8192 spilled at D = 256 with a host tier.
SCORE_TILE = 2048
# The same for 8-bit summaries (kv/summaries.py: int8 codes, half the bytes a value). H100, 256K,
# hybrid-mid's launch with PDL off (tools/profile_retrieval.py): 34.2 us at 2048 against ~36.7 for
# bf16 at 2048: the launch is no longer bound by its loads. With the group's q+ / q- summed first,
# H200, tools/sweep_quest.py, 256K, bound + midrange: 1024 30.0 us, 2048 22.1, 4096 21.6, 8192 29.1
# (bf16 summaries: 2048 25.1). The sums as int8 tensor-core products of the codes (q in three int8
# levels) took 24.2 at best (8192; 66.7 at 2048) and were removed.
SCORE_TILE_CODES = 2048
# topk_columns: columns a chunk program sorts (at least; long rows take longer chunks so that at
# most TOPK_MAX_CHUNKS chunks' picks reach the merge program), the warps of a
# chunk program, and a chunk holds at least TOPK_CHUNK_PICKS times the (power-of-two) picks. H100,
# tools/scratch sweep, us a call over 8 heads (torch.topk: 80 at 16,386 columns, 31 at 4,352): k 56
# at 16,386 columns 20.1 (16.2 with 256 live), at 4,352 10.0 (1,024-column chunks); k 112 at 16,386
# 31.3 with 2,048-column chunks, 48 with 1,024 (the merge sorts twice the keys)
TOPK_CHUNK = 1024
TOPK_CHUNK_PICKS = 16
TOPK_MAX_CHUNKS = 32
TOPK_CHUNK_WARPS = 8
TOPK_MERGE_KEYS_PER_WARP = 128  # the merge program's warps: its keys / this, 4 .. 16
# Live chunks up to which the merge program sorts only theirs (GROUP x the picks; 0: always every
# chunk's): a short context in a long engine's table (4K in a 256K engine: 1 live chunk of 17).
# H100, 8 heads, k 56, 16,386 columns, 256 live: 16.2 -> 9.2 us. Merging every chunk a few at a
# time into a running best was slower where all are live (19.8 -> 24.9 us), so past GROUP live
# chunks it is one sort of all of them, as before.
TOPK_MERGE_GROUP = 4
# topk_columns by a threshold instead of sorting every chunk (`_topk_filtered`), for k up to
# TOPK_FILTER_MAX_K: the best score of each TOPK_FILTER_SUB columns; the last chunk program of a
# row to finish takes the k-th best of the row's live maxima (TOPK_FILTER_TILE at a time) as its
# threshold T; the keys scoring >= T gathered (at most k x SUB but for ties at T: the buffer holds
# that many unless TOPK_FILTER_CAP is set; past it the pick pass walks the row) and sorted, in a
# sort of TOPK_FILTER_SMALL or TOPK_FILTER_MID keys where they fit. The first version took the
# sub-block width from the table's width (256 maxima a row): a 64K context in a 256K table had
# 64 live maxima for 55 picks, so nearly every live column passed T and the pick walked the row
# (H100, one layer's hybrid-mid selection, tools/sweep_select.py: 106 us against the chunked 33;
# scores rising along the row, tools/sweep_topk.py: 238 against 23). Its 256K step gain was
# already large (H100, 8B-int4, 12 GiB, k8v4, hybrid-mid: 125.0 -> 147.4 tok/s). This version, the
# same H100 type, us (sweep_select: chunked / first / this): 64K 32.8 / 106.3 / 35.3, 128K 48.4 /
# 47.6 / 37.9, 256K 72.4 / 41.9 / 56.8; rising 23.0 / 238 / 17.9. Its one-program threshold (~10 us
# at 16,386 columns: three 512-maxima steps) is what the first version's all-live rows did not pay.
TOPK_FILTER = True
TOPK_FILTER_MAX_K = 128
TOPK_FILTER_SUB = 16
TOPK_FILTER_CHUNK = 1024
TOPK_FILTER_TILE = 512
TOPK_FILTER_CAP: int | None = None  # None: k x SUB (tests set a small one to reach the walk)
TOPK_FILTER_SMALL = 128
TOPK_FILTER_MID = 512
TOPK_FILTER_WARPS = 4
# Row-heads whose threshold tickets and candidate counts live in one buffer a device, zeroed once
# and kept across calls (`_filter_counters`: no memset a call).
TOPK_FILTER_STATE = 4096
# TOPK_FILTER_COARSE (off until timed): no ticket; the maxima pass also writes the best of each
# group of 16-column maxima (at most TOPK_FILTER_COARSE_MAXIMA groups a row), each gather program
# takes the threshold from those (the first version's parallel sort of 256, always exact), and only
# where the candidates overflow the buffer does the pick program take the fine threshold and
# gather the row again by it. Offline sm_90, 16,386 columns, k 56 (tools/sass_topk.py): maxima
# 312 + gather 896 SASS a program, against the ticket path's 1,264 (745 of it one program's
# threshold loop) + 496.
TOPK_FILTER_COARSE = False
TOPK_FILTER_COARSE_MAXIMA = 256
_filter_state: dict[torch.device, torch.Tensor] = {}

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from kvtier.kernels.pdl import wait_before_reads

    E_MIN = tl.constexpr(SUMMARY_E_MIN)

    @triton.jit
    def _pow2(e):
        """2^e in fp32, exactly (e int32 within -126 .. 127): kv/summaries.py pow2."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _exponent(amax):
        """kv/summaries.py exponents: the least e >= E_MIN with amax <= 127 * 2^e (fp32 amax >= 0)."""
        x = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126  # amax in [2^(x-1), 2^x); -126 below normal
        e0 = tl.maximum(x - 7, E_MIN)
        return e0 + (amax > 127.0 * _pow2(e0)).to(tl.int32)

    @triton.jit
    def _store_scores(dst, acc, cnt, cand_ptr, r, c, cm, C, FILL: tl.constexpr):
        """_quest_kernel's scores out: +inf for pages with no rows; FILL: -inf at non-candidates."""
        acc = tl.where(cnt == 0, float("inf"), acc)
        if FILL:
            cand = tl.load(cand_ptr + r.to(tl.int64) * C + c, mask=cm, other=-1)
            tl.store(dst, tl.where(cand >= 0, acc, float("-inf")), mask=c < C)
        else:
            tl.store(dst, acc, mask=cm)

    @triton.jit(do_not_specialize=["Hkv", "G", "C"])
    def _quest_kernel(q_ptr, ids_ptr, kmin_ptr, kmax_ptr, cnt_ptr, hmin_ptr, hmax_ptr, hcnt_ptr, lim_ptr, cand_ptr,
                      out_ptr, mid_ptr, kexp_ptr, hexp_ptr, Hkv, G, C, D: tl.constexpr, BLOCK_C: tl.constexpr,
                      REDUCE_MAX: tl.constexpr, HAS_HOST: tl.constexpr, HAS_LIMIT: tl.constexpr,
                      CENTROID: tl.constexpr, FILL: tl.constexpr, MID: tl.constexpr = False,
                      CODES: tl.constexpr = False, PDL: tl.constexpr = False):
        """One (row r, kv head h, BLOCK_C candidates): bound of each of the G query heads of h,
        summed (quest) or maxed (quest-max) over them; pages with no rows score +inf. HAS_LIMIT:
        columns at or past lim[r] are neither read nor written. CENTROID: kmin / hmin hold the
        pages' key sums instead, and the score is the group's summed q . the page's mean key
        (kmax / hmax are not read). FILL: every column is written, -inf where cand[r, c] < 0 or
        past the limit (the scores top-k reads as they are). MID (with the bound): also the
        group's summed q . (kmin + kmax) / 2 into mid_ptr, from the same loads. CODES: kmin / kmax
        (and hmin / hmax) are 8-bit codes of 2^e units, e per (page, kv head) at kexp_ptr / hexp_ptr
        (kv/summaries.py): each page's sums over codes, times its 2^e. PDL: kernels/pdl.py."""
        wait_before_reads(PDL)  # the step's summaries, q and tables: after the kernel before
        r = tl.program_id(0)
        h = tl.program_id(1)
        c0 = tl.program_id(2) * BLOCK_C
        n = C
        if HAS_LIMIT:
            n = tl.minimum(tl.load(lim_ptr + r).to(tl.int32), C)
        c = c0 + tl.arange(0, BLOCK_C)
        dst = out_ptr + (r * Hkv + h).to(tl.int64) * C + c
        mdst = mid_ptr + (r * Hkv + h).to(tl.int64) * C + c
        if c0 >= n:  # a captured step scores the whole table width; most of it lies past the context
            if FILL:
                tl.store(dst, tl.full([BLOCK_C], float("-inf"), tl.float32), mask=c < C)
                if MID:
                    tl.store(mdst, tl.full([BLOCK_C], float("-inf"), tl.float32), mask=c < C)
            return
        d = tl.arange(0, D)
        cm = c < n
        ids = tl.load(ids_ptr + r.to(tl.int64) * C + c, mask=cm, other=0).to(tl.int64)
        dev = cm & (ids >= 0)  # negative ids: host_ref(p) = -1 - p, in the host tier's summaries
        rows = (ids * Hkv + h)[:, None] * D + d[None, :]
        kmin = tl.load(kmin_ptr + rows, mask=dev[:, None], other=0)  # [BLOCK_C, D], as stored
        if not CENTROID:
            kmax = tl.load(kmax_ptr + rows, mask=dev[:, None], other=0)
        cnt = tl.load(cnt_ptr + ids, mask=dev, other=0)
        if CODES:
            ex = tl.load(kexp_ptr + ids * Hkv + h, mask=dev, other=0).to(tl.int32)
        if HAS_HOST:
            hid = -1 - ids
            hm = cm & (ids < 0)
            hrows = (hid * Hkv + h)[:, None] * D + d[None, :]
            kmin = tl.where(hm[:, None], tl.load(hmin_ptr + hrows, mask=hm[:, None], other=0), kmin)
            if not CENTROID:
                kmax = tl.where(hm[:, None], tl.load(hmax_ptr + hrows, mask=hm[:, None], other=0), kmax)
            cnt = tl.where(hm, tl.load(hcnt_ptr + hid, mask=hm, other=0), cnt)
            if CODES:
                ex = tl.where(hm, tl.load(hexp_ptr + hid * Hkv + h, mask=hm, other=0).to(tl.int32), ex)
        kmin = kmin.to(tl.float32)  # after the tiers' select: one conversion a value
        if not CENTROID:
            kmax = kmax.to(tl.float32)
        q_row = q_ptr + (r * Hkv + h).to(tl.int64) * G * D
        if CENTROID:  # (sum_g q_g) . (ksum / count)
            qs = tl.zeros([D], tl.float32)
            for g in range(0, G):
                qs += tl.load(q_row + g * D + d).to(tl.float32)
            acc = tl.sum(kmin * qs[None, :], axis=1) / tl.maximum(cnt, 1).to(tl.float32)
        elif REDUCE_MAX:  # max over the group of sum_d max(q_d min_d, q_d max_d) = q+ . max + q- . min
            acc = tl.full([BLOCK_C], float("-inf"), tl.float32)
            qs = tl.zeros([1, D], tl.float32)  # the group's summed q: MID's only
            for g in range(0, G):
                qv = tl.load(q_row + g * D + d).to(tl.float32)[None, :]  # [1, D]
                acc = tl.maximum(acc, tl.sum(tl.maximum(qv, 0.0) * kmax + tl.minimum(qv, 0.0) * kmin, axis=1))
                if MID:
                    qs += qv
        else:
            # The group's summed bound, sum_g sum_d max(q_gd min_d, q_gd max_d), is (as min <= max)
            # sum_d (sum_g q_gd+) max_d + (sum_g q_gd-) min_d: the group's positive and negative
            # parts summed first, two FMAs a summary value instead of four ops per query head (the
            # launch was bound by its instruction issue, not its loads: ~900 SASS instructions a
            # thread at a 2048 tile, G = 4)
            qp = tl.zeros([D], tl.float32)
            qn = tl.zeros([D], tl.float32)
            for g in range(0, G):
                qv = tl.load(q_row + g * D + d).to(tl.float32)  # [D]
                qp += tl.maximum(qv, 0.0)
                qn += tl.minimum(qv, 0.0)
            acc = tl.sum(qp[None, :] * kmax + qn[None, :] * kmin, axis=1)
            qs = (qp + qn)[None, :]
        if not CENTROID:
            if CODES:  # the sums over codes, in 2^e units (2^e > 0: the max commutes with it)
                acc = acc * _pow2(ex)
            if MID:
                mid = tl.sum((kmin + kmax) * qs, axis=1) * 0.5
                if CODES:
                    mid = mid * _pow2(ex)
                _store_scores(mdst, mid, cnt, cand_ptr, r, c, cm, C, FILL)
        _store_scores(dst, acc, cnt, cand_ptr, r, c, cm, C, FILL)


    NO_KEY = tl.constexpr(-(1 << 63))  # below every column's key: padding past the last column

    NO_BITS = tl.constexpr(-(1 << 31))  # below every score's `_score_bits` (-inf's included)

    @triton.jit
    def _score_bits(s):
        """fp32 scores -> int32 in the same order: the bits, a negative float's magnitude bits flipped."""
        b = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)  # -0.0 ties +0.0, as in a sort
        return tl.where(b < 0, b ^ 0x7FFFFFFF, b)

    @triton.jit
    def _column_keys(s, c):
        """fp32 scores s, columns c -> int64 keys whose order is (score, then the lower column):
        the score's `_score_bits` above the column's complement."""
        low = tl.full([], 0xFFFFFFFF, tl.int64)
        return (_score_bits(s).to(tl.int64) << 32) | (low - c.to(tl.int64))

    @triton.jit
    def _live_columns(live_ptr, rh, H, C, HAS_LIVE: tl.constexpr):
        """Columns of row-head rh that may hold a pick: min(live[rh // H], C), or C without `live`."""
        n = C
        if HAS_LIVE:
            n = tl.minimum(tl.load(live_ptr + rh // H).to(tl.int32), C)
        return n

    @triton.jit
    def _store_picks(top, out_ptr, exc_ptr, rh, K, C, OUT_STRIDE, KP: tl.constexpr, EXCLUDE: tl.constexpr):
        """Row-head rh's best keys `top` [KP] (sorted) -> its first K columns at out_ptr + rh *
        OUT_STRIDE, -1 for a key at -inf or padding (NO_KEY); EXCLUDE: -inf written at each pick's
        column of another [rows x H, C] score table (exc_ptr), so that a later top-k skips them."""
        low = tl.full([], 0xFFFFFFFF, tl.int64)
        col = low - (top & low)
        live = (top >> 32) > -0x7F800001  # above -inf's key (0x807FFFFF as a signed int32) and NO_KEY
        j = tl.arange(0, KP)
        tl.store(out_ptr + rh.to(tl.int64) * OUT_STRIDE + j, tl.where(live, col, -1), mask=j < K)
        if EXCLUDE:
            tl.store(exc_ptr + rh.to(tl.int64) * C + col, tl.full([KP], float("-inf"), tl.float32),
                     mask=(j < K) & live)

    @triton.jit(do_not_specialize=["H", "C", "NCH"])
    def _topk_chunk_kernel(s_ptr, live_ptr, out_ptr, H, C, NCH, CH: tl.constexpr, KP: tl.constexpr,
                           HAS_LIVE: tl.constexpr, PDL: tl.constexpr = False):
        """One (row-head rh, chunk of CH columns): the chunk's KP best keys, sorted. Columns at or
        past live[rh // H] score -inf unread; a chunk wholly past it writes its first KP columns'
        -inf keys without sorting (a captured step's table is mostly past the context)."""
        wait_before_reads(PDL)
        rh = tl.program_id(0)
        ch = tl.program_id(1)
        c0 = ch * CH
        n = _live_columns(live_ptr, rh, H, C, HAS_LIVE)
        dst = out_ptr + (rh.to(tl.int64) * NCH + ch) * KP + tl.arange(0, KP)
        if c0 >= n:
            c = c0 + tl.arange(0, KP)
            key = _column_keys(tl.full([KP], float("-inf"), tl.float32), c)
            tl.store(dst, tl.where(c < C, key, NO_KEY))
            return
        c = c0 + tl.arange(0, CH)
        s = tl.load(s_ptr + rh.to(tl.int64) * C + c, mask=c < n, other=float("-inf"))
        key = tl.where(c < C, _column_keys(s, c), NO_KEY)
        tl.store(dst, tl.topk(key, KP))

    @triton.jit(do_not_specialize=["NCH", "K", "H", "C", "CH", "OUT_STRIDE"])
    def _topk_merge_kernel(key_ptr, live_ptr, out_ptr, exc_ptr, NCH, K, H, C, CH, OUT_STRIDE, KP: tl.constexpr,
                           NP: tl.constexpr, GROUP: tl.constexpr, EXCLUDE: tl.constexpr = False,
                           PDL: tl.constexpr = False):
        """One row-head: the K best of its chunks' keys -> columns, best first, at out_ptr + rh *
        OUT_STRIDE; a pick whose score is -inf comes back as column -1. All NCH chunks' keys in one
        sort of NP, except (GROUP > 0, which takes live_ptr) where at most GROUP chunks hold a
        column below live[rh // H]: then only theirs, one sort of GROUP * KP (past live every key
        is -inf: those picks are -1 either way). EXCLUDE: -inf written at each pick's column of
        another [rows x H, C] score table (exc_ptr), so that a later top-k over it skips them."""
        wait_before_reads(PDL)
        rh = tl.program_id(0)
        base = key_ptr + rh.to(tl.int64) * NCH * KP
        n = NCH
        if GROUP > 0:
            lv = _live_columns(live_ptr, rh, H, C, True)
            n = tl.maximum(tl.minimum((lv + CH - 1) // CH, NCH), 1)
        if GROUP > 0 and n <= GROUP:
            g = tl.arange(0, GROUP * KP)
            top = tl.topk(tl.load(base + g, mask=g < n * KP, other=NO_KEY), KP)
        else:
            i = tl.arange(0, NP)
            top = tl.topk(tl.load(base + i, mask=i < NCH * KP, other=NO_KEY), KP)
        _store_picks(top, out_ptr, exc_ptr, rh, K, C, OUT_STRIDE, KP, EXCLUDE)

    @triton.jit
    def _filter_scores(s_ptr, rh, c, n, C):
        """Scores of columns c of row-head rh of an [RH, C] table, -inf at or past n (unread)."""
        return tl.load(s_ptr + rh.to(tl.int64) * C + c, mask=c < n, other=float("-inf"))

    @triton.jit
    def _filter_keys(s_ptr, rh, c, n, C):
        """Keys (`_column_keys`) of columns c of row-head rh; NO_KEY where the score is -inf (or
        NaN) and at or past n."""
        s = _filter_scores(s_ptr, rh, c, n, C)
        return tl.where(s > float("-inf"), _column_keys(s, c), NO_KEY)

    @triton.jit
    def _kth_best(top, KT, KTP: tl.constexpr):
        """The KT-th of KTP maxima sorted best first (NO_BITS past KTP)."""
        return tl.max(tl.where(tl.arange(0, KTP) == KT - 1, top, NO_BITS), axis=0)

    @triton.jit
    def _maxima_threshold(row, nm, KT, TP: tl.constexpr, KTP: tl.constexpr):
        """The KT-th best of the nm maxima at row (NO_BITS where fewer than KT are above -inf), TP
        at a time into a running best (.cg: maxima another program of the grid may have written)."""
        top = tl.full([KTP], NO_BITS, tl.int32)
        for m0 in range(0, nm, TP):
            i = m0 + tl.arange(0, TP)
            mx = tl.load(row + i, mask=i < nm, other=NO_BITS, cache_modifier=".cg")
            top = tl.topk(tl.reshape(tl.join(top, tl.topk(mx, KTP)), (2 * KTP,)), KTP)
        return _kth_best(top, KT, KTP)

    @triton.jit(do_not_specialize=["H", "C", "M", "KT", "NCH", "RH"])
    def _topk_max_kernel(s_ptr, live_ptr, max_ptr, state_ptr, thr_ptr, cmax_ptr, H, C, M, KT, NCH, RH, MC,
                         CH: tl.constexpr, SUB: tl.constexpr, TP: tl.constexpr, KTP: tl.constexpr,
                         HAS_LIVE: tl.constexpr, COARSE: tl.constexpr = False, G: tl.constexpr = 1,
                         PDL: tl.constexpr = False):
        """The filtered top-k's first pass, one (row-head rh, chunk of CH columns): the best score
        of each SUB live columns, as `_score_bits`, -> max_ptr[rh, :M] int32 (NO_BITS where none is
        above -inf). Each program then takes a ticket (state_ptr[rh]); the last of the row-head's
        NCH takes the KT-th best of its live maxima, -> thr_ptr[rh], and sets the ticket and the
        candidate count (state_ptr[RH + rh]) back to 0 for the second pass and the next call.
        COARSE: no ticket; chunk 0 zeroes the count, and each program also writes the best of each G
        of its maxima -> cmax_ptr[rh, :MC] (the second pass takes its own threshold from them)."""
        wait_before_reads(PDL)
        rh = tl.program_id(0)
        ch = tl.program_id(1)
        n = _live_columns(live_ptr, rh, H, C, HAS_LIVE)
        row = max_ptr + rh.to(tl.int64) * M
        if COARSE and ch == 0:
            tl.store(state_ptr + RH + rh, 0)
        if ch * CH < n:
            s = _filter_scores(s_ptr, rh, ch * CH + tl.arange(0, CH), n, C)
            bits = tl.where(s > float("-inf"), _score_bits(s), NO_BITS)
            j = ch * (CH // SUB) + tl.arange(0, CH // SUB)
            fine = tl.max(tl.reshape(bits, (CH // SUB, SUB)), axis=1)
            tl.store(row + j, fine, mask=j < M)
            if COARSE:
                jc = ch * (CH // (SUB * G)) + tl.arange(0, CH // (SUB * G))
                tl.store(cmax_ptr + rh.to(tl.int64) * MC + jc, tl.max(tl.reshape(fine, (CH // (SUB * G), G)), axis=1),
                         mask=jc < MC)
        if not COARSE:
            tl.debug_barrier()  # every thread's maxima stored before the ticket releases them
            if tl.atomic_add(state_ptr + rh, 1, sem="acq_rel") == NCH - 1:
                tl.store(thr_ptr + rh, _maxima_threshold(row, tl.minimum((n + SUB - 1) // SUB, M), KT, TP, KTP))
                tl.store(state_ptr + rh, 0)
                tl.store(state_ptr + RH + rh, 0)

    @triton.jit(do_not_specialize=["H", "C", "M", "KT"])
    def _topk_filter_kernel(s_ptr, live_ptr, thr_ptr, max_ptr, cnt_ptr, cand_ptr, H, C, M, KT, CH: tl.constexpr,
                            CAP: tl.constexpr, HAS_LIVE: tl.constexpr, COARSE: tl.constexpr = False,
                            SUB: tl.constexpr = 16, G: tl.constexpr = 1, GR: tl.constexpr = 2,
                            KTP: tl.constexpr = 2, PDL: tl.constexpr = False):
        """The second pass, one (row-head rh, chunk of CH columns): the keys of the chunk's scores
        >= T (and above -inf) appended to the row-head's candidates cand_ptr[rh, :CAP] (the count
        at cnt_ptr[rh] goes on past CAP: the pick pass then takes it from there). T = thr_ptr[rh];
        COARSE: the KT-th best of the row-head's live coarse maxima (max_ptr[rh, :M], each the best
        of G sub-blocks; GR a power of two >= M; each program alike). KT sub-blocks (groups) hold a
        score >= T, so the KT best scores are all >= T; at most KT x SUB are (KT x SUB x G:
        COARSE), but for ties at T."""
        wait_before_reads(PDL)
        rh = tl.program_id(0)
        ch = tl.program_id(1)
        n = _live_columns(live_ptr, rh, H, C, HAS_LIVE)
        if ch * CH >= n:
            return
        if COARSE:
            nm = tl.minimum((n + SUB * G - 1) // (SUB * G), M)
            i = tl.arange(0, GR)
            grouped = tl.load(max_ptr + rh.to(tl.int64) * M + i, mask=i < nm, other=NO_BITS)
            t = _kth_best(tl.topk(grouped, KTP), KT, KTP)
        else:
            t = tl.load(thr_ptr + rh)
        c = ch * CH + tl.arange(0, CH)
        s = _filter_scores(s_ptr, rh, c, n, C)
        keep = (s > float("-inf")) & (_score_bits(s) >= t)
        key = _column_keys(s, c)
        k32 = keep.to(tl.int32)
        pos = tl.atomic_add(cnt_ptr + rh, tl.sum(k32, axis=0)) + tl.cumsum(k32, axis=0) - 1
        tl.store(cand_ptr + rh.to(tl.int64) * CAP + pos, key, mask=keep & (pos < CAP))

    @triton.jit
    def _sorted_candidates(base, m, N: tl.constexpr, KP: tl.constexpr):
        """The KP best of the m (<= N) candidate keys at base."""
        i = tl.arange(0, N)
        return tl.topk(tl.load(base + i, mask=i < m, other=NO_KEY, cache_modifier=".cg"), KP)

    @triton.jit
    def _regather(s_ptr, rh, n, C, t, base, CAP: tl.constexpr, TILE: tl.constexpr):
        """The keys of row-head rh's live scores >= t (above -inf) written to base[:CAP] in column
        order, TILE columns at a time -> how many there are (past CAP: not all written)."""
        m = 0
        for c0 in range(0, n, TILE):
            c = c0 + tl.arange(0, TILE)
            s = _filter_scores(s_ptr, rh, c, n, C)
            keep = (s > float("-inf")) & (_score_bits(s) >= t)
            k32 = keep.to(tl.int32)
            pos = m + tl.cumsum(k32, axis=0) - 1
            tl.store(base + pos, _column_keys(s, c), mask=keep & (pos < CAP))
            m += tl.sum(k32, axis=0)
        tl.debug_barrier()  # every thread's keys stored before any thread sorts them
        return m

    @triton.jit(do_not_specialize=["K", "H", "C", "OUT_STRIDE", "M"])
    def _topk_pick_kernel(s_ptr, live_ptr, cnt_ptr, cand_ptr, out_ptr, exc_ptr, max_ptr, K, H, C, OUT_STRIDE, M,
                          KP: tl.constexpr, SMALL: tl.constexpr, MID: tl.constexpr, CAP: tl.constexpr,
                          TILE: tl.constexpr, HAS_LIVE: tl.constexpr, EXCLUDE: tl.constexpr = False,
                          COARSE: tl.constexpr = False, SUB: tl.constexpr = 16, TP: tl.constexpr = 2,
                          PDL: tl.constexpr = False):
        """The last pass, one row-head: the K best of its candidates -> columns, best first, as
        `_topk_merge_kernel` writes them (-1 for none; EXCLUDE alike). One sort of SMALL, MID or
        CAP keys. Past CAP candidates: COARSE, the fine threshold (the K-th best of the SUB-column
        maxima, TP at a time) and the row gathered again by it (at most K x SUB keys but for
        ties); still past CAP (ties at the threshold, or a CAP set below K x SUB), the whole row a
        TILE at a time into a running best."""
        wait_before_reads(PDL)
        rh = tl.program_id(0)
        m = tl.load(cnt_ptr + rh)
        base = cand_ptr + rh.to(tl.int64) * CAP
        if m <= SMALL:
            top = _sorted_candidates(base, m, SMALL, KP)
        elif m <= MID:
            top = _sorted_candidates(base, m, MID, KP)
        elif m <= CAP:
            top = _sorted_candidates(base, m, CAP, KP)
        else:
            n = _live_columns(live_ptr, rh, H, C, HAS_LIVE)
            if COARSE:
                t = _maxima_threshold(max_ptr + rh.to(tl.int64) * M, tl.minimum((n + SUB - 1) // SUB, M), K, TP, KP)
                m = _regather(s_ptr, rh, n, C, t, base, CAP, TILE)
            if m <= CAP:
                top = _sorted_candidates(base, m, CAP, KP)
            else:
                top = tl.full([KP], NO_KEY, tl.int64)
                for c0 in range(0, n, TILE):
                    tile = tl.topk(_filter_keys(s_ptr, rh, c0 + tl.arange(0, TILE), n, C), KP)
                    top = tl.topk(tl.reshape(tl.join(top, tile), (2 * KP,)), KP)
        _store_picks(top, out_ptr, exc_ptr, rh, K, C, OUT_STRIDE, KP, EXCLUDE)

    @triton.jit(do_not_specialize=["Hkv", "C", "F", "K"])
    def _assemble_kernel(top_ptr, cidx_ptr, cids_ptr, fidx_ptr, fids_ptr, topk_ptr, idx_ptr, ids_ptr, Hkv, C, F, K,
                         BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """One (row r, kv head h): list entries 0 .. F-1 are the row's fixed pages, F .. F+K-1 its
        top-k candidates (top: candidate columns); page index -1 where an entry reads nothing."""
        wait_before_reads(PDL)
        r = tl.program_id(0)
        h = tl.program_id(1)
        rh = r * Hkv + h
        n_sel = F + K
        kr = tl.load(topk_ptr + r)
        for j0 in range(0, n_sel, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            fixed = j < F
            cand = (j >= F) & (j < n_sel)
            fi = tl.load(fidx_ptr + r * F + j, mask=fixed, other=-1)
            fid = tl.load(fids_ptr + r * F + j, mask=fixed, other=0)
            t = tl.load(top_ptr + rh.to(tl.int64) * K + (j - F), mask=cand, other=-1)
            ci = tl.load(cidx_ptr + r.to(tl.int64) * C + t, mask=cand & (t >= 0), other=-1)
            cid = tl.load(cids_ptr + r.to(tl.int64) * C + t, mask=cand & (t >= 0), other=0)
            idx = tl.where(fixed, fi, tl.where((j - F < kr) & (ci >= 0), ci, -1))
            out = rh.to(tl.int64) * n_sel + j
            tl.store(idx_ptr + out, idx, mask=j < n_sel)
            tl.store(ids_ptr + out, tl.where(fixed, fid, cid), mask=j < n_sel)

    @triton.jit(do_not_specialize=["T", "Hkv", "S"])
    def _summary_rows_kernel(slot_ptr, k_ptr, kmin_ptr, kmax_ptr, ksum_ptr, cnt_ptr, kexp_ptr, stride_kt, T, Hkv, S,
                             D: tl.constexpr, HAS_SUM: tl.constexpr = True, CODES: tl.constexpr = False,
                             PDL: tl.constexpr = False):
        """Row t, kv head h of a step writing at most one row a page: fold key k[t, h] into its
        page's summaries (a row 0 starts the page over; HAS_SUM False: no key sums kept; CODES: 8-bit
        kmin / kmax codes at the exponent kexp, raised to cover the new row, kv/summaries.py)."""
        wait_before_reads(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        page = slot // S
        first = slot % S == 0
        d = tl.arange(0, D)
        x = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * D + d).to(tl.float32)
        row = (page * Hkv + h) * D + d
        if CODES:  # the page's exponent rises to cover x; its codes shift to it (floor / ceil)
            ex = _exponent(tl.max(tl.abs(x), axis=0))
            eo = tl.load(kexp_ptr + page * Hkv + h).to(tl.int32)
            en = tl.where(first, ex, tl.maximum(eo, ex))
            sh = tl.minimum(en - eo, 31)
            lo = tl.load(kmin_ptr + row).to(tl.int32) >> sh
            hi = -((-tl.load(kmax_ptr + row).to(tl.int32)) >> sh)
            inv = _pow2(-en)
            xl = tl.floor(x * inv).to(tl.int32)
            xh = tl.ceil(x * inv).to(tl.int32)
            tl.store(kmin_ptr + row, tl.where(first, xl, tl.minimum(lo, xl)).to(tl.int8))
            tl.store(kmax_ptr + row, tl.where(first, xh, tl.maximum(hi, xh)).to(tl.int8))
            tl.store(kexp_ptr + page * Hkv + h, en.to(tl.int8))
        else:  # fp32 or (CUDA, 16-bit keys) the keys' dtype: math in fp32, the store rounds
            kmin = tl.load(kmin_ptr + row).to(tl.float32)
            kmax = tl.load(kmax_ptr + row).to(tl.float32)
            tl.store(kmin_ptr + row, tl.where(first, x, tl.minimum(kmin, x)).to(kmin_ptr.dtype.element_ty))
            tl.store(kmax_ptr + row, tl.where(first, x, tl.maximum(kmax, x)).to(kmax_ptr.dtype.element_ty))
        if HAS_SUM:
            ksum = tl.load(ksum_ptr + row).to(tl.float32)
            tl.store(ksum_ptr + row, (tl.where(first, 0.0, ksum) + x).to(ksum_ptr.dtype.element_ty))
        if h == 0:
            tl.store(cnt_ptr + page, tl.where(first, 0, tl.load(cnt_ptr + page)) + 1)


# (kmin [P, Hkv, D], kmax [P, Hkv, D] (fp32 / bf16 / fp16), count [P] int32) of one layer of one tier;
# 8-bit summaries (kv/summaries.py): int8 kmin / kmax codes and a fourth, kexp [P, Hkv] int8
SummaryRows = tuple[torch.Tensor, ...]
# (ksum [P, Hkv, D] (fp32 / bf16 / fp16), count [P] int32) of one layer of one tier
CentroidRows = tuple[torch.Tensor, torch.Tensor]


def quest_scores(qg: torch.Tensor, dev: SummaryRows, cand_ids: torch.Tensor, reduce_max: bool = False,
                 host: SummaryRows | None = None, limit: torch.Tensor | None = None,
                 cand_idx: torch.Tensor | None = None, midrange: bool = False
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Quest bounds of candidate pages, fused (layers/retrieval.py page_scores' quest / quest-max).

    qg: [R, Hkv, G, D] raw queries (any float dtype; the bounds in fp32); dev / host: one
    layer's summaries (kv/summaries.py) of the compute pool / host tier; cand_ids: [R, C] page
    ids (negative: host_ref, needs `host`); reduce_max: max over the G query heads (quest-max)
    instead of the sum (quest); limit: [R] int, row r's columns >= limit[r] are skipped (left
    unwritten: the caller masks them); cand_idx: [R, C], with it every column is written and
    those where cand_idx < 0 or past the limit score -inf (ready for top-k).
    -> [R, Hkv, C] fp32; +inf for pages with no rows (chosen first). No host synchronisation.
    midrange: also the `midrange` selector's scores from the same reads (the group's summed q .
    (kmin + kmax) / 2), masked alike: -> (bounds, midrange scores).
    """
    out = _launch_scores(qg, dev, cand_ids, host, limit, cand_idx, reduce_max=reduce_max, centroid=False,
                         midrange=midrange)
    return out if midrange else out[0]


def centroid_scores(qg: torch.Tensor, dev: CentroidRows, cand_ids: torch.Tensor, host: CentroidRows | None = None,
                    limit: torch.Tensor | None = None, cand_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The `centroid` selector's scores, fused like quest_scores: per kv head, the group's summed
    query . each candidate page's mean key (its key sum / its row count). dev / host: one layer's
    (ksum [P, Hkv, D], count [P] int32); the other arguments and the result as quest_scores."""
    return _launch_scores(qg, dev, cand_ids, host, limit, cand_idx, reduce_max=False, centroid=True)[0]


def assemble_lists(top: torch.Tensor, cand_idx: torch.Tensor, cand_ids: torch.Tensor, fixed_idx: torch.Tensor,
                   fixed_ids: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-(row, kv head) page lists of a selection, in one launch.

    top: [R, Hkv, K] candidate columns (top-k of the scores; -1: none); cand_idx / cand_ids: [R, C] each
    column's page index (-1: not a candidate) / page id; fixed_idx / fixed_ids: [R, F] the row's
    fixed pages (sink, window, pinned; -1: none); top_k: [R] candidates row r may take.
    -> (page_idx, page_ids) [R, Hkv, F + K] int64: the fixed entries, then the candidates; page
    index -1 where an entry reads nothing (no fixed page, past top_k[r], not a candidate).
    `assemble_lists_reference` is the same in PyTorch."""
    if not HAVE_TRITON:
        raise RuntimeError("assemble_lists needs Triton; use assemble_lists_reference on CPU")
    r, hkv, k = top.shape
    f, c = fixed_idx.shape[1], cand_idx.shape[1]
    idx = torch.empty((r, hkv, f + k), dtype=torch.int64, device=top.device)
    ids = torch.empty_like(idx)
    if r and f + k:
        _assemble_kernel[(r, hkv)](top.contiguous(), cand_idx.contiguous(), cand_ids.contiguous(),
                                   fixed_idx.contiguous(), fixed_ids.contiguous(), top_k.contiguous(), idx, ids, hkv,
                                   c, f, k, BLOCK=min(128, triton.next_power_of_2(f + k)), num_warps=1,
                                   **pdl.launch_args(top.device))
    return idx, ids


def topk_columns(scores: torch.Tensor, k: int, live: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 exclude: torch.Tensor | None = None) -> torch.Tensor:
    """The k best columns of each score row, best first, in two launches: every chunk of
    TOPK_CHUNK columns sorts its own best keys (many programs over a long row, where torch.topk
    runs one block a row: 63 us for 16K columns x 8 heads on an H100), then one program a row
    merges the chunks' picks. (TOPK_FILTER: three launches by a threshold, `_topk_filtered`.)

    scores: [R, H, C] fp32; live: [R] int, row r's columns at or past live[r] score -inf without
    being read. -> [R, H, k] int64 columns; ties go to the lower column; a pick scoring -inf is
    -1, so a caller that masked pages out with -inf never gets one back, even where a row
    has fewer than k others. out: [R, H, k] int64, written instead of a new tensor (a slice of
    a wider list whose rows are H x out.stride(1) apart: a hybrid's halves into one list);
    exclude: [R, H, C] fp32 contiguous, -inf written at every pick (not -1) from the same launch
    (a hybrid's second scores lose the first half's picks). `topk_columns_reference` is the same
    in PyTorch. No host sync."""
    if not HAVE_TRITON:
        raise RuntimeError("topk_columns needs Triton; use topk_columns_reference on CPU")
    r, h, c = scores.shape
    if not 0 <= k <= c:
        raise ValueError(f"topk_columns: k = {k} must be within 0 .. {c} columns")
    out = _topk_out(out, r, h, k, scores.device)
    if exclude is not None and (exclude.shape != scores.shape or exclude.dtype != torch.float32
                                or not exclude.is_contiguous()):
        raise ValueError(f"topk_columns: exclude must be a contiguous fp32 {tuple(scores.shape)} table")
    if r * h == 0 or k == 0:
        return out
    kp = max(2, triton.next_power_of_2(k))  # k = 1 as a one-key tl.topk failed on an H100 (untraced)
    s = scores.contiguous()
    lv = live.contiguous() if live is not None else s  # (a placeholder without `live`)
    if TOPK_FILTER and kp <= TOPK_FILTER_MAX_K:
        _topk_filtered(s, k, kp, lv, live is not None, out, exclude)
        return out
    ch = max(TOPK_CHUNK, TOPK_CHUNK_PICKS * kp, triton.next_power_of_2(triton.cdiv(c, TOPK_MAX_CHUNKS)))
    nch = triton.cdiv(c, ch)
    keys = torch.empty((r * h, nch, kp), dtype=torch.int64, device=scores.device)
    _topk_chunk_kernel[(r * h, nch)](s, lv, keys, h, c, nch, CH=ch, KP=kp, HAS_LIVE=live is not None,
                                     num_warps=TOPK_CHUNK_WARPS, **pdl.launch_args(s.device))
    group = TOPK_MERGE_GROUP if 0 < TOPK_MERGE_GROUP < nch and live is not None else 0
    np_ = triton.next_power_of_2(nch) * kp
    _topk_merge_kernel[(r * h,)](keys, lv if group else keys, out,
                                 exclude if exclude is not None else s, nch, k, h, c, ch, out.stride(1), KP=kp,
                                 NP=np_, GROUP=group, EXCLUDE=exclude is not None,
                                 num_warps=min(16, max(4, np_ // TOPK_MERGE_KEYS_PER_WARP)),
                                 **pdl.launch_args(s.device))
    return out


def filter_sizes(c: int, kp: int) -> dict[str, int]:
    """`_topk_filtered`'s launch sizes for a row of c columns and kp (a power of two) picks: the
    sub-block width `sub`, its maxima `m` a row, chunks `ch` columns wide (`nch` a row), the sorts
    `small` / `mid` / `cap` (the buffer), the threshold's maxima a step `tp`, and COARSE's maxima a
    group `g`, groups `mc` a row and their sort `gr` (tools/sass_topk.py builds at these)."""
    sub = TOPK_FILTER_SUB
    m = triton.cdiv(c, sub)
    ch = max(TOPK_FILTER_CHUNK, sub)
    small = max(TOPK_FILTER_SMALL, kp)
    cap = max(TOPK_FILTER_CAP or kp * sub, small)
    g = min(ch // sub, triton.next_power_of_2(triton.cdiv(m, TOPK_FILTER_COARSE_MAXIMA)))
    mc = triton.cdiv(c, sub * g)
    return dict(sub=sub, m=m, ch=ch, nch=triton.cdiv(c, ch), small=small, cap=cap,
                mid=min(max(TOPK_FILTER_MID, small), cap), tp=max(TOPK_FILTER_TILE, kp), g=g, mc=mc,
                gr=max(2, triton.next_power_of_2(mc)))


def _filter_counters(rh: int, device: torch.device) -> torch.Tensor:
    """[2, >= rh] int32 zeros: tickets, candidate counts. One buffer a device kept across calls
    (each call leaves its tickets at 0 and zeroes its counts before use) up to TOPK_FILTER_STATE
    row-heads; past it a new one a call."""
    if rh > TOPK_FILTER_STATE:
        return torch.zeros((2, rh), dtype=torch.int32, device=device)
    if device not in _filter_state:
        _filter_state[device] = torch.zeros((2, TOPK_FILTER_STATE), dtype=torch.int32, device=device)
    return _filter_state[device]


def _topk_filtered(s: torch.Tensor, k: int, kp: int, lv: torch.Tensor, has_live: bool, out: torch.Tensor,
                   exclude: torch.Tensor | None) -> None:
    """topk_columns by a threshold (TOPK_FILTER), three launches: each TOPK_FILTER_CHUNK columns'
    best score a TOPK_FILTER_SUB columns, and the row's threshold (the k-th best of them) from its
    last chunk program; the keys of every score at least the threshold, appended to a candidate
    buffer; one sort of the candidates (usually a few more than k) per row-head."""
    r, h, c = s.shape
    rh, z, dev = r * h, filter_sizes(c, kp), s.device
    state = _filter_counters(rh, dev)
    coarse = TOPK_FILTER_COARSE
    maxima = torch.empty((rh, z["m"]), dtype=torch.int32, device=dev)
    thr = maxima if coarse else torch.empty(rh, dtype=torch.int32, device=dev)  # (unread with COARSE)
    cmax = torch.empty((rh, z["mc"]), dtype=torch.int32, device=dev) if coarse else maxima  # (unread without)
    cand = torch.empty((rh, z["cap"]), dtype=torch.int64, device=dev)
    _topk_max_kernel[(rh, z["nch"])](s, lv, maxima, state, thr, cmax, h, c, z["m"], k, z["nch"], state.shape[1],
                                     z["mc"], CH=z["ch"], SUB=z["sub"], TP=z["tp"], KTP=kp, HAS_LIVE=has_live,
                                     COARSE=coarse, G=z["g"], num_warps=TOPK_FILTER_WARPS, **pdl.launch_args(dev))
    _topk_filter_kernel[(rh, z["nch"])](s, lv, thr, cmax, state[1], cand, h, c, z["mc"], k, CH=z["ch"], CAP=z["cap"],
                                        HAS_LIVE=has_live, COARSE=coarse, SUB=z["sub"], G=z["g"], GR=z["gr"],
                                        KTP=min(kp, z["gr"]), num_warps=TOPK_FILTER_WARPS, **pdl.launch_args(dev))
    _topk_pick_kernel[(rh,)](s, lv, state[1], cand, out, exclude if exclude is not None else s, maxima, k, h, c,
                             out.stride(1), z["m"], KP=kp, SMALL=z["small"], MID=z["mid"], CAP=z["cap"],
                             TILE=max(TOPK_FILTER_CHUNK, kp), HAS_LIVE=has_live, EXCLUDE=exclude is not None,
                             COARSE=coarse, SUB=z["sub"], TP=z["tp"], num_warps=TOPK_FILTER_WARPS,
                             **pdl.launch_args(dev))


def _topk_out(out: torch.Tensor | None, r: int, h: int, k: int, device: torch.device) -> torch.Tensor:
    """topk_columns' result tensor: a new [R, H, k] one, or `out` checked to be an int64 [R, H, k]
    view whose rows lie H x stride(1) apart with unit steps (a slice of a wider list)."""
    if out is None:
        return torch.empty((r, h, k), dtype=torch.int64, device=device)
    if out.shape != (r, h, k) or out.dtype != torch.int64 or (k > 1 and out.stride(2) != 1) \
            or (r > 1 and out.stride(0) != h * out.stride(1)):
        raise ValueError(f"topk_columns: out must be an int64 ({r}, {h}, {k}) view with rows h x stride(1) apart")
    return out


def topk_columns_reference(scores: torch.Tensor, k: int, live: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """topk_columns in PyTorch (same arguments, any device): a stable descending sort."""
    s = scores.float()
    if live is not None:
        s = s.masked_fill(torch.arange(s.shape[-1], device=s.device) >= live[:, None, None], float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
    top = torch.where(s.gather(-1, order) > float("-inf"), order, -1)
    if exclude is not None:
        hits = torch.zeros(exclude.shape, dtype=torch.int32, device=exclude.device)
        hits.scatter_add_(-1, top.clamp_min(0), (top >= 0).to(torch.int32))  # a -1 pick adds nothing
        exclude.masked_fill_(hits > 0, float("-inf"))
    if out is None:
        return top
    out.copy_(top)
    return out


def assemble_lists_reference(top: torch.Tensor, cand_idx: torch.Tensor, cand_ids: torch.Tensor,
                             fixed_idx: torch.Tensor, fixed_ids: torch.Tensor,
                             top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """assemble_lists in PyTorch (same arguments, any device)."""
    r, hkv, k = top.shape
    c, f = cand_idx.shape[1], fixed_idx.shape[1]
    top_idx = cand_idx[:, None, :].expand(r, hkv, c).gather(-1, top.clamp_min(0))
    top_idx = torch.where(top >= 0, top_idx, -1)
    top_ids = cand_ids[:, None, :].expand(r, hkv, c).gather(-1, top.clamp_min(0))
    # a row with fewer candidates than k (a captured step's short contexts) takes them all
    top_ok = (torch.arange(k, device=top.device) < top_k[:, None])[:, None, :] & (top_idx >= 0)
    idx = torch.cat([fixed_idx[:, None, :].expand(r, hkv, f), torch.where(top_ok, top_idx, -1)], dim=-1)
    ids = torch.cat([fixed_ids[:, None, :].expand(r, hkv, f), top_ids], dim=-1)
    return idx.long(), ids.long()


def update_summaries(kmin: torch.Tensor, kmax: torch.Tensor, ksum: torch.Tensor | None, count: torch.Tensor,
                     slots: torch.Tensor, k: torch.Tensor, page_size: int, kexp: torch.Tensor | None = None) -> None:
    """One layer's page summaries (kv/summaries.py: kmin / kmax / ksum [P, Hkv, D] fp32 or 16-bit (ksum
    None: none kept), count [P] int32) take new keys k [T, Hkv, D] at slots [T], for a step that writes at most one row a page
    (a decode step; padding rows sharing a scratch page leave that page's summaries undefined), in
    one launch; a row 0 starts its page over; kexp [P, Hkv] int8: kmin / kmax are 8-bit codes at
    these exponents (kv/summaries.py). PageSummaries.update's scatter path is the reference."""
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1 or k.stride(1) != d:
        k = k.contiguous()
    _summary_rows_kernel[(t, hkv)](slots, k, kmin, kmax, ksum if ksum is not None else kmin, count,
                                   kexp if kexp is not None else count, k.stride(0), t, hkv, page_size, D=d,
                                   HAS_SUM=ksum is not None, CODES=kexp is not None, num_warps=1,
                                   **pdl.launch_args(k.device))


def _launch_scores(qg: torch.Tensor, dev: tuple, cand_ids: torch.Tensor, host: tuple | None,
                   limit: torch.Tensor | None, cand_idx: torch.Tensor | None, reduce_max: bool,
                   centroid: bool, midrange: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """quest_scores / centroid_scores: one _quest_kernel launch (CENTROID: the summaries are
    (ksum, count), passed where kmin goes; kmax slots get placeholders the kernel never reads)
    -> (scores, midrange scores or None)."""
    if not HAVE_TRITON:
        raise RuntimeError("the score kernels need Triton; use their references on CPU")
    r, hkv, g, d = qg.shape
    if d & (d - 1) or cand_ids.dim() != 2 or cand_ids.shape[0] != r or dev[0].shape[1:] != (hkv, d):
        raise ValueError(f"page scores: qg {tuple(qg.shape)} / cand_ids {tuple(cand_ids.shape)} / summaries "
                         f"{tuple(dev[0].shape)} do not fit (head_dim a power of two)")
    if centroid:
        dev, host = (dev[0], dev[0], dev[1]), (host[0], host[0], host[1]) if host is not None else None
    c = cand_ids.shape[1]
    out = torch.empty((r, hkv, c), dtype=torch.float32, device=qg.device)
    mid = torch.empty_like(out) if midrange else None
    if r == 0 or c == 0:
        return out, mid
    codes = len(dev) == 4
    if host is not None and len(host) != len(dev):
        raise ValueError("page scores: the two tiers' summaries must both be 8-bit codes or neither")
    hmin, hmax, hcnt = host[:3] if host is not None else dev[:3]  # unused placeholders without a host tier
    kexp = dev[3] if codes else dev[2]  # placeholders without codes
    hexp = host[3] if codes and host is not None else kexp
    lim = limit.contiguous() if limit is not None else dev[2]  # placeholder without a limit
    cand = cand_idx.contiguous() if cand_idx is not None else cand_ids  # placeholder without one
    block_c = max(1, (SCORE_TILE_CODES if codes else SCORE_TILE) // d)
    _quest_kernel[(r, hkv, triton.cdiv(c, block_c))](
        qg.contiguous(), cand_ids.contiguous(), dev[0], dev[1], dev[2], hmin, hmax, hcnt, lim, cand, out,
        mid if mid is not None else out, kexp, hexp, hkv, g, c, D=d, BLOCK_C=block_c,
        REDUCE_MAX=reduce_max, HAS_HOST=host is not None, HAS_LIMIT=limit is not None, CENTROID=centroid,
        FILL=cand_idx is not None, MID=midrange, CODES=codes, num_warps=4, **pdl.launch_args(qg.device))
    return out, mid


def _candidate_rows(dev: tuple, host: tuple | None, cand_ids: torch.Tensor, i: int) -> torch.Tensor:
    """Summary field i of each candidate page, from the compute pool's or (negative ids) the host
    tier's summaries -> [R, C, ...]."""
    got = dev[i][cand_ids.clamp_min(0)]
    if host is None:
        return got
    other = host[i][(-1 - cand_ids).clamp_min(0)]
    return torch.where((cand_ids < 0).view(*cand_ids.shape, *([1] * (got.dim() - 2))), other, got)


def _candidate_bounds(dev: SummaryRows, host: SummaryRows | None, cand_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kmin, kmax [R, C, Hkv, D] fp32, count [R, C], scale [R, Hkv, C]) of the candidates: 8-bit
    summaries give their codes and 2^e (the kernel's sums run over codes), others a scale of 1."""
    kmin, kmax, cnt = (_candidate_rows(dev, host, cand_ids, i) for i in range(3))  # [R, C, Hkv, D] x 2, [R, C]
    if len(dev) == 4:
        from kvtier.kv.summaries import pow2
        scale = pow2(_candidate_rows(dev, host, cand_ids, 3).to(torch.int32)).transpose(1, 2)
    else:
        scale = torch.ones((), dtype=torch.float32, device=kmin.device)
    return kmin.float(), kmax.float(), cnt, scale


def quest_scores_reference(qg: torch.Tensor, dev: SummaryRows, cand_ids: torch.Tensor, reduce_max: bool = False,
                           host: SummaryRows | None = None) -> torch.Tensor:
    """quest_scores in PyTorch (same arguments): the bound by its definition, max(q_d min_d, q_d max_d)
    per channel (the kernel sums the group's positive and negative query parts first)."""
    kmin, kmax, cnt, scale = _candidate_bounds(dev, host, cand_ids)
    q = qg.float()[:, :, :, None, :]  # [R, Hkv, G, 1, D]
    bound = torch.maximum(q * kmin.permute(0, 2, 1, 3)[:, :, None], q * kmax.permute(0, 2, 1, 3)[:, :, None]).sum(-1)
    s = (bound.amax(2) if reduce_max else bound.sum(2)) * scale  # [R, Hkv, C]
    return s.masked_fill((cnt == 0)[:, None, :], float("inf"))


def midrange_scores_reference(qg: torch.Tensor, dev: SummaryRows, cand_ids: torch.Tensor,
                              host: SummaryRows | None = None) -> torch.Tensor:
    """quest_scores(midrange=True)'s second result in PyTorch (no limit): the group's summed q .
    each candidate page's (kmin + kmax) / 2."""
    kmin, kmax, cnt, scale = _candidate_bounds(dev, host, cand_ids)
    s = torch.einsum("rhd,rchd->rhc", qg.float().sum(2), (kmin + kmax) * 0.5) * scale
    return s.masked_fill((cnt == 0)[:, None, :], float("inf"))


def centroid_scores_reference(qg: torch.Tensor, dev: CentroidRows, cand_ids: torch.Tensor,
                              host: CentroidRows | None = None) -> torch.Tensor:
    """centroid_scores in PyTorch (same arguments, no limit)."""
    ksum, cnt = (_candidate_rows(dev, host, cand_ids, i) for i in range(2))  # [R, C, Hkv, D], [R, C]
    mean = ksum.float() / cnt.clamp_min(1).float()[..., None, None]
    s = torch.einsum("rhd,rchd->rhc", qg.float().sum(2), mean)
    return s.masked_fill((cnt == 0)[:, None, :], float("inf"))
