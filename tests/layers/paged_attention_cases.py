"""Shared checks of the paged decode kernel (kvtier/kernels/paged_attention.py) against its reference.

Used by tests/layers/test_paged_attention_interp.py (TRITON_INTERPRET=1 on CPU,
tiny sizes; run as a script) and tests/gpu/test_paged_attention.py (CUDA).

A case is a one-layer PagePool whose every slot holds a real random row written
through PagePool.write (so codes, scales and K smoothing are what the engine
stores, and rows past a sequence's end are not zeros), sequences on shuffled
pages, block-table tails filled with arbitrary valid page ids, and sink slots
on some sequences' first pages.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from kvtier.kv.formats import FORMAT_NAMES, make_format
from kvtier.kv.pool import PagePool

PLAIN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Kernel vs reference, per compute dtype: the kernel rounds the softmax probabilities to the
# compute dtype for its P @ V tensor-core product, and applies int8/fp8 scales after the dot.
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}  # elementwise, rtol = atol
# ... and |kernel - reference| / |reference| over a whole call (measured in the interpreter: fp32
# 3e-7, fp16 1.5e-4 to 4e-4; bf16 has 8x fp16's rounding step; fp32 on CUDA uses tf32x3 dots).
REL_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
# Spare pages beyond the sequences' own: the block-table tails point at them too.
SPARE_PAGES = 3
NUM_SLOTS = 8  # sink slots of the standalone sink tensors (plain formats have none in their pool)


@dataclass
class Case:
    """Inputs of one paged_decode call."""

    fmt_name: str
    q: torch.Tensor  # [B, Hq, D] in the compute dtype
    st: dict[str, torch.Tensor]  # one pool layer
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    sink: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (sink_k, sink_v, sink_slot)
    scale: float
    pool: PagePool


def compute_dtype(name: str, quant_dtype: torch.dtype) -> torch.dtype:
    """Plain formats compute in their own dtype; quantized ones in `quant_dtype`."""
    return PLAIN_DTYPES.get(name, quant_dtype)


def interp_dtype(name: str, quant_dtype: torch.dtype) -> torch.dtype:
    """compute_dtype, but fp32 for bf16 pages: the Triton 3.9 interpreter's tl.dot on bf16
    operands multiplies their raw bits (measured: errors ~1e10), so bf16 dots run on the GPU only."""
    dtype = compute_dtype(name, quant_dtype)
    return torch.float32 if dtype == torch.bfloat16 else dtype


def make_case(name: str, kv_heads: int, gqa: int, page_size: int, head_dim: int, seq_lens: list[int],
              with_sink: list[bool], dtype: torch.dtype, device: str, seed: int) -> Case:
    """A pool of random rows and B = len(seq_lens) sequences; with_sink[b]: seq b's first page has a slot."""
    fmt = make_format(name)
    g = torch.Generator().manual_seed(seed)
    need = [max(1, math.ceil(n / page_size)) for n in seq_lens]  # a seq_len-0 row still has a page id
    num_pages = sum(need) + SPARE_PAGES
    pool = PagePool(fmt, 1, num_pages, kv_heads, page_size, head_dim, device, compute_dtype=dtype)
    rows = num_pages * page_size
    k = torch.randn(rows, kv_heads, head_dim, generator=g) * 2 + 0.5
    v = torch.randn(rows, kv_heads, head_dim, generator=g)
    pool.write(0, torch.randperm(rows, generator=g).to(device), k.to(device, dtype), v.to(device, dtype))
    free = torch.randperm(num_pages, generator=g).tolist()
    table = torch.randint(0, num_pages, (len(seq_lens), max(need) + 1), generator=g)  # tails: any valid id
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor([free.pop() for _ in range(n)])
    firsts = [int(table[b, 0]) for b, s in enumerate(with_sink) if s]
    if pool.sink_slots:  # quantized formats: the pool's own sink tensors and page -> slot map
        slots = pool.assign_sinks(firsts)
        sink_k, sink_v, sink_slot = pool.kernel_sink(0)
    else:
        slots = torch.randperm(NUM_SLOTS, generator=g)[:len(firsts)].to(device)
        sink_k = torch.zeros(NUM_SLOTS, kv_heads, head_dim, dtype=dtype, device=device)
        sink_v = torch.zeros_like(sink_k)
        sink_slot = torch.full((num_pages,), -1, dtype=torch.long, device=device)
        sink_slot[torch.tensor(firsts, dtype=torch.long, device=device)] = slots
    if firsts:  # exact rows that differ from the quantized row 0 of the page
        sink_k[slots] = (torch.randn(len(firsts), kv_heads, head_dim, generator=g) * 2).to(device, dtype)
        sink_v[slots] = torch.randn(len(firsts), kv_heads, head_dim, generator=g).to(device, dtype)
    q = torch.randn(len(seq_lens), kv_heads * gqa, head_dim, generator=g).to(device, dtype)
    return Case(name, q, pool.layers[0], table.to(device, torch.int32),
                torch.tensor(seq_lens, dtype=torch.int32, device=device), (sink_k, sink_v, sink_slot),
                head_dim ** -0.5, pool)


