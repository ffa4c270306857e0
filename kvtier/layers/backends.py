"""Attention backends by name, and `--attention-backend auto`.

    dense   layers/attention.py DensePagedAttention: gathers pages, torch SDPA. The
            reference every other backend is tested against; runs everywhere.
    triton  TritonPagedAttention below: decode steps read the pages in place with the
            split-K kernel of kernels/paged_attention.py (every KV format, codes never
            expanded to a dense copy) and can be captured in CUDA graphs; prefill chunks run
            its varlen kernel; the layer's rotary and K / V store are one launch (`rope_store`);
            steps the kernels do not take go through the dense reference.
    retrieval  layers/retrieval.py RetrievalAttention: past a token budget (RetrievalConfig,
            `--kvmem-budget`), decode rows attend to sink + window + top-k pages per kv head;
            everything else is the dense reference. Never picked by `auto`.

`auto` picks triton where a CUDA device and Triton are present, else dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.kernels.fused import QKRope
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention, host_head, plan_sink_rows
from kvtier.layers.retrieval import RetrievalAttention, RetrievalConfig

BACKEND_NAMES = ("auto", "dense", "triton", "retrieval")


def triton_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    from kvtier.kernels import paged_attention
    return paged_attention.HAVE_TRITON


def choose_backend(name: str, device: torch.device) -> str:
    """Resolve "auto" (or check an explicit choice) for `device`; ValueError if unusable."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(BACKEND_NAMES)})")
    if name == "auto":
        return "triton" if triton_available(device) else "dense"
    if name == "triton" and not triton_available(device):
        raise ValueError("the triton attention backend needs a CUDA device and the triton package")
    return name


def make_backend(name: str, store, scale: float, host_store: object | None = None, max_context: int = 0,
                 retrieval: RetrievalConfig | None = None, hot_pages: tuple[int, int] | None = None):
    """The backend `name` ("auto" resolved for the store's device) over the page pool `store`.
    max_context: the longest context it serves (0: unknown, planned per step); retrieval: the
    selection config, required by (and only by) "retrieval"; hot_pages: (first, count) of the
    pool pages no sequence owns that retrieval may cache selected host pages in."""
    resolved = choose_backend(name, torch.device(store.device))
    if resolved == "retrieval":
        if retrieval is None or not retrieval.enabled:
            raise ValueError("the retrieval attention backend needs a kvmem budget > 0 (--kvmem-budget)")
        return RetrievalAttention(store, scale, retrieval, host_store, hot_pages=hot_pages)
    if resolved == "triton":
        return TritonPagedAttention(store, scale, host_store, max_context)
    return DensePagedAttention(store, scale, host_store)


@dataclass
class _KernelPlan:
    num_splits: int = 1  # decode: split-K partitions of each sequence's pages (shape-only for graphs)
    prefill: bool = False  # the varlen causal kernel (any rows per sequence) instead of decode
    max_new: int = 0  # prefill: the most new rows of one sequence (sizes the grid, no sync)
    sink: tuple[torch.Tensor, torch.Tensor] | None = None  # prefill: (rows at position 0, sink slots)
    host: bool = False  # tables start with host-tier pages (negative ids): the kernels read them as AltPages
    staged: "_Staged | None" = None  # prefill over host pages: what each layer copies up first


@dataclass
class _Staged:
    """A prefill step's host-tier pages, copied up per layer before the kernel runs (each key
    tile is read by every query tile of the chunk: read over the bus, that would be ~64x the
    bytes). Entry j of the step's list goes to staging page j; the block table names it -1 - j."""

    host_ids: torch.Tensor  # [n] host page ids, on the device
    to: torch.Tensor  # [n] staging pages 0..n-1, on the device
    table: torch.Tensor  # the step's block table with host entries renamed to staging pages
    slots: torch.Tensor | None  # [n] the staged pages' sink slots in the host pool (quantized formats)


# The plan of a step the paged kernels do not take (host-tier pages, hand-built metadata):
# forward hands it to the dense reference, which planned it too.
DENSE = _KernelPlan()


