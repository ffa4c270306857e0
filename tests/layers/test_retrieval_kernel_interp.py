"""Retrieval decode kernel (kvtier/kernels/retrieval_attention.py) vs its PyTorch reference.

- under TRITON_INTERPRET=1 (CPU, tiny sizes; this file run as a script in a fresh process,
  tests/interp.py): every KV format, GQA 1 and 4, head_dim 64 and 128, odd context lengths,
  partial last pages, a ctx-0 row, per-kv-head lists in shuffled order with invalid entries
  (marked by `valid`, or by page_idx -1 with valid None), page 0 with and without a sink row,
  1 and 3 splits; the folded native domain for the rotating formats; quest_scores (fused Quest
  bounds, sum and max over the group, candidates in both tiers) vs its reference;
- on CPU, no Triton: the reference == RetrievalAttention's output over a real pool and its own
  selection (so kernel == reference == the backend's PyTorch path); quest_scores_reference ==
  layers/retrieval.py page_scores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if __package__ in (None, ""):  # run as a script by tests/interp.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.layers import paged_attention_cases as cases  # noqa: E402

# (format, gqa, page_size, head_dim, ctx lens, with_sink, quantized-format compute dtype, n_sel)
LENS = [23, 0, 9]  # odd lengths, partial last pages, a ctx-0 row
SINKS = [True, False, True]
SEL_CASES = [(name, gqa, 4, 64 if (i + gqa) % 2 else 128, LENS, SINKS,
              torch.float16 if i % 2 else torch.float32, 5)
             for i, name in enumerate(cases.FORMAT_NAMES) for gqa in (1, 4)]
SEL_CASES += [("k8v4", 2, 2, 64, [45, 5], [True, True], torch.float16, 12),
              # two 32-page tiles a list: the next tile's ids load under this one (PREFETCH_IDS)
              ("k8v4", 2, 4, 32, [300, 45], [True, True], torch.float32, 40)]
# (num_splits, with sinks, invalid entries as page_idx -1 instead of `valid`)
SEL_RUNS = ((1, True, False), (3, True, True), (1, False, True))
FOLD_FORMATS = ("int8", "k8v4")
# Lists naming alternate-source (host) pages by negative ids: (as SEL_CASES)
ALT_SEL_CASES = [("fp32", 2, 4, 64, [37, 19], [True, True], torch.float32, 6),
                 ("int8", 1, 4, 64, [41, 9], [True, False], torch.float16, 7),
                 ("k8v4", 2, 4, 128, [29, 30], [False, True], torch.float32, 5)]  # rotating, smoothed formats, folded (NativeDomain)


def main() -> None:
    """Every interpreter case (TRITON_INTERPRET=1 must be set before triton is imported)."""
    import kvtier.kernels.retrieval_attention as ra
    failures = []
    for i, (name, gqa, ps, hd, lens, sinks, qdt, n_sel) in enumerate(SEL_CASES):
        kv_heads = 1 if gqa == 4 else 2  # 4 query heads at most: the interpreter runs programs one by one
        case = cases.make_case(name, kv_heads, gqa, ps, hd, lens, sinks, cases.interp_dtype(name, qdt), "cpu",
                               seed=200 + i)
        sel = cases.make_selection(case, n_sel, seed=300 + i)
        for splits, use_sink, idx_only in SEL_RUNS:
            try:
                cases.check_selected(ra, case, sel, splits, use_sink, idx_only)
            except AssertionError as e:
                failures.append(f"{name} gqa={gqa} D={hd}: {e}")
    for i, (name, gqa, ps, hd, lens, sinks, qdt, n_sel) in enumerate(ALT_SEL_CASES):  # host pages: AltPages
        case = cases.make_case(name, 2, gqa, ps, hd, lens, sinks, cases.interp_dtype(name, qdt), "cpu", seed=800 + i)
        case, alt = cases.with_alt_pages(case, seed=900 + i)
        sel = cases.make_selection(case, n_sel, seed=1000 + i)
        for splits, use_sink, idx_only in SEL_RUNS:
            try:
                cases.check_selected(ra, case, sel, splits, use_sink, idx_only, alt=alt)
            except AssertionError as e:
                failures.append(f"{name} alt gqa={gqa} D={hd}: {e}")
    import kvtier.kernels.paged_attention as pa
    fold_max = pa.FOLD_MAX_SPLITS
    for i, name in enumerate(FOLD_FORMATS):
        case = cases.make_case(name, 2, 2, 4, 64, [21, 6], [True, False], torch.float32, "cpu", seed=400 + i)
        sel = cases.make_selection(case, 6, seed=500 + i)
        for splits in (1, 3):
            for pa.FOLD_MAX_SPLITS in (fold_max, 1):  # folded, then moved in launches of their own
                try:
                    cases.check_selected_native_fold(ra, case, sel, splits)
                except AssertionError as e:
                    failures.append(f"{name} folded (FOLD_MAX_SPLITS {pa.FOLD_MAX_SPLITS}): {e}")
    pa.FOLD_MAX_SPLITS = fold_max
    for i, (hkv, g, d, with_host) in enumerate(SCORE_CASES):
        try:
            check_quest_scores(ra, hkv, g, d, with_host, seed=600 + i)
        except AssertionError as e:
            failures.append(f"quest_scores Hkv={hkv} G={g} D={d} host={with_host}: {e}")
    base = ra.TOPK_CHUNK, ra.TOPK_CHUNK_PICKS, ra.TOPK_MERGE_GROUP
    filtered, ra.TOPK_FILTER = ra.TOPK_FILTER, False
    # the chunked path: the defaults, then chunks of 16 columns: many chunks, with few live ones
    # sorted alone or not
    for setting in (base, (16, 1, 2), (16, 1, 0)):
        ra.TOPK_CHUNK, ra.TOPK_CHUNK_PICKS, ra.TOPK_MERGE_GROUP = setting
        for i, case in enumerate(TOPK_CASES):
            try:
                check_topk(ra, *case, seed=1400 + i)
            except AssertionError as e:
                failures.append(f"topk_columns {case} (chunk, picks, merge group {setting}): {e}")
    ra.TOPK_CHUNK, ra.TOPK_CHUNK_PICKS, ra.TOPK_MERGE_GROUP = base
    ra.TOPK_FILTER = filtered
    failures += check_topk_filtered(ra)
    for i in range(3):
        try:
            check_assemble(ra, seed=1100 + i)
            check_update_summaries(ra, seed=1200 + i)
            check_update_summaries(ra, seed=1300 + i, dtype=torch.bfloat16)
            check_update_codes(ra, seed=1500 + i)
        except AssertionError as e:
            failures.append(f"selection glue (seed {i}): {e}")
    for i, (name, gqa, selector, bits) in enumerate(BACKEND_CASES):  # RetrievalAttention wired to the kernels
        try:
            check_backend_kernel(name, gqa, seed=700 + i, selector=selector, bits=bits)
        except AssertionError as e:
            failures.append(f"RetrievalAttention kernel {name} gqa={gqa} {selector} {bits}-bit summaries: {e}")
    print("\n".join(failures) if failures else "ALL OK")


# RetrievalAttention(kernel=True) vs its PyTorch path: (format, gqa, selector); int8 / k8v4 fold
# the stored domain into the kernel (raw q in), fp16 does not rotate; the hybrids score with the
# fused kernels (hybrid-mid: bound and midrange from one launch, no key sums kept).
# (format, gqa, selector, summary bits): 8, the int8 summaries (kv/summaries.py)
BACKEND_CASES = [("fp32", 2, "quest", 16), ("int8", 1, "quest", 16), ("k8v4", 4, "quest", 16),
                 ("fp16", 2, "quest", 16), ("fp32", 2, "hybrid", 16), ("fp32", 2, "hybrid-mid", 16),
                 ("k8v4", 2, "hybrid-mid", 8), ("fp32", 1, "quest-max", 8)]


def check_backend_kernel(name: str, gqa: int, seed: int, selector: str = "quest", bits: int = 16) -> None:
    dtype = torch.float16 if name == "fp16" else torch.float32
    args = (name, 2, gqa, 4, 64, [37, 30, 9, 53])
    kw = dict(budget=24, dtype=dtype, device="cpu", seed=seed, selector=selector, summary_bits=bits)
    ref = cases.retrieval_step(*args, kernel=False, **kw)
    got = cases.retrieval_step(*args, kernel=True, **kw)
    assert ref.q.shape[0] == 3 and torch.equal(ref.q, got.q)
    tol = 2e-3 if dtype == torch.float16 else 1e-4
    err = (got.out.float() - ref.out.float()).abs().max().item()
    assert err <= tol * max(ref.out.float().abs().max().item(), 1.0), f"max |kernel - torch| = {err:.3g}"


# quest_scores: (kv heads, query heads per kv head, head_dim, with a host tier)
SCORE_CASES = [(2, 1, 64, False), (1, 4, 128, True), (2, 3, 32, True)]


def _summaries(g: torch.Generator, pages: int, hkv: int, d: int) -> tuple[torch.Tensor, ...]:
    """(kmin, kmax, count) of random pages, a few of them empty (+-inf rows, count 0)."""
    a, b = torch.randn(2, pages, hkv, d, generator=g) * 2
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    count = torch.randint(1, 17, (pages,), generator=g, dtype=torch.int32)
    empty = torch.randperm(pages, generator=g)[:2]
    kmin[empty], kmax[empty], count[empty] = float("inf"), float("-inf"), 0
    return kmin, kmax, count


def check_quest_scores(ra, hkv: int, g: int, d: int, with_host: bool, seed: int) -> None:
    """quest_scores == its reference (sum and max over the group), candidates in both tiers."""
    gen = torch.Generator().manual_seed(seed)
    dev = _summaries(gen, 20, hkv, d)
    host = _summaries(gen, 9, hkv, d) if with_host else None
    ids = torch.randint(0, 20, (3, 37), generator=gen)  # 37: a partial last block of candidates
    if with_host:
        ids = torch.where(torch.rand(3, 37, generator=gen) < 0.4, -1 - torch.randint(0, 9, (3, 37), generator=gen), ids)
    qg = torch.randn(3, hkv, g, d, generator=gen)
    for reduce_max in (False, True):
        got = ra.quest_scores(qg, dev, ids, reduce_max, host)
        want = ra.quest_scores_reference(qg, dev, ids, reduce_max, host)
        assert torch.equal(got.isinf(), want.isinf()), f"max={reduce_max}: +inf (empty pages) differ"
        assert bool(got.isinf().any()), "no empty page among the candidates: vacuous"
        fin = ~want.isinf()
        assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-4), \
            f"max={reduce_max}: max |kernel - ref| = {(got[fin] - want[fin]).abs().max():.3g}"
        # a limit per row (a captured step's whole-width table): the columns before it are the same
        limit = torch.tensor([37, 5, 0])
        lim = ra.quest_scores(qg, dev, ids, reduce_max, host, limit=limit)
        for r, n in enumerate(limit.tolist()):
            assert torch.equal(lim[r, :, :n], got[r, :, :n]), f"max={reduce_max}: row {r} under limit {n}"
        # cand_idx: every column written, -inf off the candidates and past the limit; q in bf16
        cand = torch.where(torch.rand(3, 37, generator=gen) < 0.7, torch.arange(37), -1)
        filled = ra.quest_scores(qg.bfloat16(), dev, ids, reduce_max, host, limit=limit, cand_idx=cand)
        want_f = ra.quest_scores_reference(qg.bfloat16().float(), dev, ids, reduce_max, host)
        off = (cand < 0)[:, None, :] | (torch.arange(37)[None, None, :] >= limit[:, None, None])
        want_f = want_f.masked_fill(off, float("-inf"))
        assert torch.equal(filled.isinf() & (filled < 0), want_f.isinf() & (want_f < 0)), "filled -inf differ"
        fin = want_f.isfinite()
        assert torch.allclose(filled[fin], want_f[fin], rtol=1e-5, atol=1e-4), f"max={reduce_max}: filled scores"
    # the midrange scores from the same reads (hybrid-mid's fused launch): the bound unchanged
    limit = torch.tensor([37, 5, 0])
    for lim_, cand_ in ((None, None), (limit, cand)):
        bound, mid = ra.quest_scores(qg, dev, ids, False, host, limit=lim_, cand_idx=cand_, midrange=True)
        assert torch.equal(bound, ra.quest_scores(qg, dev, ids, False, host, limit=lim_, cand_idx=cand_)), \
            "midrange=True changed the bounds"
        want_m = ra.midrange_scores_reference(qg, dev, ids, host)
        if cand_ is not None:
            off = (cand_ < 0)[:, None, :] | (torch.arange(37)[None, None, :] >= lim_[:, None, None])
            want_m = want_m.masked_fill(off, float("-inf"))
        assert torch.equal(mid.isinf(), want_m.isinf()), "midrange: inf (empty / masked) differ"
        fin = want_m.isfinite()
        assert bool(fin.any()) and torch.allclose(mid[fin], want_m[fin], rtol=1e-5, atol=1e-4), \
            f"midrange: max |kernel - ref| = {(mid[fin] - want_m[fin]).abs().max():.3g}"
    # centroid_scores (the same kernel, key sums instead of min / max) == its reference
    ksum = (dev[0] + dev[1]).nan_to_num(0.0, 0.0, 0.0) * dev[2].float()[:, None, None]  # empty pages: 0
    cdev = (ksum, dev[2])
    chost = ((host[0] + host[1]).nan_to_num(0.0, 0.0, 0.0) * host[2].float()[:, None, None], host[2]) if host else None
    got = ra.centroid_scores(qg, cdev, ids, chost)
    want = ra.centroid_scores_reference(qg, cdev, ids, chost)
    assert torch.equal(got.isinf(), want.isinf()), "centroid: +inf (empty pages) differ"
    fin = ~want.isinf()
    assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-4), \
        f"centroid: max |kernel - ref| = {(got[fin] - want[fin]).abs().max():.3g}"
    lim = ra.centroid_scores(qg, cdev, ids, chost, limit=torch.tensor([37, 5, 0]))
    assert torch.equal(lim[1, :, :5], got[1, :, :5])
    # min / max (and, here, sums) held in bf16 (kv/summaries.py summary_dtype on CUDA): the kernel
    # reads them as the reference does (bf16 values, fp32 math)
    b16 = lambda rows: tuple(t.bfloat16() if t.is_floating_point() else t for t in rows) if rows else None  # noqa: E731
    for reduce_max in (False, True):
        got = ra.quest_scores(qg, b16(dev), ids, reduce_max, b16(host))
        want = ra.quest_scores_reference(qg, b16(dev), ids, reduce_max, b16(host))
        fin = ~want.isinf()
        assert torch.equal(got.isinf(), want.isinf()) and torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-4), \
            f"bf16 summaries, max={reduce_max}"
    got, want = ra.centroid_scores(qg, b16(cdev), ids, b16(chost)), ra.centroid_scores_reference(qg, b16(cdev), ids,
                                                                                                   b16(chost))
    fin = ~want.isinf()
    assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-4), "centroid, bf16 summaries"
    # 8-bit summaries (codes + a 2^e per page and kv head): the kernel == its reference, and both
    # bound the fp32 summaries' scores from above (outward rounding)
    c8, h8 = _codes(dev), _codes(host) if host else None
    for reduce_max in (False, True):
        got = ra.quest_scores(qg, c8, ids, reduce_max, h8)
        want = ra.quest_scores_reference(qg, c8, ids, reduce_max, h8)
        fin = ~want.isinf()
        assert torch.equal(got.isinf(), want.isinf()) and torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-3), \
            f"8-bit summaries, max={reduce_max}: max |kernel - ref| = {(got[fin] - want[fin]).abs().max():.3g}"
        exact = ra.quest_scores_reference(qg, dev, ids, reduce_max, host)
        assert bool((want[fin] >= exact[fin] - 1e-4).all()), f"8-bit bound below the exact one, max={reduce_max}"
    bound, mid = ra.quest_scores(qg, c8, ids, False, h8, limit=limit, cand_idx=cand, midrange=True)
    want_m = ra.midrange_scores_reference(qg, c8, ids, h8)
    off = (cand < 0)[:, None, :] | (torch.arange(37)[None, None, :] >= limit[:, None, None])
    want_m = want_m.masked_fill(off, float("-inf"))
    fin = want_m.isfinite()
    assert torch.equal(mid.isinf(), want_m.isinf()) and torch.allclose(mid[fin], want_m[fin], rtol=1e-5, atol=1e-3), \
        "8-bit summaries: midrange"


def _codes(rows: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """(kmin, kmax, count) fp32 -> 8-bit summaries (kmin, kmax codes, count, kexp), as
    PageSummaries.refresh encodes them (empty pages: zero codes)."""
    from kvtier.kv.summaries import encode_pages
    kmin, kmax, count = rows
    some = (count > 0)[:, None, None]
    lo, hi, e = encode_pages(torch.where(some, kmin, 0.0), torch.where(some, kmax, 0.0))
    return lo.to(torch.int8), hi.to(torch.int8), count, e.to(torch.int8)


# topk_columns: (rows, heads, columns, k); small enough for the interpreter, the second one
# across two chunks (TOPK_CHUNK = 1024), the third with k == columns
TOPK_CASES = [(2, 3, 37, 5), (1, 2, 1100, 40), (2, 1, 9, 9), (2, 2, 65, 1)]


def check_topk(ra, r: int, h: int, c: int, k: int, seed: int, device: str = "cpu") -> None:
    """topk_columns == topk_columns_reference (a stable sort): ties (rounded scores), +inf and -inf
    scores, rows cut short by `live` (one below k: its last picks are -1), and without `live`."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(r, h, c, generator=gen)
    s[:, :, ::3] = torch.round(s[:, :, ::3])  # many equal scores
    s[s < -1.5] = float("-inf")
    s[0, 0, 1] = float("inf")
    live = torch.randint(k, c + 1, (r,), generator=gen)
    live[-1] = k // 2  # fewer live columns than k
    for lv in (live, None):
        got = ra.topk_columns(s.to(device), k, None if lv is None else lv.to(device)).cpu()
        want = ra.topk_columns_reference(s, k, lv)
        assert torch.equal(got, want), f"live={lv is not None}: columns differ"
    assert bool((want >= 0).any()), "vacuous: no pick"
    assert bool((ra.topk_columns_reference(s, k, live) < 0).any()), "vacuous: no -inf pick"
    # out: a slice of a wider list (a hybrid's first half); exclude: the picks struck from a
    # second table in the same launch (-1 picks strike nothing)
    wide = torch.full((r, h, k + 3), 7, dtype=torch.int64)
    other = torch.randn(r, h, c, generator=gen)
    want = ra.topk_columns_reference(s, k, live)
    struck = other.clone()
    for i, j, col in ((i, j, col) for i in range(r) for j in range(h) for col in want[i, j].tolist() if col >= 0):
        struck[i, j, col] = float("-inf")
    ref_wide, ref_other = wide.clone(), other.clone()
    ra.topk_columns_reference(s, k, live, out=ref_wide[..., 2:2 + k], exclude=ref_other)
    got_wide, got_other = wide.to(device), other.to(device)
    ra.topk_columns(s.to(device), k, live.to(device), out=got_wide[..., 2:2 + k], exclude=got_other)
    for name, w, o in (("reference", ref_wide, ref_other), ("kernel", got_wide.cpu(), got_other.cpu())):
        assert torch.equal(w[..., 2:2 + k], want), f"{name}: out= picks differ"
        assert bool((w[..., :2] == 7).all() and (w[..., 2 + k:] == 7).all()), f"{name}: wrote outside out="
        assert torch.equal(o, struck), f"{name}: exclude= struck other columns than the picks"


