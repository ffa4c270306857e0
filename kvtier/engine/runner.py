"""ModelRunner: turns a scheduler Batch into a step plan, runs the model, returns logits.

    batch.seqs:      s0 (prefill chunk, 5 tok)  s1 (decode, 1 tok)  s2 (chunk, 3 tok)
    input_ids:       | t t t t t |               | t |               | t t t |
    query_start_loc: 0           5               6                   9
    logits rows:     the last row of each seq with sample=True

Per step: host<->GPU page copies first, then the planner (engine/step_plan.py)
stages the inputs into persistent device buffers, the attention backend plans
once (`backend.plan`), and the forward runs: as a replay of a captured CUDA
graph (engine/cuda_graph.py) when every sequence decodes one token (from
either tier where the graphs have a host variant), else eagerly.
"""

from __future__ import annotations

import torch

from kvtier.engine.cuda_graph import DecodeGraphs
from kvtier.engine.scheduler import Batch
from kvtier.engine.step_plan import Feed, StepPlanner, decode_step, reads_host
from kvtier.kv.pool import PagePool
from kvtier.layers.attention import AttentionBackend


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: PagePool, backend: AttentionBackend,
                 device: torch.device, host_pool: PagePool | None = None, *, max_seqs: int = 32,
                 max_tokens: int = 2048, max_model_len: int = 4096, scratch_page: int | None = None):
        """scratch_page: a pool page no sequence owns, where graph padding rows write (needed
        for CUDA graphs)."""
        self.model = model
        self.pool = pool
        self.host_pool = host_pool
        self.backend = backend
        self.device = device
        self.page_size = ps = pool.page_size
        self.max_model_len = max_model_len
        self.scratch_page = scratch_page
        self.planner = StepPlanner(device, ps, max_tokens, max_seqs, -(-max_model_len // ps),
                                   scratch_slot=(scratch_page or 0) * ps)
        self.graphs: DecodeGraphs | None = None
        self.graph_steps = 0  # steps that replayed a graph (stats, tests)
        self.host_graph_steps = 0  # of them, steps whose graph read host-tier pages

    def capture_graphs(self) -> float:
        """Capture decode graphs for batch sizes up to max_seqs. -> seconds taken."""
        if self.device.type != "cuda" or self.scratch_page is None:
            raise ValueError("CUDA graphs need a CUDA device and a scratch page")
        self.graphs = DecodeGraphs(self.model, self.backend, self.planner, self.planner.max_seqs,
                                   self.max_model_len)
        return self.graphs.capture()

    def run_transfers(self, batch: Batch) -> None:
        """Swap pages between tiers before the forward, phase by phase in the order the
        manager queued them (kv/manager.py: a page may be swapped in and copied down again)."""
        t = batch.transfers
        if t is None or self.host_pool is None:
            return
        for to_host, pairs in t.phases:
            src, dst = (list(x) for x in zip(*pairs))
            if to_host:
                self.pool.copy_to(self.host_pool, src, dst)
                self.backend.pages_departed(src, dst)
            else:
                self.host_pool.copy_to(self.pool, src, dst)
                self.backend.pages_arrived(dst, src)

    @torch.inference_mode()
    def execute(self, batch: Batch, feed: Feed | None = None) -> torch.Tensor:
        """Run one step. Returns fp32 logits [n_sampled, vocab], in batch order.
        feed: input ids still on the device (sampled by the step before, overlap scheduling)."""
        self.run_transfers(batch)
        size = self._graph_size(batch)
        if size is not None:
            step = self.planner.plan(batch, pad_to=size, max_seq_len=self.max_model_len, feed=feed)
            self.backend.plan(step.meta)  # what the backend stages for the step (the graph reads it)
            host = step.meta.reads_host
            self.graph_steps += 1
            self.host_graph_steps += host
            return self.graphs.replay(size, len(batch.seqs), host)  # type: ignore[union-attr]
        step = self.planner.plan(batch, feed=feed)
        self.backend.plan(step.meta)
        logits = self.model(step.input_ids, step.positions, step.meta, self.backend)
        return logits.float()

    def _graph_size(self, batch: Batch) -> int | None:
        """The captured size that runs this step, or None (eager): a decode step
        (step_plan.decode_step) of a batch size some graph covers, reading host-tier pages only
        where a host variant was captured."""
        if self.graphs is None or not decode_step(batch) or (reads_host(batch) and True not in self.graphs.variants):
            return None
        return self.graphs.size_for(len(batch.seqs))
