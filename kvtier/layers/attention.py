"""Attention backends: the only place model code meets the KV cache.

The model calls `backend.forward(layer, q, k, v, meta)` once per layer. The
backend writes the new K/V rows into the paged pool and attends over every
cached token of each sequence. Dense, retrieval-sparse and quantized paths
are different backends; model code never branches on them.

A step's tokens are packed ("varlen"): T new tokens from B sequences.

    packed rows:   | seq0 new tokens | seq1 new tokens | ... |
    query_start_loc  0               q1                q2 ... T
    seq b attends to its first seq_lens[b] tokens; its new tokens are the last
    (q[b+1]-q[b]) of those, so row i of seq b sits at absolute position
    seq_lens[b] - n_new_b + i and sees keys 0..that position (causal).

A sequence longer than the compute pool has its oldest pages in the host
tier: its page table starts with negative entries, host_ref(h) = -1 - h
(kvtier/kv/manager.py). The dense backend streams those pages through the
device in chunks of `stream_pages` and merges the partial softmaxes by their
log-sum-exp, so the result equals attention over one big pool:

    page table:  | -1-h0  -1-h1 ... (host, streamed) | g0 g1 ... (compute pool) |
    keys:        0                                   base = n_host * page_size   ctx
    new rows all sit in the compute-pool part (only computed pages are offloaded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvtier.kernels import cpu_ops
from kvtier.kernels.fused import QKRope


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]  # [B+1] cumulative new-token counts (python ints)
    seq_lens: list[int]  # [B] context length of each seq after this step
    page_tables: list[list[int]]  # [B][n_pages_b] compute-pool page ids, in order
    slot_mapping: torch.Tensor  # [T] int64: page_id * page_size + offset for each new token
    logits_indices: torch.Tensor  # [N] int64 packed rows whose logits are wanted
    # What a backend derives from the tables once per step and reuses in every layer
    # (device page-index tensors, masks): built by `backend.plan(meta)` before the forward
    # (or lazily by the first layer), keyed by the backend.
    step_cache: dict = field(default_factory=dict, repr=False, compare=False)
    # Device copies made by the runner's step planner (engine/step_plan.py) from pinned
    # staging, in persistent buffers (CUDA graphs replay over them); None when built by hand.
    block_table: torch.Tensor | None = None  # [B, max_pages] int32 page ids (padding: 0)
    seq_lens_t: torch.Tensor | None = None  # [B] int32 = seq_lens (0 for padding rows)
    query_start_loc_t: torch.Tensor | None = None  # [B + 1] int32 = query_start_loc
    # Largest position + 1 the step may touch: seq_lens' max, or the captured capacity (graphs).
    max_seq_len: int = 0
    # Set by the step planner (engine/step_plan.py decode_step): every sequence decodes one
    # sampled token, not its first: a step a decode graph can run.
    decode_step: bool = False
    # Some sequence's table starts with host-tier pages (negative ids head a table): derived from
    # page_tables unless given (a graph capture names the variant it captures over placeholders).
    reads_host: bool | None = None
    # Set by the step planner from Sequence.pinned_spans: per sequence, like page_tables (no
    # graph padding rows), the sorted page indices (position // page_size, spans rounded out to
    # whole pages, clipped to this step's pages) that retrieval attention must always attend;
    # [] for a sequence without spans; None when no sequence in the step has any.
    pinned_pages: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.reads_host is None:
            self.reads_host = any(pt and pt[0] < 0 for pt in self.page_tables)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def context_bound(self) -> int:
        """An upper bound on every position + 1 in this step (no device sync needed)."""
        return self.max_seq_len or max(self.seq_lens, default=1)

class KVStore(Protocol):
    """What a backend needs from the page pool (kv/pool.py implements it)."""

    page_size: int

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              sink: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store new rows. slots: [T] int64, k/v: [T, Hkv, D]; sink: (rows at position 0,
        their sink slots from assign_sinks)."""

    def read(self, layer: int, page_ids: torch.Tensor, starts: torch.Tensor | None = None,
             native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Load pages. page_ids: [P] -> k, v: [P, Hkv, page_size, D] in compute dtype.
        starts: indices into page_ids of pages that begin a sequence (row 0 = position 0).
        native: as stored by a rotating format (`rotated`): attend with native_q, native_out."""

    def assign_sinks(self, pages: list[int]) -> torch.Tensor | None:
        """Slots keeping exact copies of the position-0 rows about to be written into `pages`."""


class AttentionBackend(Protocol):
    """What model code calls once per layer; the runner calls `plan` once per step first.

    A backend that supports CUDA graphs (`graphable`) must make `forward` of a step that
    `graph_ready(meta)` accepts read only the meta's device tensors (block_table,
    seq_lens_t, slot_mapping), never its Python lists, and must not synchronise.
    """

    name: str

    def plan(self, meta: AttentionMetadata, for_graph: bool = False) -> None:
        """Per-step work done once, outside the layers: device tables, sink slots, kernel
        choice (stored in meta.step_cache). for_graph: plan for capture (shape-only choices)."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> out [T, Hq, D]."""

    def rope_store(self, layer: int, qkv: torch.Tensor, rope: QKRope,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Optional fusion, called before `forward`: the layer's projected rows qkv [T, (Hq + 2 Hkv)
        * D] -> (q, k, v) after rope's norm and rotary, K / V stored for this step in the same pass
        (then `forward` of this layer stores nothing); None where the backend does not fuse (the
        model applies rope itself and `forward` stores)."""

    def graph_ready(self, meta: AttentionMetadata) -> bool:
        """Whether this step can replay a captured decode graph."""

    def attach_host_tier(self, host_store: object | None) -> None:
        """Set the host pool that offloaded pages are streamed from."""

    def pages_arrived(self, page_ids: list[int], from_host: list[int] | None = None) -> None:
        """Compute-pool pages `page_ids` now hold K/V copied in from another tier (the runner
        calls this after a host -> GPU swap, with the host pages they came from): state the
        backend keeps per page must follow."""

    def pages_departed(self, page_ids: list[int], to_host: list[int]) -> None:
        """Compute-pool pages `page_ids` were copied down to host pages `to_host` (the runner
        calls this after a GPU -> host copy, before any host -> GPU one of the step)."""


class StreamingKVStore(KVStore, Protocol):
    """A compute pool that can decode pages of its lower (host) tier (kv/pool.py PagePool)."""

    def read_from(self, src: object, layer: int, page_ids: torch.Tensor, starts: torch.Tensor | None = None,
                  native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Move pages `page_ids` of tier `src` to this device, decode -> k, v: [P, Hkv, ps, D]."""