# The filtered top-k's (chunk, sub-block, maxima a threshold step, candidates, small sort, mid
# sort, coarse thresholds, coarse maxima a row): the defaults; candidates past the buffer (the pick
# pass walks the row: 1,100 columns, 40 picks) and the threshold over several steps of maxima; the
# small, mid and whole-buffer sorts at small sizes (more candidates than the small sort: 37 of 64);
# coarse thresholds from 4 grouped maxima a row (fewer groups than picks: every live column passes,
# the pick pass gathers the row again by the fine threshold), then with a buffer too small for
# that too (the walk after the second gather); coarse thresholds at the default sizes
FILTER_SETTINGS = [None, (16, 4, 8, 8, 4, 4, False, 256), (64, 16, 16, 512, 4, 32, False, 256),
                   (16, 4, 8, None, 4, 8, True, 4), (16, 4, 8, 8, 4, 4, True, 4),
                   (1024, 16, 512, None, 128, 512, True, 256)]
FILTER_NAMES = ("TOPK_FILTER_CHUNK", "TOPK_FILTER_SUB", "TOPK_FILTER_TILE", "TOPK_FILTER_CAP",
                "TOPK_FILTER_SMALL", "TOPK_FILTER_MID", "TOPK_FILTER_COARSE", "TOPK_FILTER_COARSE_MAXIMA")


