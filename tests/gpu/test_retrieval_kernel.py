"""Retrieval decode kernel (kvtier/kernels/retrieval_attention.py) on CUDA (skipped without a GPU).

- kernel == reference for every KV format x GQA 1/4/8 x head_dim 64/128 over per-kv-head page
  lists (shuffled, invalid entries, page 0 with and without sink rows, partial last pages, a
  ctx-0 row), num_splits from selected_num_splits and forced 1 / 7 (the cases of
  tests/layers/paged_attention_cases.py, shared with the interpreter test);
- kernel (raw q, NativeDomain folded) == RetrievalAttention.forward for its selecting rows;
- a captured CUDA graph replayed over new lists / lengths / queries == eager;
- quest_scores (fused Quest bounds, both tiers) == its reference and == page_scores;
- `pytest tests/gpu/test_retrieval_kernel.py -s -k print`: us/call and GB/s of the bytes read
  for a 2048-token selection per kv head, next to paged_decode over 2048 contiguous tokens
  (the same bytes: the per-head lists should cost about the same).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier.kv.formats import FORMAT_NAMES, make_format

_spec = importlib.util.spec_from_file_location(
    "paged_attention_cases", Path(__file__).parents[1] / "layers" / "paged_attention_cases.py")
cases = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cases  # its dataclass looks its module up while the module executes
_spec.loader.exec_module(cases)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PS = 16
KV_HEADS = 2
LENS = [1, 17, 0, 100, 256, 3001, 37, 64]  # one token, partial pages, padding row, page-aligned, long
SINKS = [True, False, True, True, False, True, True, False]
N_SEL = 24  # entries per list: 3001 tokens -> 188 pages, 22 of them chosen
FORCED_SPLITS = (1, 7)

# Bandwidth shape: Llama-3-8B-like attention, a 2048-token selection (128 pages of 16) per kv head.
BW_KV_HEADS, BW_GQA, BW_D, BW_N_SEL = 8, 4, 128, 128
BW_FORMATS = ("bf16", "int8", "k8v4", "int4")
BW_CONTEXTS = (8192, 32768)
BW_BATCHES = (1, 32)
BW_WARMUP, BW_REPEATS = 3, 15


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_kernel_matches_reference_cuda(name: str, gqa: int, head_dim: int) -> None:
    from kvtier.kernels import retrieval_attention as ra
    dtype = cases.compute_dtype(name, torch.bfloat16)
    case = cases.make_case(name, KV_HEADS, gqa, PS, head_dim, LENS, SINKS, dtype, "cuda", seed=gqa * 1000 + head_dim)
    sel = cases.make_selection(case, N_SEL, seed=gqa + head_dim)
    auto = ra.selected_num_splits(len(LENS), KV_HEADS, N_SEL, PS, _num_sms())
    for i, splits in enumerate(sorted({auto, *FORCED_SPLITS})):
        cases.check_selected(ra, case, sel, splits, use_sink=True, idx_only=i % 2 == 1)


@pytest.mark.parametrize("name", ["bf16", "int8", "k8v4"])
@pytest.mark.parametrize("gqa", [1, 4])
def test_kernel_matches_retrieval_backend(name: str, gqa: int) -> None:
    """The kernel on RetrievalAttention's own selection, raw q with the stored domain folded in
    (as a backend would call it) == the backend's output for its selecting rows."""
    from kvtier.kernels import retrieval_attention as ra
    from kvtier.kernels.paged_attention import NativeDomain
    step = cases.retrieval_step(name, 2, gqa, PS, 128, [1500, 700, 300, 2001], budget=512, dtype=torch.bfloat16,
                                device="cuda", seed=gqa)
    pool, sel = step.pool, step.sel
    assert step.q.shape[0] == 3  # ctx 300 stays dense
    sink = pool.kernel_sink(0)
    native = NativeDomain(pool.k_channel_scale[0], pool.fmt.rotate_k, pool.fmt.rotate_v) if pool.rotated else None
    for splits in (1, ra.selected_num_splits(3, 2, sel.page_ids.shape[-1], PS, _num_sms())):
        got = ra.paged_decode_selected(step.q, pool.layers[0], pool.fmt, sel.page_ids, sel.page_idx, sel.valid,
                                       step.ctx, step.scale, splits, sink=sink, native=native)
        tol = cases.TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(got.float(), step.out.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["bf16", "k8v4"])