def check_case(pa: ModuleType, case: Case, num_splits: int, use_sink: bool) -> None:
    """Kernel == reference (to the compute dtype's tolerance); seq_len-0 rows exactly zero."""
    sink = case.sink if use_sink else None
    fmt = case.pool.fmt
    got = pa.paged_decode(case.q, case.st, fmt, case.block_table, case.seq_lens, case.scale, num_splits, sink=sink)
    want = pa.paged_decode_reference(case.q, case.st, fmt, case.block_table, case.seq_lens, case.scale, sink=sink)
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    tol = TOLERANCE[case.q.dtype]
    err = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), \
        f"{case.fmt_name} splits={num_splits} sink={use_sink}: max |kernel - reference| = {err:.3g}"
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < REL_TOLERANCE[case.q.dtype], \
        f"{case.fmt_name} splits={num_splits} sink={use_sink}: relative error {rel:.3g}"
    empty = case.seq_lens == 0
    assert not got[empty].any(), "a seq_len-0 row is not zero"
    if use_sink and bool((case.sink[2][case.block_table[:, 0].long()] >= 0).any()):
        plain = pa.paged_decode_reference(case.q, case.st, fmt, case.block_table, case.seq_lens, case.scale)
        assert not torch.allclose(plain, want, rtol=tol, atol=tol), "the sink rows changed nothing: vacuous test"


def check_native_fold(pa: ModuleType, case: Case, num_splits: int) -> None:
    """paged_decode(raw q, native=...) (q's smoothing + rotation and the output's rotation folded
    into the kernels) == native_out(reference(native_q(q))), the pool's own op-by-op path."""
    pool, fmt = case.pool, case.pool.fmt
    sink = case.sink
    native = pa.NativeDomain(pool.k_channel_scale[0], fmt.rotate_k, fmt.rotate_v)
    got = pa.paged_decode(case.q, case.st, fmt, case.block_table, case.seq_lens, case.scale, num_splits,
                          sink=sink, native=native)
    ref = pa.paged_decode_reference(pool.native_q(0, case.q), case.st, fmt, case.block_table, case.seq_lens,
                                    case.scale, sink=sink)
    want = pool.native_out(ref)
    tol = TOLERANCE[case.q.dtype]
    err = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), \
        f"{case.fmt_name} folded splits={num_splits}: max |kernel - reference| = {err:.3g}"