def check_topk_filtered(ra, device: str = "cpu", cases=None) -> list[str]:
    """check_topk through topk_columns' threshold path (TOPK_FILTER) at each FILTER_SETTINGS."""
    failures = []
    saved = [getattr(ra, n) for n in ("TOPK_FILTER", *FILTER_NAMES)]
    try:
        ra.TOPK_FILTER = True
        for setting in FILTER_SETTINGS:
            for name, v in zip(FILTER_NAMES, setting or saved[1:]):
                setattr(ra, name, v)
            for i, case in enumerate(cases or TOPK_CASES):
                try:
                    check_topk(ra, *case, seed=1600 + i, device=device)
                except AssertionError as e:
                    failures.append(f"topk_columns {case} filtered ({setting or 'defaults'}): {e}")
    finally:
        for name, v in zip(("TOPK_FILTER", *FILTER_NAMES), saved):
            setattr(ra, name, v)
    return failures


def check_assemble(ra, seed: int, device: str = "cpu") -> None:
    """assemble_lists == assemble_lists_reference: fixed entries with gaps, candidates past a row's
    top_k and top columns that are not candidates read nothing (page index -1)."""
    gen = torch.Generator().manual_seed(seed)
    r, hkv, c, f, k = 3, 2, 29, 5, 7
    cand_ids = torch.randint(0, 100, (r, c), generator=gen)
    cand_idx = torch.where(torch.rand(r, c, generator=gen) < 0.6, torch.arange(c), -1)
    fixed_idx = torch.where(torch.rand(r, f, generator=gen) < 0.7, torch.randint(0, 40, (r, f), generator=gen), -1)
    fixed_ids = torch.randint(0, 100, (r, f), generator=gen)
    top = torch.stack([torch.stack([torch.randperm(c, generator=gen)[:k] for _ in range(hkv)]) for _ in range(r)])
    top[0, 0, -2:] = -1  # topk_columns' picks at -inf: read nothing
    top_k = torch.tensor([k, 3, 0])
    got = [t.cpu() for t in ra.assemble_lists(*(t.to(device) for t in (top, cand_idx, cand_ids, fixed_idx,
                                                                         fixed_ids, top_k)))]
    want = ra.assemble_lists_reference(top, cand_idx, cand_ids, fixed_idx, fixed_ids, top_k)
    assert torch.equal(got[0], want[0]), "page indices differ"
    live = want[0] >= 0
    assert torch.equal(got[1][live], want[1][live]), "page ids of live entries differ"
    assert bool(live.any()) and bool((~live).any()), "vacuous: every entry live or none"