def test_cuda_graph_replay_matches_eager(name: str) -> None:
    """Capture once with fixed buffers; new lists / lengths / queries in place; replay."""
    from kvtier.kernels import retrieval_attention as ra
    dtype = cases.compute_dtype(name, torch.bfloat16)
    case = cases.make_case(name, KV_HEADS, 4, PS, 128, LENS, SINKS, dtype, "cuda", seed=5)
    fmt, sink = case.pool.fmt, case.sink if case.pool.fmt.quantized else None
    sel = cases.make_selection(case, N_SEL, seed=5)
    splits = ra.selected_num_splits(len(LENS), KV_HEADS, N_SEL, PS, _num_sms())  # shape-only
    q, lens = case.q.clone(), case.seq_lens.clone()
    ids, idx, valid = sel.page_ids.clone(), sel.page_idx.clone(), sel.valid.clone()
    out = torch.empty_like(q)

    def step() -> None:
        ra.paged_decode_selected(q, case.st, fmt, ids, idx, valid, lens, case.scale, splits, sink=sink, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        perm = torch.randperm(len(LENS), generator=g).cuda()  # rows change places with their lists
        lens.copy_(case.seq_lens[perm])
        ids.copy_(sel.page_ids[perm])
        idx.copy_(sel.page_idx[perm])
        valid.copy_(sel.valid[perm] & (torch.rand(valid.shape, generator=g) < 0.8).cuda())
        q.copy_(torch.randn(q.shape, generator=g).to(q))
        graph.replay()
        eager = ra.paged_decode_selected(q, case.st, fmt, ids, idx, valid, lens, case.scale, splits, sink=sink)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "graph replay differs from the eager launch"
        want = ra.paged_decode_selected_reference(q, case.st, fmt, ids, idx, valid, lens, case.scale, sink=sink)
        tol = cases.TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)


_ispec = importlib.util.spec_from_file_location(
    "retrieval_kernel_interp", Path(__file__).parents[1] / "layers" / "test_retrieval_kernel_interp.py")
interp_cases = importlib.util.module_from_spec(_ispec)
_ispec.loader.exec_module(interp_cases)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_selection_glue_kernels_match_references_cuda(seed: int) -> None:
    """assemble_lists and update_summaries (the fused selection's list and summary kernels) ==
    their PyTorch references, on CUDA, summaries in fp32 and in bf16."""
    from kvtier.kernels import retrieval_attention as ra
    interp_cases.check_assemble(ra, seed=1100 + seed, device="cuda")
    interp_cases.check_update_summaries(ra, seed=1200 + seed, device="cuda")
    interp_cases.check_update_summaries(ra, seed=1300 + seed, device="cuda", dtype=torch.bfloat16)
    interp_cases.check_update_codes(ra, seed=1500 + seed, device="cuda")


@pytest.mark.parametrize("r,h,c,k", [(1, 8, 16386, 56), (2, 8, 16386, 112), (3, 4, 4352, 128), (1, 2, 70000, 200),
                                     (2, 3, 37, 5), (2, 1, 9, 9),
                                     (2, 2, 65, 1), (1, 2, 65, 2)])