class TritonPagedAttention:
    """Steps run the paged kernels: the split-K decode kernel when every sequence brings one
    token (not its first), else the varlen causal prefill kernel. Host-tier pages (a pinned host
    pool laid out as the compute pool) are read in place by decode and from a per-layer staging
    copy by prefill; without such a pool, steps reading them go through the dense reference (it
    streams them). Decode steps read only the meta's device tensors, so they are CUDA-graph
    capturable, with or without host pages.
    """

    name = "triton"

    def __init__(self, store, scale: float, host_store: object | None = None, max_context: int = 0):
        """max_context: the engine's longest context. Split-K partitions are chosen from it (not
        from each step's lengths), so an eager step and a graph replay of the same step reduce
        in the same order and give the same bits."""
        self.stage: dict[str, torch.Tensor] = {}  # prefill staging of host pages: name -> [1, cap, ...]
        self.host_steps = 0  # steps whose kernels read host-tier pages (decode in place, prefill staged)
        self.store = store
        self.max_context = max_context
        self.scale = scale
        self.dense = DensePagedAttention(store, scale, host_store)
        self.native = self.dense.native  # attend in the stored (rotated) domain
        self.attach_host_tier(host_store)
        props = torch.cuda.get_device_properties(torch.device(store.device))
        self.num_sms = props.multi_processor_count
        # The dense prefill path calls SDPA with a new (new rows, context) shape nearly every
        # chunk; cuDNN's SDPA builds an execution plan per shape (measured ~0.1-0.5 s each on
        # the H200), flash / memory-efficient attention need none.
        torch.backends.cuda.enable_cudnn_sdp(False)

    def attach_host_tier(self, host_store: object | None) -> None:
        self.dense.attach_host_tier(host_store)
        # the kernels read host pages in place (decode) or from a staging copy (prefill) when the
        # host pool is pinned and laid out as the pool is; else host steps go through the dense path
        self.host_alts = host_store.kernel_alts(self.store) if host_store is not None else None

    @property
    def host_kernels(self) -> bool:
        """Whether the kernels read this step's host pages (else the dense path streams them)."""
        return self.host_alts is not None

    def pages_arrived(self, page_ids: list[int], from_host: list[int] | None = None) -> None:
        self.dense.pages_arrived(page_ids, from_host)

    def pages_departed(self, page_ids: list[int], to_host: list[int]) -> None:
        self.dense.pages_departed(page_ids, to_host)

    def graph_ready(self, meta: AttentionMetadata) -> bool:
        """A planner-built decode step (AttentionMetadata.decode_step), host-tier pages read in
        place if it has any: the split-K kernel reads only the meta's device tensors."""
        return meta.decode_step and meta.block_table is not None and (self.host_kernels or not meta.reads_host)

    def plan(self, meta: AttentionMetadata, for_graph: bool = False) -> None:
        """Once per step, before the layers: the split count of a decode step (host pages read
        in place where meta.reads_host), the prefill kernel's plan (with sink rows), or DENSE for
        steps the paged kernels do not take."""
        if not for_graph and not self.graph_ready(meta):
            host = meta.reads_host
            if meta.block_table is None or meta.query_start_loc_t is None or (host and not self.host_kernels):
                self.dense.plan(meta)
                meta.step_cache[id(self)] = DENSE
                return
            qsl = meta.query_start_loc
            max_new = max(qsl[b + 1] - qsl[b] for b in range(meta.num_seqs))
            self.host_steps += host
            meta.step_cache[id(self)] = _KernelPlan(
                prefill=True, max_new=max_new, sink=plan_sink_rows(self.store, meta, meta.slot_mapping.device),
                host=host, staged=self._stage_plan(meta) if host else None)
            return
        from kvtier.kernels.paged_attention import choose_num_splits
        # batch rounded up to a power of two: the same for a step and the padded graph replaying it
        # (captured sizes never pass the next power of two, engine/cuda_graph.py)
        batch = 1 << max(0, meta.num_seqs - 1).bit_length()
        splits = choose_num_splits(batch, self.store.kv_heads, self.max_context or meta.context_bound,
                                   self.store.page_size, self.num_sms)
        if meta.reads_host and not for_graph:
            self.host_steps += 1
        meta.step_cache[id(self)] = _KernelPlan(splits, host=meta.reads_host)

    def rope_store(self, layer: int, qkv: torch.Tensor, rope: QKRope,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Steps the paged kernels take, with no sink rows to keep: the layer's rotary and the
        store of its K / V in one launch (PagePool.rope_store); `forward` then writes nothing."""
        plan = meta.step_cache.get(id(self))
        if not isinstance(plan, _KernelPlan) or plan.sink is not None:
            return None
        got = self.store.rope_store(layer, meta.slot_mapping, qkv, rope)
        if got is not None:
            meta.step_cache[(id(self), layer)] = True  # this layer's rows are in the pages
        return got

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        plan = meta.step_cache.get(id(self))
        if plan is None:
            raise RuntimeError("TritonPagedAttention.plan(meta) must run once before the step's forward")
        if plan is DENSE:
            return self.dense.forward(layer, q, k, v, meta)
        from kvtier.kernels.paged_attention import paged_decode, paged_prefill
        store = self.store
        if not meta.step_cache.pop((id(self), layer), False):  # not already written by rope_store
            # decode rows are never at position 0: sink rows come only with prefill chunks
            store.write(layer, meta.slot_mapping, k, v, sink=plan.sink)
        sink = store.kernel_sink(layer)
        fmt = store.fmt
        table, alt = meta.block_table, None
        if plan.staged is not None:
            table, alt = plan.staged.table, self._stage_layer(layer, plan.staged)
        elif plan.host:
            alt = self.host_alts[layer]  # type: ignore[index]
        # decode: native_q / native_out folded into the kernels (two launches fewer a layer; long
        # splits move them in launches of their own: paged_attention.FOLD_MAX_SPLITS)
        native = store.kernel_native(layer, q.shape[-1]) if self.native and not plan.prefill else None
        if native is not None:
            return paged_decode(q, store.layers[layer], fmt, table, meta.seq_lens_t, self.scale,
                                plan.num_splits, sink=sink, native=native, alt=alt)
        if self.native:
            q = store.native_q(layer, q)
        if plan.prefill:
            o = paged_prefill(q, store.layers[layer], fmt, table, meta.seq_lens_t,
                              meta.query_start_loc_t, self.scale, sink=sink, max_new=plan.max_new, alt=alt)
        else:
            o = paged_decode(q, store.layers[layer], fmt, table, meta.seq_lens_t,
                             self.scale, plan.num_splits, sink=sink, alt=alt)
        return store.native_out(o) if self.native else o

    def _stage_plan(self, meta: AttentionMetadata) -> _Staged:
        """The host pages of a prefill step (each table's negative head), in one list, and the
        block table that names staging page j as -1 - j; staging grown to hold them."""
        dev = meta.block_table.device
        host_ids: list[int] = []
        table = meta.block_table.clone()
        for b, pt in enumerate(meta.page_tables):
            n = host_head(pt)
            if n:
                table[b, :n] = -1 - torch.arange(len(host_ids), len(host_ids) + n, dtype=table.dtype).to(dev)
                host_ids.extend(-1 - p for p in pt[:n])
        host = self.dense.host_store
        ids = torch.tensor(host_ids, dtype=torch.long)
        cap = self.stage[next(iter(self.stage))].shape[1] if self.stage else 0
        if len(host_ids) > cap:  # grown to the next power of two: few reallocations as contexts grow
            cap = 1 << (len(host_ids) - 1).bit_length()
            self.stage = {}  # freed before the larger one is allocated
            self.stage = {name: torch.empty((1, cap, *t.shape[2:]), dtype=t.dtype, device=dev)
                          for name, t in host.storage.items()}  # type: ignore[union-attr]
        slots = host.sink_slot.index_select(0, ids).to(dev, non_blocking=True) if host.sink_slots else None  # type: ignore[union-attr]
        ids_dev = ids.to(dev, non_blocking=True)
        return _Staged(ids_dev, torch.arange(len(host_ids), device=dev), table, slots)

    def _stage_layer(self, layer: int, staged: _Staged):
        """Copy one layer of the step's host pages up (one page-copy launch per tensor) -> their AltPages."""
        from kvtier.kernels import page_copy
        from kvtier.kernels.paged_attention import AltPages
        host = self.dense.host_store
        n = staged.host_ids.numel()
        for name, t in host.storage.items():  # type: ignore[union-attr]
            page_copy.copy_pages(t[layer:layer + 1], self.stage[name], staged.host_ids, staged.to)
        sink = None
        if staged.slots is not None:
            sink = (host.sink_k[layer], host.sink_v[layer], staged.slots)  # type: ignore[union-attr]
        return AltPages({name: t[0, :max(n, 1)] for name, t in self.stage.items()}, sink)