def aligned_copy(t: torch.Tensor, device: str, pin: bool = False) -> torch.Tensor:
    """A contiguous copy of t on `device` starting on a 4 KiB boundary (the kernels address an
    alternate source by whole rows from the pool's tensors: CUDA and pinned allocations are
    aligned so; plain CPU allocations only to 64 bytes)."""
    nbytes = t.numel() * t.element_size()
    buf = torch.empty(nbytes + 4096, dtype=torch.uint8, device=device, pin_memory=pin)
    off = -buf.data_ptr() % 4096
    out = buf[off:off + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def with_alt_pages(case: Case, seed: int, alt_device: str | None = None) -> tuple[Case, object]:
    """The same case with about half of each sequence's pages moved to a second source
    (kernels' AltPages): table entry p becomes -1 - a, alt page a holds page p's codes (pages
    and sink slots shuffled there), while the pool's copy of a moved page is overwritten with
    another page's codes and loses its sink slot: reading the pool instead gives other numbers.
    alt_device: where the alternate pages live ("pinned": pinned host memory; default: the case's)."""
    import dataclasses

    from kvtier.kernels.paged_attention import AltPages
    g = torch.Generator().manual_seed(seed)
    dev = case.q.device
    n_pages = case.st["k"].shape[0]
    perm = torch.randperm(n_pages, generator=g)  # alt page a holds pool page perm[a]
    inv = torch.argsort(perm)
    s = case.st["k"].shape[2]
    table = case.block_table.long().cpu()
    live = torch.arange(table.shape[1])[None, :] < ((case.seq_lens.long().cpu() + s - 1) // s)[:, None]
    move = live & (torch.rand(table.shape, generator=g) < 0.5)
    move[:, 0] |= live[:, 0] & (torch.arange(table.shape[0]) % 2 == 0)  # first pages (sinks) of every other row
    moved = table[move].unique()

    def place(t: torch.Tensor, where: str | None = None) -> torch.Tensor:
        if (where or alt_device) == "pinned":
            return aligned_copy(t, "cpu", pin=True)
        return aligned_copy(t, where or alt_device or str(dev))

    alt_st = {name: place(t[perm.to(t.device)]) for name, t in case.st.items()}
    other = torch.roll(torch.arange(n_pages), 1).to(dev)
    st = {}
    for name, t in case.st.items():
        t = place(t, str(dev))
        t[moved.to(dev)] = case.st[name][other[moved.to(dev)]]
        st[name] = t
    sk, sv, slot = case.sink
    sperm = torch.randperm(sk.shape[0], generator=g).to(sk.device)  # alt slot j holds pool slot sperm[j]
    sinv = torch.argsort(sperm)
    pslot = slot[perm.to(slot.device)]
    alt_slot = torch.where(pslot >= 0, sinv[pslot.clamp_min(0)], pslot)
    alt = AltPages(alt_st, (place(sk[sperm]), place(sv[sperm]), place(alt_slot)))
    slot = slot.clone()
    slot[moved.to(slot.device)] = -1
    new_table = torch.where(move, -1 - inv[table], table).to(dev, case.block_table.dtype)
    return dataclasses.replace(case, st=st, block_table=new_table, sink=(sk, sv, slot)), alt


def check_alt_case(pa: ModuleType, case: Case, alt: object, num_splits: int, use_sink: bool) -> None:
    """paged_decode reading negative ids from `alt` == its reference given the same alt."""
    sink = case.sink if use_sink else None
    fmt = case.pool.fmt
    args = (case.q, case.st, fmt, case.block_table, case.seq_lens, case.scale)
    got = pa.paged_decode(*args, num_splits, sink=sink, alt=alt)
    want = pa.paged_decode_reference(*args, sink=sink, alt=alt)
    tol = TOLERANCE[case.q.dtype]
    err = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), \
        f"{case.fmt_name} alt splits={num_splits} sink={use_sink}: max |kernel - reference| = {err:.3g}"
    assert bool((case.block_table < 0).any()), "no page moved: vacuous"


# (format, gqa, page_size, head_dim, seq_lens, with_sink, quantized-format compute dtype)
LENS = [5, 0, 13, 1, 33]  # odd lengths, partial pages, a padding row, one token
SINKS = [True, True, False, True, False]
INTERP_CASES = [(name, gqa, 4, 16, LENS, SINKS, torch.float32) for name in FORMAT_NAMES for gqa in (1, 2, 4)]
INTERP_CASES += [
    ("int4", 2, 4, 64, [37, 3], [True, False], torch.float32),  # int4: several scale groups a row
    ("k8v4", 1, 2, 32, [300, 7], [False, True], torch.float32),  # several tiles per split
    ("int8", 4, 8, 32, [19, 0, 64], [True, False, True], torch.float16),
    ("fp8", 2, 4, 16, [11, 26], [True, True], torch.float16),
    ("k8v4", 2, 4, 64, [37, 3], [True, False], torch.float16),  # word-wise int8 / int4 -> fp16 decode
    ("int4", 1, 4, 32, [21, 6], [False, True], torch.float16),
    # int8 V tiles as column sets, one dot a set (paged_attention.code_parts), from D = 64
    ("int8", 2, 4, 64, [23, 9], [True, False], torch.float16),
    ("k8v4", 2, 4, 128, [37, 3], [True, False], torch.float16),
    ("int4", 1, 4, 128, [21, 6], [False, True], torch.float16),  # (one int4 tile: parts measured slower)
]
# Negative page ids read from a second source (AltPages): a few formats, sinks on first pages.
ALT_CASES = [("fp32", 2, 4, 16, LENS, SINKS, torch.float32), ("int8", 1, 4, 16, [29, 9], [True, True], torch.float32),
             ("k8v4", 2, 4, 32, [37, 3], [True, False], torch.float16),
             ("int4", 2, 4, 64, [21, 18], [True, True], torch.float32),
             ("k8v4", 1, 4, 128, [29, 5], [True, False], torch.float16)]
# Folded native domain (NativeDomain): (format, gqa, head_dim, q dtype); D = 64 takes two R chunks.
FOLD_CASES = [("int8", 2, 64, torch.float32), ("k8v4", 2, 32, torch.float16), ("int4", 1, 16, torch.float32),
              ("k8v4", 2, 128, torch.float16)]
# (num_splits, with sinks): splits 1 with and without sinks, 3 with (each ~18 ms a program here)
INTERP_RUNS = ((1, False), (1, True), (3, True))


def main() -> None:
    """Run every interpreter case (TRITON_INTERPRET=1 must be set before triton is imported)."""
    import kvtier.kernels.paged_attention as pa
    failures = []
    for i, (name, gqa, ps, hd, lens, sinks, qdt) in enumerate(INTERP_CASES):
        kv_heads = 1 if gqa == 4 else 2  # 4 query heads at most: the interpreter runs programs one by one
        case = make_case(name, kv_heads, gqa, ps, hd, lens, sinks, interp_dtype(name, qdt), "cpu", seed=i)
        for splits, use_sink in INTERP_RUNS:
            try:
                check_case(pa, case, splits, use_sink)
            except AssertionError as e:
                failures.append(f"{name} gqa={gqa} ps={ps} D={hd} splits={splits} sink={use_sink}: {e}")
    for i, (name, gqa, ps, hd, lens, sinks, qdt) in enumerate(ALT_CASES):
        case = make_case(name, 2, gqa, ps, hd, lens, sinks, interp_dtype(name, qdt), "cpu", seed=200 + i)
        case, alt = with_alt_pages(case, seed=300 + i)
        for splits, use_sink in INTERP_RUNS:
            try:
                check_alt_case(pa, case, alt, splits, use_sink)
            except AssertionError as e:
                failures.append(f"{name} alt gqa={gqa} splits={splits} sink={use_sink}: {e}")
    for i, (name, gqa, hd, qdt) in enumerate(FOLD_CASES):
        case = make_case(name, 2, gqa, 4, hd, [21, 6], [True, False], qdt, "cpu", seed=100 + i)
        for splits in (1, 3):
            try:
                check_native_fold(pa, case, splits)
            except AssertionError as e:
                failures.append(f"{name} folded gqa={gqa} D={hd} splits={splits}: {e}")
    print("\n".join(failures) if failures else "ALL OK")


# ---------------------------------------------------------------------------------------------
# Per-(row, kv head) page lists: kvtier/kernels/retrieval_attention.py paged_decode_selected
# (tests/layers/test_retrieval_kernel_interp.py, tests/gpu/test_retrieval_kernel.py).
# ---------------------------------------------------------------------------------------------

@dataclass
class Selection:
    """Per-(row, kv head) lists over a Case's sequences, as RetrievalAttention.select gives them."""

    page_ids: torch.Tensor  # [B, Hkv, n_sel] int64 pool page ids
    page_idx: torch.Tensor  # [B, Hkv, n_sel] int64 page index within the sequence (>= 0)
    valid: torch.Tensor  # [B, Hkv, n_sel] bool


def make_selection(case: Case, n_sel: int, seed: int) -> Selection:
    """Random lists over each sequence's pages: per kv head a different subset in shuffled order,
    always the last (partial) page, page 0 (the sink's) in about half the lists, and
    invalid entries that name real pages of the sequence (read them and the result changes):
    page 0 in the lists that did not choose it (its sink row must not count either)."""
    g = torch.Generator().manual_seed(seed)
    bsz, hkv = case.q.shape[0], case.st["k"].shape[1]
    s = case.st["k"].shape[2]
    idx = torch.zeros(bsz, hkv, n_sel, dtype=torch.long)
    valid = torch.zeros(bsz, hkv, n_sel, dtype=torch.bool)
    for b, n in enumerate(case.seq_lens.tolist()):
        n_pages = math.ceil(n / s)
        for h in range(hkv):
            order = torch.randperm(n_pages, generator=g).tolist()
            if n_pages:
                order.remove(n_pages - 1)
                order.insert(0, n_pages - 1)
            if n_pages > 1:  # page 0 second (chosen) or last (chosen only if the list takes every page)
                order.remove(0)
                order.insert(1 if (b + h + seed) % 2 == 0 else len(order), 0)
            take = min(len(order), max(1, n_sel - 2)) if n_pages else 0  # >= 2 invalid when room
            filler = order[-1] if 0 in order[:take] else 0  # invalid entries: real pages, page 0 if unchosen
            chosen = order[:take] + [filler] * (n_sel - take)
            perm = torch.randperm(n_sel, generator=g)
            idx[b, h] = torch.tensor(chosen)[perm]
            valid[b, h] = (torch.arange(n_sel) < take)[perm]
    table = case.block_table.long().cpu()
    ids = table.gather(1, idx.view(bsz, -1).clamp_max(table.shape[1] - 1)).view(bsz, hkv, n_sel)
    dev = case.q.device
    return Selection(ids.to(dev), idx.to(dev), valid.to(dev))


def check_selected(ra: ModuleType, case: Case, sel: Selection, num_splits: int, use_sink: bool,
                   idx_only: bool = False, alt: object | None = None) -> None:
    """paged_decode_selected == its reference; idx_only: invalid entries as page_idx -1, valid None;
    alt: where negative page ids point (with_alt_pages). With sinks, the sink rows must change
    the result (else the test is vacuous)."""
    sink = case.sink if use_sink else None
    fmt = case.pool.fmt
    idx, valid = sel.page_idx, sel.valid
    if idx_only:
        idx, valid = torch.where(sel.valid, sel.page_idx, -1), None
    args = (case.q, case.st, fmt, sel.page_ids, idx, valid, case.seq_lens, case.scale)
    got = ra.paged_decode_selected(*args, num_splits, sink=sink, alt=alt)
    want = ra.paged_decode_selected_reference(*args, sink=sink, alt=alt)
    tag = f"{case.fmt_name} selected splits={num_splits} sink={use_sink} idx_only={idx_only}"
    assert got.shape == case.q.shape and got.dtype == case.q.dtype, tag
    tol = TOLERANCE[case.q.dtype]
    err = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), f"{tag}: max |kernel - ref| = {err:.3g}"
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < REL_TOLERANCE[case.q.dtype], f"{tag}: relative error {rel:.3g}"
    assert not got[case.seq_lens == 0].any(), f"{tag}: a ctx-0 row is not zero"
    everything = ra.paged_decode_selected_reference(case.q, case.st, fmt, sel.page_ids, sel.page_idx,
                                                    torch.ones_like(sel.valid), case.seq_lens, case.scale, sink=sink,
                                                    alt=alt)
    assert not torch.allclose(everything, want, rtol=tol, atol=tol), f"{tag}: invalid entries change nothing"
    if use_sink:
        plain = ra.paged_decode_selected_reference(*args, alt=alt)
        assert not torch.allclose(plain, want, rtol=tol, atol=tol), f"{tag}: the sink rows changed nothing"