def test_topk_columns_matches_reference_cuda(r: int, h: int, c: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """topk_columns == a stable descending sort, chunked (at a 256K table's width and past
    TOPK_MAX_CHUNKS chunks of TOPK_CHUNK columns) and filtered (TOPK_FILTER: every setting of the
    interpreter cases; k past TOPK_FILTER_MAX_K takes the chunked path)."""
    from kvtier.kernels import retrieval_attention as ra
    monkeypatch.setattr(ra, "TOPK_FILTER", False)
    interp_cases.check_topk(ra, r, h, c, k, seed=r * 1000 + c, device="cuda")
    assert interp_cases.check_topk_filtered(ra, "cuda", [(r, h, c, k)]) == []


def test_quest_scores_bf16_summaries_cuda() -> None:
    """quest_scores / centroid_scores over bf16 summaries (and fp32, and 8-bit codes) == their
    references, on CUDA."""
    from kvtier.kernels import retrieval_attention as ra
    for i, (hkv, g, d, with_host) in enumerate(interp_cases.SCORE_CASES):
        interp_cases.check_quest_scores(_CudaRA(ra), hkv, g, d, with_host, seed=600 + i)


class _CudaRA:
    """The kernels module with the scorers run on CUDA (inputs moved there, results back)."""

    def __init__(self, ra):
        self.ra = ra

    def __getattr__(self, name):
        fn = getattr(self.ra, name)
        if name not in ("quest_scores", "centroid_scores"):
            return fn

        def on_cuda(*args, **kw):
            mv = lambda x: (x.cuda() if isinstance(x, torch.Tensor)  # noqa: E731
                            else tuple(mv(t) for t in x) if isinstance(x, tuple) else x)
            out = fn(*(mv(a) for a in args), **{k: mv(v) for k, v in kw.items()})
            return tuple(t.cpu() for t in out) if isinstance(out, tuple) else out.cpu()  # midrange: (bound, mid)
        return on_cuda


@pytest.mark.parametrize("with_host", [False, True])
def test_quest_scores_match_reference_and_page_scores(with_host: bool) -> None:
    """Fused Quest bounds at real sizes == the reference (both tiers); == page_scores (compute pool)."""
    from kvtier.kernels import retrieval_attention as ra
    from kvtier.kv.summaries import PageSummaries
    from kvtier.layers.retrieval import page_scores
    g = torch.Generator(device="cuda").manual_seed(3)
    hkv, grp, d, pages, host_pages = 8, 4, 128, 4096, 1024
    summ = PageSummaries(1, pages, hkv, d, PS, "cuda")
    written = (pages - 8) * PS  # the last 8 pages stay empty (+inf)
    summ.update(0, torch.arange(written, device="cuda"), torch.randn(written, hkv, d, device="cuda", generator=g))
    dev = (summ.kmin[0], summ.kmax[0], summ.count[0])
    host = None
    ids = torch.randint(0, pages, (8, 2000), device="cuda", generator=g)
    if with_host:
        hs = PageSummaries(1, host_pages, hkv, d, PS, "cuda")
        hs.update(0, torch.arange(host_pages * PS, device="cuda"),
                  torch.randn(host_pages * PS, hkv, d, device="cuda", generator=g))
        host = (hs.kmin[0], hs.kmax[0], hs.count[0])
        ref = -1 - torch.randint(0, host_pages, ids.shape, device="cuda", generator=g)
        ids = torch.where(torch.rand(ids.shape, device="cuda", generator=g) < 0.3, ref, ids)
    qg = torch.randn(8, hkv, grp, d, device="cuda", generator=g)
    for reduce_max in (False, True):
        got = ra.quest_scores(qg, dev, ids, reduce_max, host)
        want = ra.quest_scores_reference(qg, dev, ids, reduce_max, host)
        assert torch.equal(got.isinf(), want.isinf())
        fin = ~want.isinf()
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-3)
        limit = torch.tensor([2000, 1999, 257, 256, 1, 0, 1000, 31], device="cuda")
        lim = ra.quest_scores(qg, dev, ids, reduce_max, host, limit=limit)
        for r, n in enumerate(limit.tolist()):  # the columns under each row's limit: the same bits
            assert torch.equal(lim[r, :, :n], got[r, :, :n])
        if not with_host:
            torch.testing.assert_close(got, page_scores("quest-max" if reduce_max else "quest", qg, summ, 0, ids),
                                       rtol=1e-5, atol=1e-3)
    # centroid_scores == its reference, and == page_scores' PyTorch centroid
    cdev = (summ.ksum[0], summ.count[0])
    chost = (hs.ksum[0], hs.count[0]) if with_host else None
    got = ra.centroid_scores(qg, cdev, ids, chost)
    want = ra.centroid_scores_reference(qg, cdev, ids, chost)
    assert torch.equal(got.isinf(), want.isinf())
    fin = ~want.isinf()
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-3)
    if not with_host:
        torch.testing.assert_close(got, page_scores("centroid", qg, summ, 0, ids), rtol=1e-4, atol=1e-3)