def check_update_summaries(ra, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """update_summaries (one row a page) == PageSummaries.update's scatter path, rows 0 resetting
    their pages among them. dtype: kmin / kmax's (bf16: still exact, since the min of rounded
    values is the rounded min; ksum and count are fp32 / int32 in either case)."""
    from kvtier.kv.summaries import PageSummaries
    gen = torch.Generator().manual_seed(seed)
    pages, ps, hkv, d = 9, 4, 2, 32
    ref = PageSummaries(1, pages, hkv, d, ps, "cpu")
    ref.update(0, torch.arange(pages * ps - 5), torch.randn(pages * ps - 5, hkv, d, generator=gen))
    got = PageSummaries(1, pages, hkv, d, ps, device, dtype)
    assert got.kmin.dtype == got.kmax.dtype == dtype and got.ksum.dtype == torch.float32
    assert got.bytes_per_page_layer() == (2 * got.kmin.element_size() + 4) * hkv * d + 4
    for name in ("kmin", "kmax", "ksum", "count"):
        getattr(got, name).copy_(getattr(ref, name))
    slots = torch.tensor([2 * ps, 5 * ps + 3, 8 * ps + 1, 0])  # rows 0 of pages 2 and 0: reset
    k = torch.randn(4, hkv, d, generator=gen).to(torch.bfloat16)
    ref.update(0, slots, k)
    ra.update_summaries(got.kmin[0], got.kmax[0], got.ksum[0], got.count[0], slots.to(device), k.to(device), ps)
    for name in ("kmin", "kmax", "ksum", "count"):
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name).to(getattr(got, name).dtype)), \
            f"{name} differs ({dtype})"
    # summaries without key sums (hybrid-mid and the Quest selectors): the same min / max / count
    bare = PageSummaries(1, pages, hkv, d, ps, device, dtype, sums=False)
    assert bare.ksum is None and bare.bytes_per_page_layer() == 2 * bare.kmin.element_size() * hkv * d + 4
    for name in ("kmin", "kmax", "count"):
        getattr(bare, name).copy_(getattr(got, name))
    slots2 = torch.tensor([3 * ps, 6 * ps + 2])
    k2 = torch.randn(2, hkv, d, generator=gen).to(torch.bfloat16)
    ref.update(0, slots2, k2)
    ra.update_summaries(bare.kmin[0], bare.kmax[0], None, bare.count[0], slots2.to(device), k2.to(device), ps)
    for name in ("kmin", "kmax", "count"):
        assert torch.equal(getattr(bare, name).cpu(), getattr(ref, name).to(getattr(bare, name).dtype)), \
            f"{name} differs without key sums ({dtype})"


