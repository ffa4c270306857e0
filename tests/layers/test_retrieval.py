"""Retrieval attention: page summaries, the Quest bound, selection, and equivalence with dense.

Equivalences: budget >= context is bit-for-bit dense; a small budget equals dense softmax over
exactly the selected pages (reference from pool.read, independent of the backend's gather).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.kv.formats import make_format
from kvtier.kv.pool import PagePool
from kvtier.kv.summaries import PageSummaries
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention
from kvtier.layers.backends import make_backend
from kvtier.config import GPU_CACHE_BUDGETS, SELECTORS, RetrievalConfig
from kvtier.layers.retrieval import RetrievalAttention, page_scores

PS, D, PAGES = 4, 8, 96


def _random_writes(s: PageSummaries, seed: int, decades: bool = False) -> dict[tuple[int, int], list[torch.Tensor]]:
    """60 steps of random writes into s's pages (runs of rows, pages reused from row 0) at every
    layer -> (layer, page) -> the rows its current occupant wrote, in order. decades: each step's
    keys scaled by 10^-3 .. 10^2."""
    rows: dict[tuple[int, int], list[torch.Tensor]] = {}
    fill = [0] * s.num_pages
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    for _ in range(60):
        slots = []
        for p in rnd.sample(range(s.num_pages), 3):
            if fill[p] == PS or rnd.random() < 0.2:
                fill[p] = 0  # the page is reused by a new occupant: it starts again at row 0
            n = rnd.randint(1, PS - fill[p])
            slots += [p * PS + fill[p] + i for i in range(n)]
            fill[p] += n
        for layer in range(s.num_layers):  # every layer writes the step's slots
            k = torch.randn(len(slots), s.kv_heads, D, generator=g) * (10.0 ** rnd.randint(-3, 2) if decades else 1.0)
            s.update(layer, torch.tensor(slots), k)
            for slot, row in zip(slots, k):
                if slot % PS == 0:
                    rows[(layer, slot // PS)] = []
                rows[(layer, slot // PS)].append(row)
    return rows


def test_summaries_match_brute_force_after_random_writes_and_page_reuse():
    s = PageSummaries(2, 10, 3, D, PS, "cpu")
    rows = _random_writes(s, seed=0)
    for (layer, p), rs in rows.items():
        ks = torch.stack(rs)  # [n, Hkv, D]
        assert int(s.count[layer, p]) == len(rs)
        assert torch.equal(s.kmin[layer, p], ks.amin(0)) and torch.equal(s.kmax[layer, p], ks.amax(0))
        torch.testing.assert_close(s.ksum[layer, p], ks.sum(0))
        torch.testing.assert_close(s.mean(layer, torch.tensor([p]))[0], ks.mean(0))


def test_8bit_summaries_bound_the_keys_and_do_not_depend_on_how_rows_arrive():
    """8-bit summaries (kv/summaries.py): after random writes and page reuse (rows one at a time,
    in runs, or a page at once) each page's codes are the ones encoded from all its keys at once
    (exact: the exponent only grows, and the old codes shift with floor / ceil); their values bound
    the keys from outside within one code step of 2^e; refresh and copy_rows agree."""
    from kvtier.kv.summaries import encode_pages, pow2
    layers, hkv, pages = 2, 3, 10
    s = PageSummaries(layers, pages, hkv, D, PS, "cpu", torch.int8, sums=False)
    assert s.codes and s.bits == 8 and s.bytes_per_page_layer() == 2 * hkv * D + hkv + 4
    rows = _random_writes(s, seed=4, decades=True)  # magnitudes over five decades: exponents rise and fall
    for (layer, p), rs in rows.items():
        ks = torch.stack(rs)  # [n, Hkv, D]
        lo, hi = ks.amin(0), ks.amax(0)
        cmin, cmax, e = encode_pages(lo, hi)
        assert int(s.count[layer, p]) == len(rs)
        assert torch.equal(s.kexp[layer, p].int(), e)
        assert torch.equal(s.kmin[layer, p].int(), cmin) and torch.equal(s.kmax[layer, p].int(), cmax)
        got_lo, got_hi = (s.values(name, layer, torch.tensor([p])) for name in ("kmin", "kmax"))
        step = pow2(e)[:, None]
        assert (got_lo[0] <= lo).all() and (got_hi[0] >= hi).all()
        assert (lo - got_lo[0] < step).all() and (got_hi[0] - hi < step).all()
    # refresh from the pages' keys, and copy_rows into other 8-bit summaries, give the same codes
    live = sorted(p for (layer, p) in rows if layer == 0)
    keys = torch.zeros(len(live), hkv, PS, D)
    for i, p in enumerate(live):
        ks = torch.stack(rows[(0, p)])
        keys[i, :, :len(ks)] = ks.transpose(0, 1)
    again = PageSummaries(layers, pages, hkv, D, PS, "cpu", torch.int8, sums=False)
    again.refresh(0, torch.tensor(live), keys, s.count[0, live])
    for name in ("kmin", "kmax", "kexp", "count"):
        assert torch.equal(getattr(again, name)[0, live], getattr(s, name)[0, live]), name
    moved = PageSummaries(layers, 4, hkv, D, PS, "cpu", torch.int8, sums=False)
    moved.copy_rows(s, torch.tensor(live[:4]), torch.arange(4))
    assert torch.equal(moved.kmax[:, :4], s.kmax[:, live[:4]]) and torch.equal(moved.kexp[:, :4], s.kexp[:, live[:4]])
    with pytest.raises(ValueError, match="8-bit"):
        PageSummaries(layers, 4, hkv, D, PS, "cpu", sums=False).copy_rows(s, torch.tensor([0]), torch.tensor([0]))


def test_exponents_are_the_least_that_fit():
    """exponents(): the least e >= E_MIN with amax <= 127 * 2^e, at and around the boundaries."""
    from kvtier.kv.summaries import E_MIN, exponents, pow2
    a = torch.tensor([0.0, 1e-42, 1e-30, 126.99, 127.0, 127.0001, 254.0, 254.01, 3e38, 1.0, 0.5])
    e = exponents(a)
    assert (a <= 127 * pow2(e)).all()
    assert ((e == E_MIN) | (a > 127 * pow2(e - 1))).all()
    assert e[:3].tolist() == [E_MIN] * 3 and e[4].item() == 0 and e[5].item() == 1 and e[6].item() == 1


def test_quest_bound_holds_for_every_query_head():
    g = torch.Generator().manual_seed(1)
    hkv, grp, pages = 2, 4, 12
    s = PageSummaries(1, pages, hkv, D, PS, "cpu")
    k = torch.randn(pages * PS, hkv, D, generator=g) * 3
    s.update(0, torch.arange(pages * PS), k)
    q = torch.randn(5, hkv, grp, D, generator=g) * 2
    ids = torch.arange(pages)[None, :].expand(5, pages)
    kp = k.view(pages, PS, hkv, D)  # page p, row s, head h
    true_max = torch.einsum("rhgd,pshd->rhgps", q, kp).amax(-1)  # [R, Hkv, g, P]: max q.k per page
    assert (page_scores("quest-max", q, s, 0, ids) >= true_max.amax(2) - 1e-5).all()
    assert (page_scores("quest", q, s, 0, ids) >= true_max.sum(2) - 1e-5).all()
    # 8-bit summaries: still bounds (rounded outward), and at least the 16-bit ones
    s8 = PageSummaries(1, pages, hkv, D, PS, "cpu", torch.int8, sums=False)
    s8.update(0, torch.arange(pages * PS), k)
    for sel, true in (("quest-max", true_max.amax(2)), ("quest", true_max.sum(2))):
        got = page_scores(sel, q, s8, 0, ids)
        assert (got >= true - 1e-5).all() and (got >= page_scores(sel, q, s, 0, ids) - 1e-4).all()


def _fill(pool: PagePool, backends: list, ctx_lens: list[int], new_lens: list[int], hq: int, seed: int,
          layers: int = 1):
    """Random scattered page tables; history rows written into `pool` (and every retrieval backend's
    summaries). -> (meta, q, k_new, v_new) for one step of every layer (same q/k/v each layer)."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    free = list(range(PAGES))
    rnd.shuffle(free)
    tables, ks, vs = [], [], []
    hkv = pool.kv_heads
    for ctx, n in zip(ctx_lens, new_lens):
        pt = [free.pop() for _ in range(-(-ctx // PS))]
        tables.append(pt)
        k, v = torch.randn(ctx, hkv, D, generator=g), torch.randn(ctx, hkv, D, generator=g)
        # a few keys stand out so that the selection matters
        k[rnd.sample(range(ctx), min(3, ctx))] *= 4
        ks.append(k)
        vs.append(v)
    for b, (ctx, n) in enumerate(zip(ctx_lens, new_lens)):
        old = torch.tensor([tables[b][p // PS] * PS + p % PS for p in range(ctx - n)], dtype=torch.long)
        meta = AttentionMetadata([0, ctx - n], [ctx - n], [tables[b]], old, torch.tensor([0]))
        for layer in range(layers):
            if ctx - n:  # write the history as a prefill step (sink rows included)
                for be in backends:
                    be.plan(meta)
                    be.forward(layer, torch.zeros(ctx - n, hq, D), ks[b][:ctx - n], vs[b][:ctx - n], meta)
            meta.step_cache.clear()
    qsl = [0]
    for n in new_lens:
        qsl.append(qsl[-1] + n)
    slots = torch.tensor([pt[p // PS] * PS + p % PS for pt, ctx, n in zip(tables, ctx_lens, new_lens)
                          for p in range(ctx - n, ctx)], dtype=torch.long)
    k_new = torch.cat([k[ctx - n:] for k, ctx, n in zip(ks, ctx_lens, new_lens)])
    v_new = torch.cat([v[ctx - n:] for v, ctx, n in zip(vs, ctx_lens, new_lens)])
    q = torch.randn(qsl[-1], hq, D, generator=g)
    return AttentionMetadata(qsl, ctx_lens, tables, slots, torch.tensor([qsl[-1] - 1])), q, k_new, v_new


CASES = [([7, 13, 1, 20], [7, 3, 1, 5]), ([5, 17, 2, 33, 8], [1, 1, 1, 1, 1]), ([30, 9], [1, 9])]


@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_budget_at_least_context_is_dense_bit_for_bit(hq, hkv, case):
    ctx, new = CASES[case]
    pools = [PagePool(make_format("fp32"), 2, PAGES, hkv, PS, D, "cpu") for _ in range(2)]
    dense = DensePagedAttention(pools[0], D ** -0.5)
    cfg = RetrievalConfig(budget=max(ctx), sink=1, window=4)
    retr = RetrievalAttention(pools[1], D ** -0.5, cfg)
    outs = []
    for be in (dense, retr):
        meta, q, k, v = _fill(be.store, [be], ctx, new, hq, seed=case, layers=2)
        be.plan(meta)
        outs.append([be.forward(layer, q, k, v, meta) for layer in range(2)])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert retr.retrieved_rows == 0


def _selected_reference(pool: PagePool, meta: AttentionMetadata, q: torch.Tensor, b: int,
                        idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Decode row of sequence b over exactly the selected pages of each kv head.
    idx/valid: [Hkv, n_sel] -> [Hq, D]"""
    ctx, pt = meta.seq_lens[b], meta.page_tables[b]
    kp, vp = pool.read(0, torch.tensor(pt[:-(-ctx // PS)]), torch.tensor([0]))  # [P, Hkv, PS, D]
    hkv, hq = pool.kv_heads, q.shape[1]
    out = torch.empty(hq, D)
    for h in range(hkv):
        pages = sorted({int(p) for p, ok in zip(idx[h], valid[h]) if ok})
        keys = [(p, o) for p in pages for o in range(PS) if p * PS + o < ctx]
        kk = torch.stack([kp[p, h, o] for p, o in keys]).float()
        vv = torch.stack([vp[p, h, o] for p, o in keys]).float()
        for j in range(hq // hkv):
            hh = h * (hq // hkv) + j
            w = (q[meta.query_start_loc[b], hh].float() @ kk.T * D ** -0.5).softmax(-1)
            out[hh] = w @ vv
    return out


@pytest.mark.parametrize("fmt,bits", [("fp32", 16), ("int8", 16), ("fp32", 8)])
@pytest.mark.parametrize("selector", SELECTORS)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2)])
def test_small_budget_is_dense_over_exactly_the_selected_pages(fmt, bits, selector, hq, hkv):
    ctx, new = [61, 7, 45, 90, 26], [1, 7, 1, 1, 1]  # one prefill chunk rides along densely
    cfg = RetrievalConfig(budget=28, sink=2, window=5, selector=selector, summary_bits=bits)  # 7 pages
    pools = [PagePool(make_format(fmt), 1, PAGES, hkv, PS, D, "cpu") for _ in range(2)]
    dense = DensePagedAttention(pools[0], D ** -0.5)
    retr = RetrievalAttention(pools[1], D ** -0.5, cfg, record=True)
    meta, q, k, v = _fill(pools[1], [retr], ctx, new, hq, seed=3)
    retr.plan(meta)
    out = retr.forward(0, q, k, v, meta)
    dmeta, dq, dk, dv = _fill(pools[0], [dense], ctx, new, hq, seed=3)
    ref_dense = dense.forward(0, dq, dk, dv, dmeta)
    idx, valid = retr.last_selection[0]
    selecting = [b for b in range(len(ctx)) if new[b] == 1 and ctx[b] > cfg.budget]
    assert idx.shape[:2] == (len(selecting), hkv) and retr.retrieved_rows == len(selecting)
    tol = dict(rtol=1e-5, atol=1e-5) if fmt == "fp32" else dict(rtol=1e-4, atol=1e-4)
    for r, b in enumerate(selecting):
        n_pages = -(-ctx[b] // PS)
        for h in range(hkv):
            chosen = [int(p) for p, ok in zip(idx[r, h], valid[r, h]) if ok]
            assert len(chosen) == len(set(chosen)) == cfg.budget // PS  # no repeats, the budget filled
            assert 0 in chosen and n_pages - 1 in chosen  # the sink and the newest page (current token)
            first_window = (ctx[b] - cfg.window) // PS
            assert set(range(first_window, n_pages)) <= set(chosen)
        lo = meta.query_start_loc[b]
        torch.testing.assert_close(out[lo], _selected_reference(pools[1], meta, q, b, idx[r], valid[r]), **tol)
    for b in range(len(ctx)):  # every other row is the dense backend's, unchanged
        if b not in selecting:
            lo, hi = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            torch.testing.assert_close(out[lo:hi], ref_dense[lo:hi], rtol=0, atol=0)
    mass = torch.cat(retr.mass_log)
    assert mass.shape == (len(selecting), hq) and ((mass > 0) & (mass <= 1 + 1e-5)).all()


def test_quest_takes_the_pages_with_the_highest_bound():
    hq = hkv = 2
    cfg = RetrievalConfig(budget=16, sink=1, window=1, selector="quest")  # 4 pages: sink, newest, 2 picked
    pool = PagePool(make_format("fp32"), 1, PAGES, hkv, PS, D, "cpu")
    retr = RetrievalAttention(pool, D ** -0.5, cfg, record=True)
    meta, q, k, v = _fill(pool, [retr], [41], [1], hq, seed=5)
    retr.plan(meta)
    retr.forward(0, q, k, v, meta)
    idx, valid = retr.last_selection[0]
    pt = meta.page_tables[0]
    for h in range(hkv):
        bounds = [float((q[0, h].clamp_min(0) * retr.summaries.kmax[0, pt[p], h]
                         + q[0, h].clamp_max(0) * retr.summaries.kmin[0, pt[p], h]).sum()) for p in range(1, 10)]
        best = sorted(range(1, 10), key=lambda p: -bounds[p - 1])[:2]
        assert set(idx[0, h].tolist()) == {0, 10} | set(best)


def test_pinned_pages_are_always_attended_and_never_candidates():
    """Pinned pages (AttentionMetadata.pinned_pages) join the sink and window in every kv head's
    selection, whatever their score; the top-k fills what is left of the budget from the rest."""
    hq, hkv = 4, 2
    cfg = RetrievalConfig(budget=28, sink=1, window=1, selector="quest")  # 7 pages: sink, newest, 5 more
    pool = PagePool(make_format("fp32"), 1, PAGES, hkv, PS, D, "cpu")
    retr = RetrievalAttention(pool, D ** -0.5, cfg, record=True)
    meta, q, k, v = _fill(pool, [retr], [61], [1], hq, seed=7)
    pinned = [3, 4, 9]
    meta.pinned_pages = [pinned]
    retr.plan(meta)
    out = retr.forward(0, q, k, v, meta)
    idx, valid = retr.last_selection[0]
    for h in range(hkv):
        chosen = [int(p) for p, ok in zip(idx[0, h], valid[0, h]) if ok]
        assert len(chosen) == len(set(chosen)) == 7
        assert {0, 15, *pinned} <= set(chosen)  # sink, the newest page, every pinned page
    torch.testing.assert_close(out[0], _selected_reference(pool, meta, q, 0, idx[0], valid[0]),
                               rtol=1e-5, atol=1e-5)
    # without pins, the same step chooses differently: the pins displaced candidates
    meta2, q2, k2, v2 = _fill(PagePool(make_format("fp32"), 1, PAGES, hkv, PS, D, "cpu"), [], [61], [1], hq, seed=7)
    free = RetrievalAttention(pool, D ** -0.5, cfg, record=True)
    free.summaries = retr.summaries
    free.plan(meta2)
    free.forward(0, q2, k2, v2, meta2)
    assert not torch.equal(free.last_selection[0][0], idx)


def test_graph_tables_select_the_same_pages_as_the_step_tables():
    """The tables a captured decode step builds (whole block-table width, every row, pinned pages
    from the staged `pin_buf`, a short row taking all its pages) pick what the eager tables pick."""
    hq, hkv = 4, 2
    cfg = RetrievalConfig(budget=28, sink=1, window=1, selector="quest")
    pool = PagePool(make_format("fp32"), 1, PAGES, hkv, PS, D, "cpu")
    retr = RetrievalAttention(pool, D ** -0.5, cfg)
    meta, q, k, v = _fill(pool, [retr], [61, 45, 13], [1, 1, 1], hq, seed=11)
    meta.pinned_pages = [[3, 4, 9], [], []]
    width = 24  # wider than any table, as the planner's block table is
    meta.block_table = torch.zeros(3, width, dtype=torch.int32)
    for b, pt in enumerate(meta.page_tables):
        meta.block_table[b, :len(pt)] = torch.tensor(pt)
    meta.seq_lens_t = torch.tensor(meta.seq_lens, dtype=torch.int32)
    eager = retr.select(0, q[[0, 1]], retr._selection_tables(meta, [0, 1], torch.device("cpu")))
    retr._stage_pins(meta, for_graph=False)
    graph = retr.select(0, q, retr._graph_tables(meta))

    def chosen(sel, r, h):
        page_idx, _ = sel
        return sorted(int(p) for p in page_idx[r, h] if p >= 0)
    for h in range(hkv):
        for r in (0, 1):
            assert chosen(graph, r, h) == chosen(eager, r, h)
        assert chosen(graph, 2, h) == [0, 1, 2, 3]  # 13 tokens under the budget: every page, once
    assert {3, 4, 9} <= set(chosen(graph, 0, 0))


def test_fused_eager_tables_take_the_block_table_width():
    """An eager step on the fused (kernel) path scores the block table's whole width, as a captured
    step does, so its kernels are the variants the capture compiled (a narrower table compiled a
    new top-k merge at the first step of each longer context); the PyTorch path keeps the longest
    selecting row's width. The candidates are the same either way."""
    hq, hkv = 4, 2
    cfg = RetrievalConfig(budget=28, sink=1, window=1, selector="quest")
    pool = PagePool(make_format("fp32"), 1, PAGES, hkv, PS, D, "cpu")
    torch_path = RetrievalAttention(pool, D ** -0.5, cfg)
    fused = RetrievalAttention(pool, D ** -0.5, cfg, summaries=torch_path.summaries, kernel=True)
    assert fused.fused_select and not torch_path.fused_select
    meta, _, _, _ = _fill(pool, [torch_path], [61, 45], [1, 1], hq, seed=11)
    width = 24
    meta.block_table = torch.zeros(2, width, dtype=torch.int32)
    for b, pt in enumerate(meta.page_tables):
        meta.block_table[b, :len(pt)] = torch.tensor(pt)
    meta.seq_lens_t = torch.tensor(meta.seq_lens, dtype=torch.int32)
    narrow = torch_path._selection_tables(meta, [0, 1], torch.device("cpu"))
    wide = fused._selection_tables(meta, [0, 1], torch.device("cpu"))
    assert narrow.cand_idx.shape[1] == -(-61 // PS) and wide.cand_idx.shape[1] == width
    n = narrow.cand_idx.shape[1]
    assert torch.equal(wide.cand_idx[:, :n], narrow.cand_idx) and bool((wide.cand_idx[:, n:] < 0).all())
    assert torch.equal(wide.fixed_idx, narrow.fixed_idx) and torch.equal(wide.top_k, narrow.top_k)
    assert wide.k == narrow.k


def test_config_validation_and_registry():
    with pytest.raises(ValueError, match="selector"):
        RetrievalConfig(budget=64, selector="oracle")
    with pytest.raises(ValueError, match="sink"):
        RetrievalConfig(budget=64, sink=0)
    with pytest.raises(ValueError, match="nothing to retrieve"):
        RetrievalConfig(budget=64, sink=4, window=60)
    with pytest.raises(ValueError, match="pages"):
        RetrievalConfig(budget=40, sink=4, window=16).page_counts(16)
    pool = PagePool(make_format("fp32"), 1, 8, 2, PS, D, "cpu")
    with pytest.raises(ValueError, match="kvmem budget"):
        make_backend("retrieval", pool, 1.0)
    assert make_backend("retrieval", pool, 1.0, retrieval=RetrievalConfig(budget=64, window=8)).name == "retrieval"
    assert not RetrievalConfig().enabled
    # summary bits: auto (0) is 8 on CUDA, 16 (fp32 here) on the CPU
    with pytest.raises(ValueError, match="summary bits"):
        RetrievalConfig(budget=64, window=8, summary_bits=4)
    from kvtier.kv.summaries import summary_dtype
    assert RetrievalConfig().summary_bits == 0
    assert summary_dtype("cuda", torch.bfloat16, 0) == torch.int8 and summary_dtype("cpu", torch.bfloat16, 0) == torch.float32
    auto = RetrievalAttention(pool, 1.0, RetrievalConfig(budget=64, window=8))
    assert not auto.summaries.codes and auto.summaries.kmin.dtype == torch.float32
    # the GPU cache of selected host pages: auto = GPU_CACHE_BUDGETS budgets, in whole pages; 0 off
    assert RetrievalConfig(budget=2048).cache_pages(16) == 0  # off by default
    assert RetrievalConfig(budget=2048, gpu_cache=-1).cache_pages(16) == GPU_CACHE_BUDGETS * 2048 // 16
    assert RetrievalConfig(budget=2048, gpu_cache=1000).cache_pages(16) == 63
    assert RetrievalConfig(budget=2048, gpu_cache=0).cache_pages(16) == 0
    assert RetrievalConfig(gpu_cache=1000).cache_pages(16) == 0  # retrieval off
    with pytest.raises(ValueError, match="GPU cache"):
        RetrievalConfig(budget=64, gpu_cache=-2)


@pytest.mark.parametrize("fmt_name", ["fp32", "int8"])
def test_pages_swapped_in_get_their_own_summaries(fmt_name):
    """A page brought back from the host tier is summarised by the keys it now holds, not by its
    previous occupant's (the seeds' restored contexts ranked by another context's index)."""
    g = torch.Generator().manual_seed(7)
    layers, hkv = 2, 2
    gpu = PagePool(make_format(fmt_name), layers, 8, hkv, PS, D, "cpu", compute_dtype=torch.float32)
    host = PagePool(make_format(fmt_name), layers, 8, hkv, PS, D, "cpu", compute_dtype=torch.float32)
    att = RetrievalAttention(gpu, D ** -0.5, RetrievalConfig(budget=4 * PS, sink=1, window=1))
    old, new = (torch.randn(layers, PS, hkv, D, generator=g) * 2 + 1 for _ in range(2))
    for layer in range(layers):
        for page, keys in ((3, old), (6, new)):  # page 3: the old occupant; page 6: what comes back
            slots = torch.arange(page * PS, page * PS + PS)
            gpu.write(layer, slots, keys[layer], torch.randn(PS, hkv, D, generator=g))
            att.summaries.update(layer, slots, keys[layer])
    gpu.copy_to(host, [6], [5])  # offloaded (with the GPU pool's smoothing constants) ...
    host.copy_to(gpu, [5], [3])  # ... and brought back into page 3
    att.pages_arrived([3])
    tol = 1e-5 if fmt_name == "fp32" else 0.05 * float(new.abs().max())  # int8: within its code steps
    for layer in range(layers):
        torch.testing.assert_close(att.summaries.kmin[layer, 3], new[layer].amin(0), atol=tol, rtol=0)
        torch.testing.assert_close(att.summaries.kmax[layer, 3], new[layer].amax(0), atol=tol, rtol=0)
        assert int(att.summaries.count[layer, 3]) == PS
        assert not torch.allclose(att.summaries.kmax[layer, 3], old[layer].amax(0), atol=tol, rtol=0)