def test_quest_scores_8bit_real_sizes() -> None:
    """8-bit summaries at a real layer's size (8 kv heads x 4, head_dim 128, both tiers, a 256K
    table's width with a limit): bound and midrange (hybrid-mid's launch) == their references."""
    from kvtier.kernels import retrieval_attention as ra
    g = torch.Generator(device="cuda").manual_seed(5)
    hkv, grp, d, pages, host_pages, c = 8, 4, 128, 4166, 12220, 16386

    def codes(n: int) -> tuple[torch.Tensor, ...]:
        a, b = torch.randn(2, n, hkv, d, device="cuda", generator=g) * 3
        cnt = torch.full((n,), PS, dtype=torch.int32, device="cuda")
        cnt[::101] = 0  # empty pages score +inf
        return interp_cases._codes((torch.minimum(a, b), torch.maximum(a, b), cnt))
    dev, host = codes(pages), codes(host_pages)
    ids = torch.cat([torch.arange(pages), -1 - torch.arange(c - pages)]).cuda()[None].repeat(2, 1)
    qg = (torch.randn(2, hkv, grp, d, device="cuda", generator=g) * 2).bfloat16()
    limit = torch.tensor([c, 9000], device="cuda")
    cand = torch.arange(c, device="cuda")[None].repeat(2, 1)
    bound, mid = ra.quest_scores(qg, dev, ids, False, host, limit=limit, cand_idx=cand, midrange=True)
    off = (torch.arange(c, device="cuda")[None, None, :] >= limit[:, None, None])
    for got, want in ((bound, ra.quest_scores_reference(qg.float(), dev, ids, False, host)),
                      (mid, ra.midrange_scores_reference(qg.float(), dev, ids, host))):
        want = want.masked_fill(off, float("-inf"))
        assert torch.equal(got.isinf(), want.isinf()) and bool((got == float("inf")).any())
        fin = want.isfinite()
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-3)