# Host pages moved to the device per streamed chunk: bounds the staging memory
# (chunk x page bytes) while keeping each copy large enough to be batched.
DEFAULT_STREAM_PAGES = 64


def plan_sink_rows(store: KVStore, meta: AttentionMetadata,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows this step writes at sequence position 0 (a sequence's first chunk), which the pool
    keeps exactly as sink rows: (packed row indices [n] int64, their sink slots [n]) on
    `device`, or None (no such row, or a format without sink rows). Assigns the slots."""
    qsl = meta.query_start_loc
    starts = [b for b in range(meta.num_seqs) if meta.seq_lens[b] == qsl[b + 1] - qsl[b] > 0]
    if not starts:
        return None
    slots = store.assign_sinks([meta.page_tables[b][0] for b in starts])
    if slots is None:
        return None
    return torch.tensor([qsl[b] for b in starts], dtype=torch.long).to(device, non_blocking=True), slots


class DensePagedAttention:
    """Reference backend ("dense"): gathers each sequence's pages and runs torch SDPA.

    Exact (no selection); the correctness reference for every other backend.
    Pages in the host tier (negative page-table entries) are streamed from
    `host_store` in chunks (see the module docstring).
    """

    def __init__(self, store: KVStore | StreamingKVStore, scale: float, host_store: object | None = None,
                 stream_pages: int = DEFAULT_STREAM_PAGES, fold_rotation: bool = True):
        if stream_pages < 1:
            raise ValueError(f"stream_pages must be >= 1, got {stream_pages}")
        self.store = store
        # Rotating KV formats: attend in the stored domain (q and the output are transformed,
        # once per query row) instead of rotating every cached row back (kv/pool.py read).
        self.native = fold_rotation and bool(getattr(store, "rotated", False))
        self.scale = scale
        self.host_store = host_store
        self.stream_pages = stream_pages

    name = "dense"

    def plan(self, meta: AttentionMetadata, for_graph: bool = False) -> None:
        """Page tables -> device tensors and sink slots, once per step (see `_plan`)."""
        if id(self) not in meta.step_cache:
            meta.step_cache[id(self)] = self._plan(meta, meta.slot_mapping.device, meta.slot_mapping.shape[0])

    def graph_ready(self, meta: AttentionMetadata) -> bool:
        return False  # Python-list page tables: eager only

    def attach_host_tier(self, host_store: object | None) -> None:
        """Set the host pool that offloaded pages are streamed from."""
        self.host_store = host_store

    def pages_arrived(self, page_ids: list[int], from_host: list[int] | None = None) -> None:
        """Nothing per page to follow (the pool carries codes and sink rows itself)."""

    def pages_departed(self, page_ids: list[int], to_host: list[int]) -> None:
        """Nothing per page to follow."""

    def rope_store(self, layer: int, qkv: torch.Tensor, rope: QKRope, meta: AttentionMetadata) -> None:
        return None  # the reference: the model applies the rotary, `forward` stores

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        plan = self._step_plan(meta, q)
        self.store.write(layer, meta.slot_mapping, k, v, sink=plan.sink)
        return self.attend(layer, q, meta)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`forward` without the write: q [T, Hq, D], the rows of `meta`, over pages already
        written -> [T, Hq, D] (layers/retrieval.py sends it the rows it does not select for)."""
        plan = self._step_plan(meta, q)
        if self.native:
            q = self.store.native_q(layer, q)  # type: ignore[attr-defined]
            return self.store.native_out(self._attend(layer, q, meta, plan))  # type: ignore[attr-defined]
        return self._attend(layer, q, meta, plan)

    def _step_plan(self, meta: AttentionMetadata, q: torch.Tensor) -> "_StepPlan":
        plan = meta.step_cache.get(id(self))
        if plan is None:  # not planned by the runner: the first layer plans, once per step
            plan = meta.step_cache[id(self)] = self._plan(meta, q.device, q.shape[0])
        return plan

    def _attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, plan: "_StepPlan") -> torch.Tensor:
        if plan.cpu_decode is not None:  # a plain CPU pool, every row a decode (see _plan)
            pages = self.store.plain_pages(layer)
            return cpu_ops.ops().paged_decode(q, pages[0], pages[1], *plan.cpu_decode, self.scale,
                                              cpu_ops.MIN_SPLIT)
        if plan.batch_table is not None:
            return self._decode_batch(layer, q, plan)  # every sequence brings one new token
        out = torch.empty_like(q)
        qsl = meta.query_start_loc
        for b in range(meta.num_seqs):
            lo, hi = qsl[b], qsl[b + 1]
            n_new, ctx = hi - lo, meta.seq_lens[b]
            if plan.streamed[b]:
                out[lo:hi] = self._attend_streamed(layer, q[lo:hi], plan.tables[b], plan.streamed[b], ctx)
                continue
            kp, vp = self.store.read(layer, plan.pages[b], plan.first, native=self.native)  # [P, Hkv, ps, D]
            out[lo:hi] = attend_one(q[lo:hi], kp, vp, ctx, n_new, self.scale)
        return out

    def _plan(self, meta: AttentionMetadata, device: torch.device, n_rows: int) -> "_StepPlan":
        ps = self.store.page_size
        tables = [pt[:(n + ps - 1) // ps] for pt, n in zip(meta.page_tables, meta.seq_lens)]
        streamed = [host_head(pt) for pt in tables]
        plan = _StepPlan(tables, streamed)
        plan.sink = plan_sink_rows(self.store, meta, device)
        plan.first = _zero_index(device)
        pages = getattr(self.store, "plain_pages", lambda _: None)(0)
        if n_rows == meta.num_seqs and not any(streamed) and pages is not None \
                and cpu_ops.usable(meta.slot_mapping, pages[0]):
            plan.cpu_decode = _decode_tables(meta, tables)  # every row decodes: the C++ kernel reads the pool
            return plan
        if n_rows == meta.num_seqs and meta.num_seqs > 1 and not any(streamed):
            table = _padded_table(tables)
            max_p = table.shape[1]
            plan.batch_table = table.flatten().to(device, non_blocking=True)
            plan.max_pages = max_p
            lens = torch.tensor(meta.seq_lens, device=device)
            plan.batch_mask = (torch.arange(max_p * ps, device=device)[None, :] < lens[:, None])[:, None, None, :]
            plan.batch_first = torch.arange(meta.num_seqs, device=device) * max_p
        else:
            plan.pages = [None if n else torch.tensor(pt, dtype=torch.long).to(device, non_blocking=True)
                          for pt, n in zip(tables, streamed)]
        return plan

    def _attend_streamed(self, layer: int, q: torch.Tensor, table: list[int], n_host: int,
                         ctx: int) -> torch.Tensor:
        """One sequence whose first n_host pages are in the host tier.

        q: [n_new, Hq, D] -> [n_new, Hq, D]. Host chunks are fully visible to
        every new row; the compute-pool part gets the causal mask.
        """
        if self.host_store is None:
            raise RuntimeError("a sequence has pages in the host tier but this attention backend "
                               "has no host tier attached (attach_host_tier)")
        if any(p >= 0 for p in table[:n_host]) or any(p < 0 for p in table[n_host:]):
            raise ValueError("host pages must form the head of a page table")
        ps, n_new = self.store.page_size, q.shape[0]
        base = n_host * ps
        if base > ctx - n_new:
            raise ValueError("new tokens of a step must sit in compute-pool pages")
        host_ids = torch.tensor([-1 - p for p in table[:n_host]], dtype=torch.long)
        acc: tuple[torch.Tensor, torch.Tensor] | None = None
        for i in range(0, n_host, self.stream_pages):
            chunk = host_ids[i:i + self.stream_pages]
            first = torch.zeros(1, dtype=torch.long) if i == 0 else None  # the sequence's first page
            kp, vp = self.store.read_from(self.host_store, layer, chunk, first,  # type: ignore[attr-defined]
                                          native=self.native)
            acc = merge_partials(acc, attend_partial(q, kp, vp, chunk.numel() * ps, n_new, self.scale))
        pages = torch.tensor(table[n_host:], dtype=torch.long, device=q.device)
        kp, vp = self.store.read(layer, pages, native=self.native)
        acc = merge_partials(acc, attend_partial(q, kp, vp, ctx - base, n_new, self.scale, causal=True))
        return acc[0].to(q.dtype)


    def _decode_batch(self, layer: int, q: torch.Tensor, plan: "_StepPlan") -> torch.Tensor:
        """All rows are decodes: one padded SDPA call over every sequence's pages.

        q: [B, Hq, D] -> [B, Hq, D]; keys beyond seq_lens[b] are masked out (plan.batch_mask).
        """
        ps, max_p = self.store.page_size, plan.max_pages
        kp, vp = self.store.read(layer, plan.batch_table, plan.batch_first, native=self.native)  # [B*max_p, ...]
        bsz, hkv, d = q.shape[0], kp.shape[1], kp.shape[3]
        kk = kp.view(bsz, max_p, hkv, ps, d).permute(0, 2, 1, 3, 4).reshape(bsz, hkv, max_p * ps, d)
        vv = vp.view(bsz, max_p, hkv, ps, d).permute(0, 2, 1, 3, 4).reshape(bsz, hkv, max_p * ps, d)
        qq = q.unsqueeze(2).to(kk.dtype)  # [B, Hq, 1, D]
        if q.is_cuda:
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=plan.batch_mask,
                                               scale=self.scale, enable_gqa=q.shape[1] != hkv)
        else:
            o = decode_attend_cpu(qq, kk, vv, self.scale, plan.batch_mask)
        return o.squeeze(2).to(q.dtype)


def _decode_tables(meta: AttentionMetadata, tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table [B, max_pages], context lengths [B]) of a step: the step planner's tensors
    when it made them (engine/step_plan.py), else built from the Python lists."""
    n = meta.num_seqs
    if meta.block_table is not None and meta.seq_lens_t is not None:
        return meta.block_table[:n].long(), meta.seq_lens_t[:n].long()  # int64 once a step, not a layer
    return _padded_table(tables), torch.tensor(meta.seq_lens, dtype=torch.long)


def _padded_table(tables: list[list[int]]) -> torch.Tensor:
    """Page tables -> int64 [B, longest] on the CPU, short rows padded with page 0."""
    table = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.long)
    for b, pt in enumerate(tables):
        table[b, :len(pt)] = torch.tensor(pt, dtype=torch.long)
    return table


_ZERO_INDEX: dict[torch.device, torch.Tensor] = {}


def _zero_index(device: torch.device) -> torch.Tensor:
    """[1] int64 = 0 on `device`, made once per device (not once per step)."""
    t = _ZERO_INDEX.get(device)
    if t is None:
        t = _ZERO_INDEX[device] = torch.zeros(1, dtype=torch.long, device=device)
    return t


@dataclass
class _StepPlan:
    """DensePagedAttention's per-step view of the page tables (AttentionMetadata.step_cache)."""

    tables: list[list[int]]  # [B] the pages each sequence reads this step
    streamed: list[int]  # [B] how many of them (the head) are in the host tier
    pages: list[torch.Tensor | None] = field(default_factory=list)  # [B] device page ids (None: streamed)
    batch_table: torch.Tensor | None = None  # all-decode steps: [B * max_pages] padded page ids
    batch_mask: torch.Tensor | None = None  # [B, 1, 1, max_pages * page_size] key validity
    max_pages: int = 0
    batch_first: torch.Tensor | None = None  # [B] index of each sequence's first page in batch_table
    first: torch.Tensor | None = None  # [1] = 0: a sequence's own page list starts with its first page
    sink: tuple[torch.Tensor, torch.Tensor] | None = None  # (packed rows at position 0, sink slots)
    # CPU, every row a decode, nothing streamed: (block table, lengths) for kernels/cpu_ops.py's
    # paged_decode, which reads plain pools in place (others take the paths above)
    cpu_decode: tuple[torch.Tensor, torch.Tensor] | None = None


def attend_one(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, ctx: int, n_new: int,
               scale: float) -> torch.Tensor:
    """Causal attention of one sequence's new rows over its paged context.

    q: [n_new, Hq, D]; kp/vp: [P, Hkv, ps, D] (P*ps >= ctx) -> [n_new, Hq, D]
    """
    hq, hkv, d = q.shape[1], kp.shape[1], kp.shape[3]
    kk = kp.permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx]  # [Hkv, ctx, D]
    vv = vp.permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx]
    qq = q.transpose(0, 1).to(kk.dtype)  # [Hq, n_new, D]
    gqa = hq != hkv  # grouped-query attention: each kv head serves hq/hkv query heads
    if n_new == 1 and not q.is_cuda:
        o = decode_attend_cpu(qq, kk, vv, scale)
    elif n_new == 1:
        o = F.scaled_dot_product_attention(qq, kk, vv, scale=scale, enable_gqa=gqa)
    elif q.is_cuda:
        # flash / memory-efficient kernels: bottom-right-aligned causal mask, no [n, ctx] tensor
        if gqa:
            kk = kk.repeat_interleave(hq // hkv, dim=0)
            vv = vv.repeat_interleave(hq // hkv, dim=0)
        mask = causal_lower_right(n_new, ctx)
        o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], attn_mask=mask, scale=scale)[0]
    else:
        # row i sits at position ctx - n_new + i and sees keys <= that position
        rows = torch.arange(ctx - n_new, ctx, device=q.device)[:, None]
        cols = torch.arange(ctx, device=q.device)[None, :]
        mask = cols <= rows  # [n_new, ctx]
        # 4-D: torch's CPU flash kernel takes [B, H, L, D] only; 3-D inputs fall back to the
        # math path, which materializes [Hq, n_new, ctx] scores (15x slower at 8K keys)
        o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)[0]
    return o.transpose(0, 1).to(q.dtype)