def check_update_codes(ra, seed: int, device: str = "cpu") -> None:
    """update_summaries on 8-bit summaries (one row a page: the exponent raised, the codes shifted)
    == PageSummaries.update's scatter path, bit for bit, rows 0 resetting their pages among them;
    keys of growing magnitude so that exponents rise."""
    from kvtier.kv.summaries import PageSummaries
    gen = torch.Generator().manual_seed(seed)
    pages, ps, hkv, d = 9, 4, 2, 32
    ref = PageSummaries(1, pages, hkv, d, ps, "cpu", torch.int8, sums=False)
    got = PageSummaries(1, pages, hkv, d, ps, device, torch.int8, sums=False)
    assert got.bytes_per_page_layer() == 2 * hkv * d + hkv + 4
    first = torch.arange(pages * ps - 5)
    k0 = torch.randn(len(first), hkv, d, generator=gen) * 0.3
    ref.update(0, first, k0)
    for name in ("kmin", "kmax", "kexp", "count"):
        getattr(got, name).copy_(getattr(ref, name))
    for step, scale in enumerate((1.0, 40.0, 1e-3)):
        slots = torch.tensor([2 * ps, 5 * ps + 3, 8 * ps + step, 0]) if step == 0 else \
            torch.tensor([3 * ps + 3, 6 * ps + 2 + step, 1 * ps])[: 3]
        k = (torch.randn(len(slots), hkv, d, generator=gen) * scale).to(torch.bfloat16)
        ref.update(0, slots, k)
        ra.update_summaries(got.kmin[0], got.kmax[0], None, got.count[0], slots.to(device), k.to(device), ps,
                            got.kexp[0])
        for name in ("kmin", "kmax", "kexp", "count"):
            assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), f"8-bit summaries: {name} (step {step})"