def check_selected_native_fold(ra: ModuleType, case: Case, sel: Selection, num_splits: int) -> None:
    """paged_decode_selected(raw q, native=...) == native_out(reference(native_q(q)))."""
    from kvtier.kernels.paged_attention import NativeDomain
    pool, fmt = case.pool, case.pool.fmt
    native = NativeDomain(pool.k_channel_scale[0], fmt.rotate_k, fmt.rotate_v)
    rest = (sel.page_ids, sel.page_idx, sel.valid, case.seq_lens, case.scale)
    got = ra.paged_decode_selected(case.q, case.st, fmt, *rest, num_splits, sink=case.sink, native=native)
    want = pool.native_out(ra.paged_decode_selected_reference(pool.native_q(0, case.q), case.st, fmt, *rest,
                                                              sink=case.sink))
    tol = TOLERANCE[case.q.dtype]
    err = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), \
        f"{case.fmt_name} selected folded splits={num_splits}: max |kernel - reference| = {err:.3g}"


@dataclass
class RetrievalStep:
    """One decode step of RetrievalAttention and what its selecting rows attended to."""

    pool: PagePool
    q: torch.Tensor  # [R, Hq, D] raw queries of the selecting rows
    out: torch.Tensor  # [R, Hq, D] RetrievalAttention.forward's output for them
    sel: Selection  # the lists it chose (last_selection), page ids from the rows' page tables
    ctx: torch.Tensor  # [R] int64 context lengths
    scale: float