def decode_attend_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """One query row per head over a context, as two batched matmuls (CPU decode).

    torch's CPU SDPA has a high fixed cost for a single query row (measured 0.15 ms
    at 256 keys and 4 ms at 2K keys in bf16, against 0.02 / 0.15 ms here). Query
    heads are grouped by the kv head they share (GQA), softmax runs in fp32.
    q: [..., Hq, 1, D]; k, v: [..., Hkv, L, D]; mask: bool [..., 1, 1, L] (True = attend)
    -> [..., Hq, 1, D]
    """
    *batch, hq, _, d = q.shape
    hkv = k.shape[-3]
    # fp32 throughout: CPU bf16 batched matmuls of these skinny shapes measured ~3x slower
    # than casting and running fp32 (the casts are of the context, small next to the weights)
    qg = q.reshape(*batch, hkv, hq // hkv, d).float()  # head h reads kv head h // (hq / hkv)
    s = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale)  # [..., Hkv, g, L]
    if mask is not None:
        s.masked_fill_(~mask.reshape(*batch, 1, 1, -1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype).reshape(*batch, hq, 1, d)


def attend_partial(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, ctx: int, n_new: int,
                   scale: float, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over one block of keys, with its log-sum-exp (fp32).

    q: [n_new, Hq, D]; kp/vp: [P, Hkv, ps, D] holding the block's keys 0..ctx-1
    (P * ps >= ctx; the rest is padding). With `causal`, the block ends at the new rows: row i
    (position ctx - n_new + i inside the block) sees keys <= that position;
    without, every row sees every key. -> (out [n_new, Hq, D], lse [n_new, Hq])
    """
    hq, hkv, d = q.shape[1], kp.shape[1], kp.shape[3]
    kk = kp.permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx].float()  # [Hkv, ctx, D]
    vv = vp.permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx].float()
    if hq != hkv:  # grouped-query attention: query head h reads kv head h // (hq / hkv)
        kk = kk.repeat_interleave(hq // hkv, dim=0)
        vv = vv.repeat_interleave(hq // hkv, dim=0)
    qq = q.transpose(0, 1).float()  # [Hq, n_new, D]
    hidden = None  # [n_new, ctx] True where a row may not see a key
    if causal:  # row i (position ctx - n_new + i in the block) sees keys <= that position
        hidden = torch.arange(ctx, device=q.device)[None, :] > torch.arange(ctx - n_new, ctx, device=q.device)[:, None]
    if not q.is_cuda:
        # torch's CPU flash kernel returns the log-sum-exp too: no [Hq, n_new, ctx] score tensor
        # (a 512-row chunk over 6K keys and 9 heads: 110 MB of fp32 per layer otherwise); its
        # mask is additive, in q's dtype
        mask = None if hidden is None else torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qq[None], kk[None], vv[None], 0.0, False, attn_mask=mask, scale=scale)
        return o[0].transpose(0, 1), lse[0].transpose(0, 1)
    s = (qq @ kk.transpose(1, 2)) * scale  # [Hq, n_new, ctx]
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, n_new]
    o = torch.softmax(s, dim=-1) @ vv  # [Hq, n_new, D]
    return o.transpose(0, 1), lse.transpose(0, 1)


def host_head(page_table: list[int]) -> int:
    """How many host-tier pages (negative ids) head a page table: they come first, so counting
    stops at the first compute-pool page."""
    return next((i for i, p in enumerate(page_table) if p >= 0), len(page_table))


def merge_partials(acc: tuple[torch.Tensor, torch.Tensor] | None,
                   part: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax partials over disjoint key blocks: weights exp(lse_i - lse)."""
    if acc is None:
        return part
    (o1, l1), (o2, l2) = acc, part
    lse = torch.logaddexp(l1, l2)  # [n, Hq]
    w1, w2 = torch.exp(l1 - lse)[..., None], torch.exp(l2 - lse)[..., None]
    return o1 * w1 + o2 * w2, lse