@pytest.mark.parametrize("selector", ["quest", "quest-max"])
def test_quest_reference_matches_page_scores(selector: str) -> None:
    """quest_scores_reference == layers/retrieval.py page_scores on real summaries (CPU)."""
    from kvtier.kernels.retrieval_attention import quest_scores_reference
    from kvtier.kv.summaries import PageSummaries
    from kvtier.layers.retrieval import page_scores
    gen = torch.Generator().manual_seed(9)
    hkv, g, d, ps, pages = 2, 4, 32, 4, 12
    summ = PageSummaries(1, pages, hkv, d, ps, "cpu")
    summ.update(0, torch.arange((pages - 2) * ps), torch.randn((pages - 2) * ps, hkv, d, generator=gen) * 2)
    ids = torch.randint(0, pages, (3, 9), generator=gen)  # pages 10, 11: never written
    qg = torch.randn(3, hkv, g, d, generator=gen)
    want = page_scores(selector, qg, summ, 0, ids)
    got = quest_scores_reference(qg, (summ.kmin[0], summ.kmax[0], summ.count[0]), ids, selector == "quest-max")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_selected_kernel_matches_reference_interpreted() -> None:
    pytest.importorskip("triton")
    from tests.interp import run_interpreted
    run_interpreted("tests/layers/test_retrieval_kernel_interp.py")


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("int8", torch.float32), ("k8v4", torch.float32),
                                        ("fp16", torch.float16)])
