"""Retrieval attention ("retrieval"): past a token budget, a decode row attends to the pages it picks.

For each decode row whose sequence holds more than `budget` tokens, and per kv head (the query
heads of a GQA group choose together):

    page index:  0 .. sink-1 | sink .................................. w0-1 | w0 ...... n-1
                 sink pages  | candidates: the top-k by a score from        | window pages: the
                 (always)    | kv/summaries.py PageSummaries, per kv head   | last `window` tokens
                             | (pinned pages: always, not candidates)       | (always; n-1 holds the
                                                                            | current token)
    k = budget // page_size - sink pages - pinned pages - window pages

Pinned pages (AttentionMetadata.pinned_pages, from the request's pinned spans: system prompt and
tools, the current user turn and its tool trajectory; server/spans.py) are attended like the sink
and the window; admission (engine/request.py PinnedBudget) refuses requests whose pinned pages,
sink and window exceed the budget.

and attends exactly (softmax over the selected keys only) over those pages. Everything else (prefill
chunks, sequences at or under the budget) goes through the owned DensePagedAttention unchanged (the
Triton backend on CUDA), so under the budget this backend IS dense attention. On CUDA with a
kernel-scored selector (GRAPH_SELECTORS), decode steps instead take the graph formulation, eager or
captured in CUDA graphs alike: every row selects (`_graph_tables`), and a row under the budget
selects all of its pages: the same attention, summed in the selected kernel's order.

Host tier: a sequence longer than the compute pool has its oldest pages in the host tier (negative
page-table entries, kv/manager.py). Their summaries sit in a second PageSummaries on the compute
device (`host_summaries`), filled as pages are copied down (`pages_departed`) and read back as they
come up (`pages_arrived`), so candidates are scored alike in either tier. A selecting row then
fetches only the host pages some kv head chose, through `HostPageCache`: per layer, an LRU of
recently fetched pages (decoded, on the compute device); a miss moves that page's stored codes for
that layer (`PagePool.read_from`), a hit moves nothing. `fetch_stats` counts pages asked for, hits,
misses and the stored bytes the misses moved. The same selection reads the same keys whichever tier
they sit in, so host tier forced == everything on the GPU, token for token (tests/engine).

Selectors (score of a candidate page for a query row; q grouped [Hkv, g, D]):
    quest      sum over the group of the Quest bound sum_d max(q_d min_d, q_d max_d) >= max q.k
    quest-max  max over the group of the same bound (a page any one query head needs)
    meankey    the seeds' baseline: page mean key . group-mean q, summed over kv heads: ONE page
               list per layer shared by all kv heads
    centroid   per kv head: the page's mean key . the group's summed q
    hybrid     half of the top-k by `quest`, the rest by `centroid` among the pages left
    midrange   per kv head: the page's (kmin + kmax) / 2 . the group's summed q (no key sums)
    hybrid-mid half by `quest`, the rest by `midrange`: both from kmin / kmax (one launch on the
               fused path), so the summaries keep no key sums

Shapes stay what a Triton version will take: the selection is [R, Hkv, n_sel] page indices / page
ids / validity for the R selected rows; no Python loop over heads or layers. This reference reads
the selected pages of all kv heads and keeps each head's own (Hkv x the bytes a kernel would read).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvtier.config import RetrievalConfig
from kvtier.kernels import cpu_ops
from kvtier.kernels import retrieval_attention as ra
from kvtier.kernels.fused import QKRope
from kvtier.kernels.hot_pages import HotPages
from kvtier.kv.summaries import PageSummaries
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention, plan_sink_rows

# Selectors whose scores a captured step can compute: the fused score kernels (power-of-two head_dim).
GRAPH_SELECTORS = ("quest", "quest-max", "centroid", "hybrid", "midrange", "hybrid-mid")
# hybrid selectors: the score that picks the second half
HYBRIDS = {"hybrid": "centroid", "hybrid-mid": "midrange"}


def graph_capable(config: RetrievalConfig, head_dim: int, device: torch.device) -> bool:
    """Whether decode steps of this retrieval config can be captured in CUDA graphs: on CUDA, with a
    selector scored by a kernel; the selected pages are read by the selected-pages kernel."""
    return device.type == "cuda" and config.selector in GRAPH_SELECTORS and head_dim & (head_dim - 1) == 0


def refresh_from_pool(store, targets: list[PageSummaries], ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Each of `targets` recomputes pages `ids` (holding `rows` [P] int32 rows each) from the
    pool's keys: read back once per layer (K minus the pool's smoothing shift, where the format
    smooths), the shift added again, so summaries bound raw q.k."""
    for layer in range(store.num_layers):
        k, _ = store.read(layer, ids)  # [P, Hkv, S, D]
        shift = store.k_shift[layer]
        if shift is not None:
            k = k.float() + shift.float()[None, :, None, :]
        for summ in targets:
            summ.refresh(layer, ids, k, rows)