def _median_us(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    return cases.median_us(fn, warmup, repeats)


def _random_pages(name: str, num_pages: int) -> dict[str, torch.Tensor]:
    return cases.random_pages(name, num_pages, BW_KV_HEADS, PS, BW_D)


def test_print_bandwidth() -> None:
    """us/call and GB/s (selected K + V codes + scales) next to paged_decode over as many tokens."""
    from kvtier.kernels import paged_attention as pa
    from kvtier.kernels import retrieval_attention as ra
    num_pages = max(BW_BATCHES) * max(BW_CONTEXTS) // PS
    hq, keys = BW_KV_HEADS * BW_GQA, BW_N_SEL * PS
    print(f"\npaged_decode_selected  Hkv={BW_KV_HEADS} Hq={hq} D={BW_D} page={PS} n_sel={BW_N_SEL} ({_num_sms()} SMs)")
    print(f"{'format':>6} {'B':>3} {'context':>7} {'splits':>6} {'us/call':>9} {'GB/s':>7} {'dense us':>9}")
    for name in BW_FORMATS:
        fmt = make_format(name)
        st = _random_pages(name, num_pages)
        perm = torch.randperm(num_pages, device="cuda")  # scattered pages
        sink = None
        if fmt.quantized:  # as the engine: each sequence's first page has an exact sink row
            sink_k = torch.randn(max(BW_BATCHES), BW_KV_HEADS, BW_D, device="cuda", dtype=torch.bfloat16)
            sink = (sink_k, sink_k.clone(), torch.full((num_pages,), -1, dtype=torch.long, device="cuda"))
        for batch in BW_BATCHES:
            for ctx in BW_CONTEXTS:
                pages = ctx // PS
                table = perm[:batch * pages].view(batch, pages)
                if sink is not None:
                    sink[2].fill_(-1)
                    sink[2][table[:, 0]] = torch.arange(batch, device="cuda")
                # each kv head its own pages: 0 (the sink's), then distinct random others
                idx = torch.rand(batch, BW_KV_HEADS, pages - 1, device="cuda").argsort(-1)[..., :BW_N_SEL - 1] + 1
                idx = torch.cat([torch.zeros_like(idx[..., :1]), idx], -1)
                ids = table.gather(1, idx.flatten(1)).view_as(idx)
                valid = torch.ones_like(idx, dtype=torch.bool)
                lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
                q = torch.randn(batch, hq, BW_D, device="cuda", dtype=torch.bfloat16)
                splits = ra.selected_num_splits(batch, BW_KV_HEADS, BW_N_SEL, PS, _num_sms())
                out = torch.empty_like(q)
                us = _median_us(lambda: ra.paged_decode_selected(q, st, fmt, ids, idx, valid, lens, BW_D ** -0.5,
                                                                 splits, sink=sink, out=out), BW_WARMUP, BW_REPEATS)
                dense_table = table[:, :BW_N_SEL].to(torch.int32)
                dense_lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
                dense_us = _median_us(lambda: pa.paged_decode(q, st, fmt, dense_table, dense_lens, BW_D ** -0.5,
                                                              splits, sink=sink, out=out), BW_WARMUP, BW_REPEATS)
                gbs = batch * keys * fmt.bytes_per_token(BW_KV_HEADS, BW_D) / (us * 1e-6) / 1e9
                print(f"{name:>6} {batch:>3} {ctx:>7} {splits:>6} {us:>9.1f} {gbs:>7.0f} {dense_us:>9.1f}")
        st = perm = None  # freed before the next format allocates
        torch.cuda.empty_cache()


@pytest.mark.parametrize("name", ["bf16", "int8", "k8v4", "int4"])
def test_selected_host_pages_in_place_match_reference(name: str) -> None:
    """Lists naming pinned host pages (negative ids, AltPages) read them over the bus in place."""
    from kvtier.kernels import retrieval_attention as ra
    dtype = cases.compute_dtype(name, torch.bfloat16)
    case = cases.make_case(name, 2, 4, PS, 128, [700, 90, 1500, 33], [True, False, True, True], dtype, "cuda",
                           seed=31)
    case, alt = cases.with_alt_pages(case, seed=32, alt_device="pinned")
    sel = cases.make_selection(case, 24, seed=33)
    for splits in (1, 5):
        cases.check_selected(ra, case, sel, splits, use_sink=case.pool.fmt.quantized, alt=alt)


@pytest.mark.parametrize("name", ["bf16", "int8", "k8v4", "int4"])
@pytest.mark.parametrize("gqa", [1, 4])
def test_backend_wired_to_kernel_matches_its_torch_path(name: str, gqa: int) -> None:
    """RetrievalAttention on CUDA attends through paged_decode_selected (kernel=None: on CUDA);
    the same step through its PyTorch path (kernel=False) gives the same rows."""
    args = (name, 4, gqa, PS, 128, [700, 90, 1500, 330])
    kw = dict(budget=256, dtype=torch.bfloat16, device="cuda", seed=gqa)
    ref = cases.retrieval_step(*args, kernel=False, **kw)
    got = cases.retrieval_step(*args, kernel=True, **kw)
    assert ref.q.shape[0] == 3 and torch.equal(ref.q, got.q)
    torch.testing.assert_close(got.out.float(), ref.out.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("selector", ["hybrid-mid", "quest"])
def test_backend_with_8bit_summaries_matches_its_torch_path(selector: str) -> None:
    """8-bit summaries (kv/summaries.py): the engine's kernel path (the update kernel, the scorer
    over codes) selects and attends as the PyTorch path over the same codes does."""
    args = ("k8v4", 4, 4, PS, 128, [700, 90, 1500, 330])
    kw = dict(budget=256, dtype=torch.bfloat16, device="cuda", seed=5, selector=selector, summary_bits=8)
    ref = cases.retrieval_step(*args, kernel=False, **kw)
    got = cases.retrieval_step(*args, kernel=True, **kw)
    assert ref.q.shape[0] == 3 and torch.equal(ref.q, got.q)
    torch.testing.assert_close(got.out.float(), ref.out.float(), rtol=2e-2, atol=2e-2)