@pytest.mark.parametrize("gqa", [1, 4])
def test_reference_matches_retrieval_backend(name: str, dtype: torch.dtype, gqa: int) -> None:
    """paged_decode_selected_reference over RetrievalAttention's own selection (stored domain,
    the pool's sink rows) == the backend's output for its selecting rows (pool.read + attend_selected)."""
    from kvtier.kernels.retrieval_attention import paged_decode_selected_reference
    step = cases.retrieval_step(name, 2, gqa, 4, 16, [37, 30, 9, 53], budget=20, dtype=dtype, device="cpu",
                                seed=gqa)
    pool, sel = step.pool, step.sel
    # three rows select (ctx 9 is dense), each list holding the whole budget (20 tokens = 5 pages)
    assert step.q.shape[0] == 3 and bool((sel.valid.sum(-1) == 5).all())
    sink = pool.kernel_sink(0)
    native = pool.rotated  # as the backend: rotating pools attend in the stored domain
    q = pool.native_q(0, step.q) if native else step.q
    ref = paged_decode_selected_reference(q, pool.layers[0], pool.fmt, sel.page_ids, sel.page_idx, sel.valid,
                                          step.ctx, step.scale, sink=sink)
    got = pool.native_out(ref) if native else ref
    tol = cases.TOLERANCE[dtype]
    torch.testing.assert_close(got, step.out, rtol=tol, atol=tol)


if __name__ == "__main__":
    main()