class RetrievalAttention:
    """Sink + window + top-k pages per kv head past the budget; dense otherwise (module docstring).

    record: also keep, per layer call, the selection (`last_selection`) and the share of the dense
    softmax mass the selected keys hold (`mass_log`, [R, Hq] per call; computes dense scores too).
    """

    name = "retrieval"

    def __init__(self, store, scale: float, config: RetrievalConfig, host_store: object | None = None,
                 summaries: PageSummaries | None = None, record: bool = False, kernel: bool | None = None,
                 hot_pages: tuple[int, int] | None = None):
        """summaries: shared with other backends over the same pool (eval); None: a new one.
        kernel: attend through kernels/retrieval_attention.py paged_decode_selected (each kv head
        reads only its own pages, in place) when every selected page is in the compute pool;
        None: on CUDA. Recording (`record`) keeps the PyTorch path. hot_pages: (first, count) of
        pool pages no sequence owns, where the kernel path caches the host pages it selects
        (kernels/hot_pages.py; used while a host tier is read in place)."""
        if not config.enabled:
            raise ValueError("RetrievalAttention needs a kvmem budget > 0")
        self.store = store
        self.scale = scale
        self.config = config
        self.sink_pages, window_pages, self.budget_pages = config.page_counts(store.page_size)
        # pinned pages a row can hold: admission keeps pinned + sink + window within the budget
        self.pin_cap = max(1, self.budget_pages - self.sink_pages - (window_pages - 1))
        self.dense = DensePagedAttention(store, scale, host_store)
        self.native = self.dense.native
        self.kernel = (store.device.type == "cuda") if kernel is None else kernel
        # steps where no row selects (prefill chunks, contexts under the budget): the paged kernels on CUDA
        self.full = self.dense
        if self.kernel and store.device.type == "cuda":
            from kvtier.layers.backends import TritonPagedAttention
            self.full = TritonPagedAttention(store, scale, host_store)
        # key sums only for the selectors that read them (config.SUM_SELECTORS)
        self.summaries = (summaries if summaries is not None
                          else PageSummaries.for_pool(store, config.key_sums, config.summary_bits))
        self.record = record
        self.num_sms = (torch.cuda.get_device_properties(store.device).multi_processor_count
                        if store.device.type == "cuda" else 4)
        self.host_summaries: PageSummaries | None = None
        self.host_cache: HostPageCache | None = None
        self.hot_range = hot_pages
        self.hot: HotPages | None = None
        self.attach_host_tier(host_store)
        self.mass_log: list[torch.Tensor] = []
        self.last_selection: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (idx, valid)
        self.retrieved_rows = 0  # decode rows (x layers) that attended to a selection
        self.in_place_host_rows = 0  # ... of them through the kernel, host pages read over the bus
        # graph steps: each row's pinned page indices, [rows, pin cap] (-1: none), written before the
        # step (plan) and read by the captured selection; allocated by the first (largest) capture
        self.pin_buf: torch.Tensor | None = None
        self._pins_set = False

    def attach_host_tier(self, host_store: object | None) -> None:
        """Use `host_store` as the host tier (None: none). Attaching the one already attached keeps
        the state (summaries, fetch cache) that captured CUDA graphs read."""
        if host_store is not None and host_store is getattr(self, "host_store", None):
            return
        self.dense.attach_host_tier(host_store)
        if self.full is not self.dense:
            self.full.attach_host_tier(host_store)
        self.host_store = host_store
        # the selected-pages kernel reads chosen host pages over the bus, in place (AltPages)
        self.host_alts = (host_store.kernel_alts(self.store)  # type: ignore[attr-defined]
                          if self.kernel and host_store is not None else None)
        if host_store is None:
            self.host_summaries = self.host_cache = self.hot = None
            return
        st = self.store
        self.host_summaries = PageSummaries.like(st, host_store.num_pages, st.device,  # type: ignore[attr-defined]
                                                 self.summaries.sums, self.summaries.bits)
        self.host_cache = HostPageCache(st.num_layers, FETCH_CACHE_BUDGETS * self.budget_pages)
        self.hot = None
        if self.host_alts is not None and self.hot_range is not None:
            first, count = self.hot_range
            if first + count > st.num_pages:
                raise ValueError(f"GPU cache pages {first}..{first + count - 1} lie past the pool's {st.num_pages}")
            self.hot = HotPages(st.num_layers, st.kv_heads, host_store.num_pages,  # type: ignore[attr-defined]
                                first, count, st.device)

    @property
    def host_in_place(self) -> bool:
        """Whether the selected-pages kernel reads chosen host pages in place."""
        return self.host_alts is not None

    @property
    def fetch_stats(self) -> dict[str, int]:
        """Host pages asked for by selections (per layer), cache hits, misses, bytes the misses moved."""
        return dict(self.host_cache.stats) if self.host_cache is not None else {}

    def gpu_cache_stats(self) -> dict[str, int]:
        """The kernel path's GPU cache of selected host pages: host list entries looked up, hits,
        pages brought up ({} without one; a device sync)."""
        return self.hot.read_stats() if self.hot is not None else {}

    def pages_departed(self, page_ids: list[int], to_host: list[int]) -> None:
        """Pages copied down keep their summaries in the host tier; what the fetch cache held for
        those host pages is stale."""
        if self.host_summaries is None or not page_ids:
            return
        self.host_summaries.copy_rows(self.summaries, torch.tensor(page_ids, dtype=torch.long),
                                      torch.tensor(to_host, dtype=torch.long))
        self.host_cache.drop(to_host)  # type: ignore[union-attr]
        if self.hot is not None:
            self.hot.invalidate(to_host)

    def pages_arrived(self, page_ids: list[int], from_host: list[int] | None = None) -> None:
        """Swapped-in pages (prefix hits from the host tier, a sequence's pages brought back) take
        the summaries their host pages kept; pages with none recorded are recomputed from the keys
        now in the pool, so a page never ranks by the keys of whatever it held before."""
        if not page_ids:
            return
        if from_host is not None and self.host_summaries is not None:
            src = torch.tensor(from_host, dtype=torch.long)
            known = (self.host_summaries.count[0, src.to(self.host_summaries.device)] > 0).cpu()
            if bool(known.any()):
                self.summaries.copy_rows(self.host_summaries, src[known],
                                         torch.tensor(page_ids, dtype=torch.long)[known])
            page_ids = [p for p, k in zip(page_ids, known.tolist()) if not k]
            if not page_ids:
                return
        self._refresh(page_ids)

    def _refresh(self, page_ids: list[int]) -> None:
        """Summaries of whole pages (only full pages move between tiers) recomputed from the pool."""
        store = self.store
        ids = torch.tensor(page_ids, dtype=torch.long, device=store.device)
        rows = torch.full((len(page_ids),), store.page_size, dtype=torch.int32, device=store.device)
        refresh_from_pool(store, [self.summaries], ids, rows)

    @property
    def graphable(self) -> bool:
        """Decode steps run the graph formulation (and can be captured): kernels score and read."""
        return self.kernel and not self.record and graph_capable(self.config, self.store.head_dim,
                                                                 torch.device(self.store.device))

    @property
    def host_kernels(self) -> bool:
        """Whether captured steps may read host-tier pages (the graphs' host variant)."""
        return self.host_in_place

    def graph_ready(self, meta: AttentionMetadata) -> bool:
        """A planner-built decode step: every row selects, from tables of the block table's whole
        width computed on the device (`_graph_tables`): the same plan captured or eager."""
        return (self.graphable and meta.decode_step and meta.block_table is not None
                and meta.seq_lens_t is not None and (self.host_in_place or not meta.reads_host))

    def plan(self, meta: AttentionMetadata, for_graph: bool = False) -> None:
        """Once per step (also before a graph replay: it stages the pinned pages)."""
        if id(self) in meta.step_cache:
            return
        if for_graph or self.graph_ready(meta):
            self._stage_pins(meta, for_graph)
            meta.step_cache[id(self)] = _RetrievalPlan(graph=True)
            return
        meta.step_cache[id(self)] = self._plan(meta)

    def _stage_pins(self, meta: AttentionMetadata, for_graph: bool) -> None:
        """Write the step's pinned page indices into `pin_buf` (rows without any: -1)."""
        n = meta.num_seqs
        cap = self.pin_cap
        if self.pin_buf is None or self.pin_buf.shape[0] < n:
            self.pin_buf = torch.full((n, cap), -1, dtype=torch.long, device=self.store.device)
            self._pins_set = False
        lists = None if for_graph else meta.pinned_pages
        if lists and any(lists):
            pins = torch.full((n, cap), -1, dtype=torch.long)
            for i, pages in enumerate(lists):
                pins[i, :len(pages[:cap])] = torch.tensor(pages[:cap], dtype=torch.long)
            self.pin_buf[:n].copy_(pins)
            self._pins_set = True
        elif self._pins_set:
            self.pin_buf.fill_(-1)
            self._pins_set = False

    def rope_store(self, layer: int, qkv: torch.Tensor, rope: QKRope,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Graph-formulation decode steps (never a sink row): the layer's rotary and the store of
        its K / V in one launch (PagePool.rope_store), as the triton backend does; `forward` then
        folds the roped k into the summaries and stores nothing. Other steps: None."""
        plan = meta.step_cache.get(id(self))
        if plan is None or not plan.graph:
            return None
        got = self.store.rope_store(layer, meta.slot_mapping, qkv, rope)
        if got is not None:
            meta.step_cache[(id(self), layer)] = True  # this layer's rows are in the pages
        return got

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] raw (the summaries bound raw q.k) -> [T, Hq, D]."""
        plan = meta.step_cache.get(id(self))
        if plan is None:
            plan = meta.step_cache[id(self)] = self._plan(meta)
        self.summaries.update(layer, meta.slot_mapping, k, one_row_per_page=plan.graph)
        if plan.graph:  # every row selects; layer 0 builds the tables (inside a capture: replayed)
            if layer == 0:
                plan.sel = self._graph_tables(meta)
            if not meta.step_cache.pop((id(self), layer), False):  # not already written by rope_store
                self.store.write(layer, meta.slot_mapping, k, v)  # decode rows: never position 0
            return self._retrieve(layer, q, plan.sel)
        if plan.sel is None:
            return self.full.forward(layer, q, k, v, meta)
        self.store.write(layer, meta.slot_mapping, k, v, sink=plan.sink)
        out = torch.empty_like(q)
        if plan.rest_meta is not None:
            out[plan.rest_rows] = self.dense.attend(layer, q.index_select(0, plan.rest_rows), plan.rest_meta)
        out[plan.sel.rows] = self._retrieve(layer, q.index_select(0, plan.sel.rows), plan.sel)
        return out

    # -- per step ---------------------------------------------------------------------------------

    def _plan(self, meta: AttentionMetadata) -> "_RetrievalPlan":
        """Which rows select (decode rows past the budget, in either tier), their candidate /
        fixed page tables, and a dense plan for the rest."""
        qsl, budget = meta.query_start_loc, self.config.budget
        sel = [b for b in range(meta.num_seqs) if qsl[b + 1] - qsl[b] == 1 and meta.seq_lens[b] > budget]
        if not sel:
            self.full.plan(meta)
            return _RetrievalPlan()
        device = meta.slot_mapping.device
        plan = _RetrievalPlan(sink=plan_sink_rows(self.store, meta, device))
        plan.sel = self._selection_tables(meta, sel, device)
        chosen = set(sel)
        rest = [b for b in range(meta.num_seqs) if b not in chosen]
        if rest:
            rows = [r for b in rest for r in range(qsl[b], qsl[b + 1])]
            plan.rest_rows = torch.tensor(rows, dtype=torch.long).to(device)
            sub_qsl = [0]
            for b in rest:
                sub_qsl.append(sub_qsl[-1] + qsl[b + 1] - qsl[b])
            plan.rest_meta = AttentionMetadata(
                query_start_loc=sub_qsl, seq_lens=[meta.seq_lens[b] for b in rest],
                page_tables=[meta.page_tables[b] for b in rest],
                slot_mapping=meta.slot_mapping.index_select(0, plan.rest_rows),
                logits_indices=plan.rest_rows[:0])
            self.dense.plan(plan.rest_meta)
        return plan

    def _selection_tables(self, meta: AttentionMetadata, sel: list[int], device: torch.device) -> "_Selection":
        """Per selecting row: fixed pages (sink + window + pinned) and candidate pages, as device
        tensors of shapes fixed by the config and the block-table width (not by the contexts),
        computed on the device from the planner's block table and lengths: no per-page Python.

            page index:  0 .. n_sink-1 | n_sink ........... w0-1 | w0 ...... n-1
                         sink (fixed)  | candidates (pinned: fixed) | window (fixed)

        n = ceil(ctx / S), n_sink = min(sink pages, n), w0 = max(n_sink, (ctx - window) // S).
        Candidates are every table column, masked; each row takes top_k[r] = budget pages -
        its fixed pages of them, at most `k` (the budget less the fewest fixed pages of a row past
        the budget)."""
        ps = self.store.page_size
        # candidates: the columns up to the step's longest selecting table (a captured step
        # takes the whole block-table width instead: _graph_tables)
        width = max(-(-meta.seq_lens[b] // ps) for b in sel)
        if meta.block_table is not None and meta.seq_lens_t is not None:
            rows_t = torch.tensor(sel, dtype=torch.long).to(device, non_blocking=True)
            bt = meta.block_table.index_select(0, rows_t).long()
            if not self.fused_select:
                bt = bt[:, :width]
            # else the whole width, as a captured step: the kernels then run the variants the
            # capture compiled (the top-k merge specialises on the chunk count), where a narrower
            # table compiled new ones at the first step of each longer context (H100: one step of
            # 359 ms at 128K); the columns past a row's context are skipped unread
            ctx = meta.seq_lens_t.index_select(0, rows_t).long()
        else:  # metadata built by hand (tests, evals): the same tables from the Python lists
            bt = torch.zeros(len(sel), width, dtype=torch.long)
            for i, b in enumerate(sel):
                pt = meta.page_tables[b][:width]
                bt[i, :len(pt)] = torch.tensor(pt, dtype=torch.long)
            bt = bt.to(device, non_blocking=True)
            ctx = torch.tensor([meta.seq_lens[b] for b in sel], dtype=torch.long).to(device, non_blocking=True)
        pin = None
        lists = meta.pinned_pages
        if lists and any(lists[b] for b in sel):  # pinned pages between the sink and the window: fixed
            most = max(len(lists[b]) for b in sel)
            pin = torch.full((len(sel), most), -1, dtype=torch.long)
            for i, b in enumerate(sel):
                pin[i, :len(lists[b])] = torch.tensor(lists[b], dtype=torch.long)
            pin = pin.to(device, non_blocking=True)
        rows = torch.tensor([meta.query_start_loc[b] for b in sel], dtype=torch.long).to(device, non_blocking=True)
        return self._tables(bt, ctx, pin, rows, any(meta.page_tables[b][0] < 0 for b in sel))

    def _graph_tables(self, meta: AttentionMetadata) -> "_Selection":
        """`_tables` of every row of a decode step over the whole block table (device ops only:
        capturable); padding rows (length 0) select nothing."""
        bt = meta.block_table.long()  # type: ignore[union-attr]
        return self._tables(bt, meta.seq_lens_t.long(), self.pin_buf[:bt.shape[0]], None,  # type: ignore[union-attr,index]
                            meta.reads_host)

    def _tables(self, bt: torch.Tensor, ctx: torch.Tensor, pin: torch.Tensor | None, rows: torch.Tensor | None,
                has_host: bool) -> "_Selection":
        """bt: [R, width] page tables, ctx: [R] lengths, pin: [R, P] pinned page indices (-1: none)
        -> the selection tables (`_selection_tables`)."""
        if has_host and self.hot is not None:  # once a step, before layer 0 looks up its lists
            self.hot.begin_step()
        ps, window = self.store.page_size, max(self.config.window, 1)
        sink_pages, window_pages, budget_pages = self.config.page_counts(ps)
        device = bt.device
        r, width = bt.shape
        n = (ctx + ps - 1) // ps
        n_sink = n.clamp(max=sink_pages)
        w0 = torch.maximum(n_sink, torch.div(ctx - window, ps, rounding_mode="floor"))
        cols = torch.arange(width, device=device)
        sink_idx = torch.arange(sink_pages, device=device).expand(r, -1)
        sink_idx = torch.where(sink_idx < n_sink[:, None], sink_idx, -1)
        win_idx = w0[:, None] + torch.arange(window_pages, device=device)
        win_idx = torch.where(win_idx < n[:, None], win_idx, -1)
        cand = (cols >= n_sink[:, None]) & (cols < w0[:, None])  # [R, width]
        parts = [sink_idx, win_idx]
        if pin is not None:  # pinned pages between the sink and the window: fixed
            ok = (pin >= n_sink[:, None]) & (pin < w0[:, None])
            pin = torch.where(ok, pin, -1)
            parts.append(pin)
            taken = torch.zeros(r, width + 1, dtype=torch.bool, device=device)
            taken.scatter_(1, (pin + 1).clamp_min(0), True)  # column 0 collects the padding
            cand &= ~taken[:, 1:]
        fixed_idx = torch.cat(parts, dim=1)  # [R, F]
        top_k = (budget_pages - (fixed_idx >= 0).sum(1)).clamp_min(0)  # admission keeps pinned within budget
        k = max(0, min(width, budget_pages - sink_pages - (window_pages - 1)))
        cand_idx = torch.where(cand, cols, -1)
        hkv, n_sel = self.store.kv_heads, fixed_idx.shape[1] + k
        return _Selection(
            rows=rows, ctx=ctx, fixed_idx=fixed_idx, fixed_ids=bt.gather(1, fixed_idx.clamp_min(0)),
            cand_idx=cand_idx, cand_ids=bt, top_k=top_k, k=k, table=bt,
            starts=torch.arange(r * hkv, dtype=torch.long, device=device) * n_sel,
            has_host=has_host, limit=w0, pad=None if self.fused_select else (cand_idx < 0)[:, None, :])

    # -- per layer --------------------------------------------------------------------------------

    def select(self, layer: int, q: torch.Tensor, sel: "_Selection") -> tuple[torch.Tensor, torch.Tensor]:
        """q: [R, Hq, D] raw -> (page indices, page ids), each [R, Hkv, n_sel]: the fixed pages
        first (sink page 0 at column 0), then the top-k candidates per kv head; page index -1
        where an entry reads nothing. With the kernels (`fused_select`): the scores come out
        masked and one launch assembles the lists."""
        r, hkv = q.shape[0], self.store.kv_heads
        qg = q.view(r, hkv, -1, q.shape[-1])  # [R, Hkv, g, D]; page_scores takes it in any float dtype
        score = lambda name: self._scores(name, qg, layer, sel)  # noqa: E731
        if sel.pad is None:  # the fused path (`fused_select`, fixed by `_tables`): chunked top-k
            best = lambda s, k: ra.topk_columns(s, k, sel.limit)  # noqa: E731  (-1: a pick at -inf)
        else:
            best = lambda s, k: s.topk(k, dim=-1).indices  # noqa: E731
        if self.config.selector in HYBRIDS:  # half the picks by the Quest bound, the rest by a centre's score
            k1 = sel.k // 2
            s1, s2 = self._hybrid_scores(qg, layer, sel)
            if sel.pad is None:  # both halves into one list; the first's merge strikes its picks from s2
                top = torch.empty((r, hkv, sel.k), dtype=torch.int64, device=q.device)
                ra.topk_columns(s1, k1, sel.limit, out=top[..., :k1], exclude=s2)
                ra.topk_columns(s2, sel.k - k1, sel.limit, out=top[..., k1:])
            else:
                top1 = best(s1, k1)
                # a -1 in top1 means it took every candidate: clamped, it masks column 0 (never one)
                s2 = s2.scatter(-1, top1.clamp_min(0), float("-inf"))
                top = torch.cat([top1, best(s2, sel.k - k1)], dim=-1)  # [R, Hkv, K]
        else:
            top = best(score(self.config.selector), sel.k)  # [R, Hkv, K]
        if sel.pad is None:
            return ra.assemble_lists(top, sel.cand_idx, sel.cand_ids, sel.fixed_idx, sel.fixed_ids, sel.top_k)
        return ra.assemble_lists_reference(top, sel.cand_idx, sel.cand_ids, sel.fixed_idx, sel.fixed_ids, sel.top_k)

    @property
    def fused_select(self) -> bool:
        """Whether selections take the fused path: score kernels that mask as they write, the list
        kernel (kernels/retrieval_attention.py); the kernel-scored selectors, power-of-two head_dim."""
        d = self.store.head_dim
        return self.kernel and self.config.selector in GRAPH_SELECTORS and d & (d - 1) == 0

    def _hybrid_scores(self, qg: torch.Tensor, layer: int, sel: "_Selection") -> tuple[torch.Tensor, torch.Tensor]:
        """A hybrid selector's two scores: the Quest bound's and its second selector's (HYBRIDS);
        hybrid-mid's on the fused path in one launch (both from one read of kmin / kmax)."""
        second = HYBRIDS[self.config.selector]
        if second == "midrange" and sel.pad is None:
            return layer_quest_scores(qg, self.summaries, self.host_summaries, layer, sel.cand_ids, False, sel.limit,
                                      sel.cand_idx, midrange=True)
        return self._scores("quest", qg, layer, sel), self._scores(second, qg, layer, sel)

    def _scores(self, selector: str, qg: torch.Tensor, layer: int, sel: "_Selection") -> torch.Tensor:
        """page_scores of the step's candidates, non-candidates at -inf (masked by `sel.pad`, or,
        without one, by the fused score kernels as they write)."""
        pad = sel.pad
        s = page_scores(selector, qg, self.summaries, layer, sel.cand_ids, self.host_summaries, self.kernel,
                        sel.limit, cand_idx=sel.cand_idx if pad is None else None)
        return s if pad is None else s.masked_fill(pad, float("-inf"))

    def _retrieve(self, layer: int, q: torch.Tensor, sel: "_Selection") -> torch.Tensor:
        """q: [R, Hq, D] (one decode row per selected sequence) -> [R, Hq, D]."""
        page_idx, ids = self.select(layer, q, sel)
        if self.kernel and not self.record and (not sel.has_host or self.host_in_place):
            self.retrieved_rows += q.shape[0]
            return self._retrieve_kernel(layer, q, sel, page_idx, ids)
        r, hkv, n_sel = page_idx.shape
        ps, d = self.store.page_size, q.shape[-1]
        plain = None if sel.has_host or self.record else self.store.plain_pages(layer)
        if plain is not None and (ops := cpu_ops.usable(q, plain[0])) is not None:
            # a plain CPU pool: the C++ kernel reads each kv head's own pages in place
            self.retrieved_rows += r
            return ops.paged_decode_lists(q, plain[0], plain[1], ids, page_idx, sel.ctx, self.scale,
                                          cpu_ops.MIN_SPLIT)
        qn = self.store.native_q(layer, q) if self.native else q
        if not sel.has_host and not self.record:  # each kv head reads only its own pages (as the kernel)
            o = ra.paged_decode_selected_reference(qn, self.store.layers[layer], self.store.fmt, ids, page_idx, None,
                                                sel.ctx, self.scale, sink=self.store.kernel_sink(layer))
            self.retrieved_rows += r
            return self.store.native_out(o) if self.native else o
        idx, valid = page_idx.clamp_min(0), page_idx >= 0
        kp, vp = self._read(layer, ids.reshape(-1), idx.reshape(-1), sel.starts)  # [R*Hkv*n, Hkv, ps, D]
        # keep kv head h's rows of the pages head h chose: the diagonal over (list head, page head)
        kk = kp.view(r, hkv, n_sel, hkv, ps, d).diagonal(dim1=1, dim2=3).permute(0, 4, 1, 2, 3)
        vv = vp.view(r, hkv, n_sel, hkv, ps, d).diagonal(dim1=1, dim2=3).permute(0, 4, 1, 2, 3)
        pos = idx[..., None] * ps + torch.arange(ps, device=q.device)  # [R, Hkv, n_sel, ps]
        mask = (valid[..., None] & (pos < sel.ctx[:, None, None, None])).reshape(r, hkv, n_sel * ps)
        o = attend_selected(qn, kk.reshape(r, hkv, n_sel * ps, d), vv.reshape(r, hkv, n_sel * ps, d),
                            mask, self.scale)
        self.retrieved_rows += r
        if self.record:
            self.last_selection[layer] = (idx, valid)
            self.mass_log.append(self._selected_mass(layer, qn, sel, idx, valid))
        return self.store.native_out(o) if self.native else o

    def _retrieve_kernel(self, layer: int, q: torch.Tensor, sel: "_Selection", page_idx: torch.Tensor,
                         ids: torch.Tensor) -> torch.Tensor:
        """The same attention by the split-K kernel over each kv head's own list (raw q in)."""
        store, fmt = self.store, self.store.fmt
        r, hkv, n_sel = page_idx.shape
        sink = store.kernel_sink(layer)
        # rows rounded up to a power of two: an eager step and the padded graph replaying it split
        # alike (captured sizes never pass the next power of two, engine/cuda_graph.py)
        splits = ra.selected_num_splits(1 << max(0, r - 1).bit_length(), hkv, n_sel, store.page_size, self.num_sms)
        native = store.kernel_native(layer, q.shape[-1]) if self.native else None
        if self.native and native is None:
            q = store.native_q(layer, q)
        alt = self.host_alts[layer] if sel.has_host else None  # type: ignore[index]
        self.in_place_host_rows += r if alt is not None else 0
        if alt is not None and self.hot is not None:  # chosen host pages cached on the GPU read there
            ids = self.hot.lookup(layer, store.layers[layer], alt, ids, page_idx)
        o = ra.paged_decode_selected(q, store.layers[layer], fmt, ids, page_idx, None, sel.ctx, self.scale, splits,
                                  sink=sink, native=native, alt=alt)
        return store.native_out(o) if self.native and native is None else o

    def _read(self, layer: int, ids: torch.Tensor, idx: torch.Tensor, starts: torch.Tensor,
              cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages `ids` ([N]; negative: host_ref) of one layer -> k, v [N, Hkv, ps, D], compute
        pool pages read in place, host pages fetched (through the cache unless `cache` is False).
        idx: [N] each entry's page index in its sequence (0: a sequence's first page, whose row 0
        comes from the sink slots); starts: those entries' positions (all-compute-pool case)."""
        host = ids < 0
        if self.host_store is None or not bool(host.any()):
            return self.store.read(layer, ids, starts, native=self.native)
        gpu_pos = (~host).nonzero().squeeze(1)
        host_pos = host.nonzero().squeeze(1)
        first = idx == 0
        kh, vh = self._fetch(layer, -1 - ids.index_select(0, host_pos), first.index_select(0, host_pos), cache)
        k = kh.new_empty((ids.numel(), *kh.shape[1:]))
        v = vh.new_empty((ids.numel(), *vh.shape[1:]))
        k[host_pos], v[host_pos] = kh, vh
        if gpu_pos.numel():
            g_ids = ids.index_select(0, gpu_pos)
            g_starts = first.index_select(0, gpu_pos).nonzero().squeeze(1)
            kg, vg = self.store.read(layer, g_ids, g_starts, native=self.native)
            k[gpu_pos], v[gpu_pos] = kg, vg
        return k, v

    def _fetch(self, layer: int, host_ids: torch.Tensor, first: torch.Tensor,
               cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Host pages host_ids ([N], repeats allowed; first: [N] page index 0) of one layer -> k, v
        [N, Hkv, ps, D] on the compute device: each distinct page read once, from the cache when
        it holds it, else from the host pool (its stored codes cross the bus, then decoded)."""
        uniq, inv = host_ids.unique(return_inverse=True)
        is_first = torch.zeros(uniq.numel(), dtype=torch.bool, device=uniq.device)
        is_first[inv[first]] = True
        if not cache or self.host_cache is None:
            k, v = self.store.read_from(self.host_store, layer, uniq, is_first.nonzero().squeeze(1),
                                        native=self.native)
            return k[inv], v[inv]
        hc = self.host_cache
        pages = uniq.tolist()
        slots = hc.lookup(layer, pages)
        miss = [i for i, sl in enumerate(slots) if sl is None]
        if miss:
            mi = torch.tensor(miss, dtype=torch.long, device=uniq.device)
            k, v = self.store.read_from(self.host_store, layer, uniq[mi], is_first[mi].nonzero().squeeze(1),
                                        native=self.native)
            new = hc.insert(layer, [pages[i] for i in miss], k, v, keep=set(pages))
            for i, sl in zip(miss, new):
                slots[i] = sl
            hc.stats["miss_bytes"] += len(miss) * self.host_store.bytes_per_page() // self.store.num_layers  # type: ignore[attr-defined]
        sl = torch.tensor(slots, dtype=torch.long, device=hc.k.device)[inv.to(hc.k.device)]
        return hc.k[layer].index_select(0, sl), hc.v[layer].index_select(0, sl)

    def _selected_mass(self, layer: int, q: torch.Tensor, sel: "_Selection", idx: torch.Tensor,
                       valid: torch.Tensor) -> torch.Tensor:
        """Share of each query head's dense softmax mass on the selected keys: -> [R, Hq] fp32."""
        r, hkv, _ = idx.shape
        ps, d, n_pages = self.store.page_size, q.shape[-1], sel.table.shape[1]
        starts = torch.arange(r, device=q.device) * n_pages
        kp, _ = self._read(layer, sel.table.reshape(-1), torch.arange(n_pages, device=q.device).repeat(r),
                           starts, cache=False)
        kk = kp.view(r, n_pages, hkv, ps, d).permute(0, 2, 1, 3, 4).reshape(r, hkv, n_pages * ps, d)
        s = q.float().view(r, hkv, -1, d) @ kk.float().transpose(-1, -2) * self.scale  # [R, Hkv, g, L]
        live = torch.arange(n_pages * ps, device=q.device)[None, :] < sel.ctx[:, None]  # [R, L]
        p = s.masked_fill(~live[:, None, None, :], float("-inf")).softmax(-1)
        chosen = torch.zeros(r, hkv, n_pages, dtype=torch.int32, device=q.device)
        chosen.scatter_add_(-1, idx, valid.to(torch.int32))  # padding entries (idx 0) add nothing
        chosen = (chosen > 0).repeat_interleave(ps, dim=-1)[:, :, None, :]  # [R, Hkv, 1, L]
        return (p * chosen).sum(-1).reshape(r, -1)


# Host pages the fetch cache keeps per layer, in budgets: a selection's pages plus its recent past.
FETCH_CACHE_BUDGETS = 2


class HostPageCache:
    """Per layer, an LRU of host pages fetched to the compute device (decoded, as attention reads
    them): `lookup` / `insert` by host page id, `drop` when a host page gets new contents.
    stats: asked (distinct host pages a layer's selections named), hits, misses, miss_bytes."""

    def __init__(self, num_layers: int, pages: int):
        self.capacity = max(pages, 1)
        self.k: torch.Tensor | None = None  # [L, capacity, Hkv, ps, D], allocated on first insert
        self.v: torch.Tensor | None = None
        self.slot_of: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(num_layers)]
        self.free: list[list[int]] = [list(range(self.capacity - 1, -1, -1)) for _ in range(num_layers)]
        self.stats = dict.fromkeys(("asked", "hits", "misses", "miss_bytes"), 0)

    def lookup(self, layer: int, pages: list[int]) -> list[int | None]:
        table = self.slot_of[layer]
        out = []
        for p in pages:
            sl = table.get(p)
            if sl is not None:
                table.move_to_end(p)
            out.append(sl)
        hits = sum(sl is not None for sl in out)
        self.stats["asked"] += len(pages)
        self.stats["hits"] += hits
        self.stats["misses"] += len(pages) - hits
        return out

    def insert(self, layer: int, pages: list[int], k: torch.Tensor, v: torch.Tensor,
               keep: set[int]) -> list[int]:
        """Store fetched pages (k, v: [n, Hkv, ps, D]); evicts least recently used pages not in
        `keep` (this step's). -> their slots. A step naming more pages than fit grows the cache."""
        if self.k is None:
            self.k = k.new_empty((len(self.slot_of), self.capacity, *k.shape[1:]))
            self.v = v.new_empty((len(self.slot_of), self.capacity, *v.shape[1:]))
        table, free = self.slot_of[layer], self.free[layer]
        while len(free) < len(pages):
            victim = next((p for p in table if p not in keep), None)
            if victim is None:
                self._grow(len(pages) - len(free))
                continue
            free.append(table.pop(victim))
        slots = [free.pop() for _ in pages]
        for p, sl in zip(pages, slots):
            table[p] = sl
        idx = torch.tensor(slots, dtype=torch.long, device=self.k.device)
        self.k[layer].index_copy_(0, idx, k.to(self.k.device))
        self.v[layer].index_copy_(0, idx, v.to(self.v.device))
        return slots

    def _grow(self, n: int) -> None:
        old = self.capacity
        self.capacity += n
        pad = lambda t: torch.cat([t, t.new_empty((t.shape[0], n, *t.shape[2:]))], dim=1)  # noqa: E731
        self.k, self.v = pad(self.k), pad(self.v)
        for free in self.free:
            free[:0] = list(range(self.capacity - 1, old - 1, -1))

    def drop(self, pages: list[int]) -> None:
        for table, free in zip(self.slot_of, self.free):
            for p in pages:
                sl = table.pop(p, None)
                if sl is not None:
                    free.append(sl)


@dataclass
class _Selection:
    """The selecting rows of one step (R of them) and their page tables (device tensors)."""

    rows: torch.Tensor | None  # [R] packed row of each selecting sequence's decode token (None: all rows)
    ctx: torch.Tensor  # [R] its context length (keys 0..ctx-1)
    fixed_idx: torch.Tensor  # [R, F] sink + window (+ pinned) page indices (-1: none)
    fixed_ids: torch.Tensor  # [R, F] their pool page ids
    cand_idx: torch.Tensor  # [R, C] candidate page indices (-1: not a candidate), C = table width
    cand_ids: torch.Tensor  # [R, C] their pool page ids
    top_k: torch.Tensor  # [R] candidates each row may take (budget pages - fixed pages)
    k: int  # >= max(top_k), from the config and table width only
    table: torch.Tensor  # [R, C] the page tables (block-table rows; mass recording)
    starts: torch.Tensor  # [R * Hkv] position of page 0 in the flattened selection (sink rows)
    has_host: bool = False  # some selecting sequence has host-tier pages
    limit: torch.Tensor | None = None  # [R] columns at or past this are not candidates (the window's start)
    # [R, 1, C] not a candidate, made once a step (None: the fused path masks in its score kernel)
    pad: torch.Tensor | None = None


@dataclass
class _RetrievalPlan:
    sel: _Selection | None = None  # None: no row selects; the whole step is the dense backend's
    graph: bool = False  # a decode step in the graph formulation: every row selects (sel built at layer 0)
    sink: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows at position 0, sink slots)
    rest_rows: torch.Tensor | None = None  # [T'] packed rows of the other sequences
    rest_meta: AttentionMetadata | None = field(default=None, repr=False)  # those rows, for dense


def summary_rows(summaries: PageSummaries, host: PageSummaries | None, name: str, layer: int,
                 ids: torch.Tensor) -> torch.Tensor:
    """Field `name` (kmin, kmax, ksum, count) of pages `ids` of one layer, a page of either tier
    (negative ids: host_ref(h) = -1 - h, looked up in `host`) -> [*ids.shape, *field dims]."""
    def one(s: PageSummaries, i: torch.Tensor) -> torch.Tensor:
        if s.codes and name in ("kmin", "kmax"):  # 8-bit codes: their values, codes x 2^e
            return s.values(name, layer, i)
        return getattr(s, name)[layer][i]

    if host is None:
        return one(summaries, ids)
    g = one(summaries, ids.clamp_min(0))
    h = one(host, (-1 - ids).clamp_min(0))
    return torch.where((ids < 0).view(*ids.shape, *([1] * (g.dim() - ids.dim()))), h, g)


def layer_quest_scores(qg: torch.Tensor, summaries: PageSummaries, host: PageSummaries | None, layer: int,
                       cand_ids: torch.Tensor, reduce_max: bool, limit: torch.Tensor | None,
                       cand_idx: torch.Tensor | None, midrange: bool = False):
    """kernels/retrieval_attention.py quest_scores over one layer's summaries of both tiers (its
    arguments and result)."""
    def rows(t: PageSummaries) -> tuple[torch.Tensor, ...]:
        got = (t.kmin[layer], t.kmax[layer], t.count[layer])
        return got + (t.kexp[layer],) if t.kexp is not None else got  # 8-bit codes: their exponents
    return ra.quest_scores(qg, rows(summaries), cand_ids, reduce_max, rows(host) if host is not None else None, limit,
                        cand_idx, midrange=midrange)


def page_scores(selector: str, qg: torch.Tensor, summaries: PageSummaries, layer: int,
                cand_ids: torch.Tensor, host: PageSummaries | None = None, kernel: bool = False,
                limit: torch.Tensor | None = None, cand_idx: torch.Tensor | None = None) -> torch.Tensor:
    """qg: [R, Hkv, g, D] raw queries (fp32; the kernels take any float dtype); cand_ids: [R, C]
    pages (negative: host tier, whose summaries are `host`) -> scores [R, Hkv, C].

    Pages with no summary (never written in this pool) score +inf: chosen first, never missed.
    kernel: the Quest and centroid selectors through kernels/retrieval_attention.py quest_scores /
    centroid_scores (one launch, no gathered copies of the summaries; power-of-two head_dim), which
    skip each row's columns at or past `limit` ([R]; their scores are left unset: the caller masks
    them), or with `cand_idx` ([R, C], -1: not a candidate) write -inf there and at those columns.
    """
    r, hkv, d = qg.shape[0], qg.shape[1], qg.shape[-1]
    if kernel and selector in ("quest", "quest-max", "midrange") and d & (d - 1) == 0:
        got = layer_quest_scores(qg, summaries, host, layer, cand_ids, selector == "quest-max", limit, cand_idx,
                                 midrange=selector == "midrange")
        return got[1] if selector == "midrange" else got  # midrange: hybrid-mid's launch, the bound discarded
    if kernel and selector == "centroid" and d & (d - 1) == 0:
        rows = lambda t: (t.ksum[layer], t.count[layer])  # noqa: E731
        return ra.centroid_scores(qg, rows(summaries), cand_ids, rows(host) if host is not None else None, limit,
                               cand_idx)
    qg = qg.float()
    if (selector in ("quest", "quest-max") and host is None and not summaries.codes
            and (ops := cpu_ops.usable(qg, summaries.kmin)) is not None):
        # CPU: one C++ pass over the candidates' summary rows (no gathered copies)
        return ops.quest_scores(qg, summaries.kmin[layer], summaries.kmax[layer], summaries.count[layer], cand_ids,
                                selector == "quest-max")
    rows = lambda name: summary_rows(summaries, host, name, layer, cand_ids)  # noqa: E731
    count = rows("count")  # [R, C]
    if selector in ("meankey", "centroid"):
        mean = rows("ksum").float() / count.clamp_min(1).float()[..., None, None]  # [R, C, Hkv, D]
        if selector == "meankey":
            s = torch.einsum("rhd,rchd->rc", qg.mean(2), mean)  # one list for all kv heads
            s = s[:, None, :].expand(r, hkv, -1)
        else:  # per kv head: the group's summed q . the page's mean key
            s = torch.einsum("rhgd,rchd->rhc", qg, mean)
    elif selector == "midrange":  # per kv head: the group's summed q . the page's (kmin + kmax) / 2
        mid = (rows("kmin").float() + rows("kmax").float()) * 0.5
        s = torch.einsum("rhgd,rchd->rhc", qg, mid)
    elif selector not in ("quest", "quest-max"):
        raise ValueError(f"page_scores: unknown selector {selector!r}")
    else:
        kmin, kmax = rows("kmin").float(), rows("kmax").float()  # [R, C, Hkv, D]
        # max(q_d min_d, q_d max_d) = max(q_d, 0) max_d + min(q_d, 0) min_d
        bound = (torch.einsum("rhgd,rchd->rhgc", qg.clamp_min(0), kmax)
                 + torch.einsum("rhgd,rchd->rhgc", qg.clamp_max(0), kmin))  # [R, Hkv, g, C]
        s = bound.sum(2) if selector == "quest" else bound.amax(2)
    empty = count == 0  # [R, C]
    return s.masked_fill(empty[:, None, :], float("inf"))


def attend_selected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """One query row per sequence over per-kv-head key sets, fp32 softmax.

    q: [R, Hq, D]; k, v: [R, Hkv, L, D]; mask: bool [R, Hkv, L] (True = attend) -> [R, Hq, D]
    """
    r, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(r, hkv, hq // hkv, d)  # query head h reads kv head h // (Hq / Hkv)
    s = (qg @ k.float().transpose(-1, -2)).mul_(scale)  # [R, Hkv, g, L]
    s.masked_fill_(~mask[:, :, None, :], float("-inf"))
    o = s.softmax(-1) @ v.float()  # [R, Hkv, g, D]
    return o.reshape(r, hq, d).to(q.dtype)