def retrieval_step(name: str, kv_heads: int, gqa: int, page_size: int, head_dim: int, ctx_lens: list[int],
                   budget: int, dtype: torch.dtype, device: str, seed: int,
                   kernel: bool | None = None, selector: str = "quest", summary_bits: int = 16) -> RetrievalStep:
    """Sequences of ctx_lens on shuffled pages, history written as one prefill each (sink rows and
    summaries as the engine writes them), then one decode row each through RetrievalAttention
    (`selector`, sink 1 token, window 1 page): every row with ctx > budget selects. kernel: None
    records the selection (PyTorch path; RetrievalStep.sel); True / False attend through the
    kernel or the PyTorch path without recording (sel is None). summary_bits: 8 for int8 summaries."""
    from kvtier.config import RetrievalConfig
    from kvtier.layers.attention import AttentionMetadata
    from kvtier.layers.retrieval import RetrievalAttention
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / page_size) for n in ctx_lens]
    num_pages = sum(need) + SPARE_PAGES
    pool = PagePool(make_format(name), 1, num_pages, kv_heads, page_size, head_dim, device, compute_dtype=dtype)
    scale = head_dim ** -0.5
    config = RetrievalConfig(budget=budget, sink=1, window=page_size, selector=selector, summary_bits=summary_bits)
    att = RetrievalAttention(pool, scale, config, record=kernel is None, kernel=bool(kernel))
    free = torch.randperm(num_pages, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    hq = kv_heads * gqa
    ks = [(torch.randn(n, kv_heads, head_dim, generator=g) * 2 + 0.5).to(device, dtype) for n in ctx_lens]
    vs = [torch.randn(n, kv_heads, head_dim, generator=g).to(device, dtype) for n in ctx_lens]
    slots = [torch.tensor([pt[p // page_size] * page_size + p % page_size for p in range(n)], device=device)
             for pt, n in zip(tables, ctx_lens)]
    for b, n in enumerate(ctx_lens):  # the history: one prefill chunk of n - 1 rows
        meta = AttentionMetadata([0, n - 1], [n - 1], [tables[b]], slots[b][:-1], torch.tensor([n - 2]))
        att.plan(meta)
        att.forward(0, torch.zeros(n - 1, hq, head_dim, dtype=dtype, device=device), ks[b][:-1], vs[b][:-1], meta)
    bsz = len(ctx_lens)
    meta = AttentionMetadata(list(range(bsz + 1)), list(ctx_lens), tables, torch.stack([s[-1] for s in slots]),
                             torch.arange(bsz))
    q = torch.randn(bsz, hq, head_dim, generator=g).to(device, dtype)
    att.plan(meta)
    out = att.forward(0, q, torch.stack([k[-1] for k in ks]), torch.stack([v[-1] for v in vs]), meta)
    chosen = meta.step_cache[id(att)].sel  # the step's selection tables (rows, ctx, page tables)
    if kernel is not None:
        return RetrievalStep(pool, q[chosen.rows], out[chosen.rows], None, chosen.ctx, scale)
    idx, valid = att.last_selection[0]  # [R, Hkv, n_sel]
    ids = chosen.table.gather(1, idx.flatten(1)).view_as(idx)
    return RetrievalStep(pool, q[chosen.rows], out[chosen.rows], Selection(ids, idx, valid), chosen.ctx, scale)


def random_pages(name: str, num_pages: int, kv_heads: int, page_size: int, head_dim: int,
                 device: str = "cuda") -> dict[str, torch.Tensor]:
    """One layer of `name` pages filled with random codes / values (timing only)."""
    st = make_format(name).allocate(num_pages, kv_heads, page_size, head_dim, torch.device(device))
    for key, t in st.items():
        if key.endswith("_scale"):
            t.uniform_(0.01, 0.02)
        elif t.dtype == torch.int8:
            t.random_(-127, 128)
        elif t.dtype == torch.uint8:
            t.random_(0, 256)
        else:
            t.normal_()
    return st


def median_us(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median CUDA-event time of fn() in microseconds, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    main()
