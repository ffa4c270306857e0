"""DecodeGraphs: CUDA graphs of the whole decode forward, one per batch size.

A decode step is hundreds of small kernels; launched one by one from Python
the GPU idles between them. Captured once at start over the step planner's
persistent buffers (engine/step_plan.py), a step is one `replay()`: the
planner writes the step's tokens, positions, slots, page table and lengths
into those buffers and the graph reads them.

    batch of n decodes -> smallest captured size s >= n -> rows n..s-1 padded
    (seq_len 0: attend to nothing, K/V written to the scratch page only)

What a captured step may not do: synchronise with the host, allocate by data
values, or grow a cache (the rotary table is grown to the capacity first).
The backend's `plan(meta, for_graph=True)` makes only shape-based choices.

With a host tier the kernels read in place (`backend.host_kernels`), each size
has a second graph whose attention reads host-tier pages over the bus (the
kernels' AltPages variant): decode of a sequence longer than the GPU pool
replays too, instead of running hundreds of launches eagerly.
"""

from __future__ import annotations

import time

import torch

from kvtier.engine.step_plan import StepPlanner

# Batch sizes captured (up to max_batch): dense at the small end, where batch-1 latency
# matters, coarser above (padding 17 -> 24 rows costs little in a bandwidth-bound step).
# No size lies strictly between n and n's next power of two without covering n: the attention
# backend picks its split-K partitions by that power of two, so a step and its padded replay
# reduce in the same order (tests/engine/test_step_plan.py checks it).
GRAPH_BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Eager runs on a side stream before each capture: lets lazy init (cuBLAS handles, Triton
# autotuning and compilation) happen outside the graph.
WARMUP_RUNS = 2


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend, planner: StepPlanner, max_batch: int,
                 max_seq_len: int):
        self.model = model
        self.backend = backend
        self.planner = planner
        self.max_seq_len = max_seq_len
        self.sizes = [s for s in GRAPH_BATCH_SIZES if s < max_batch] + [max_batch]
        # the variants captured: (host-tier reads?) -> only False without a kernel-read host tier
        self.variants = (False, True) if getattr(backend, "host_kernels", False) else (False,)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def size_for(self, n: int) -> int | None:
        """The captured batch size that runs n decodes (None: none big enough)."""
        return next((s for s in self.sizes if s >= n), None)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (smaller ones reuse its memory pool). -> seconds"""
        t0 = time.perf_counter()
        self.model.rotary.reserve(self.max_seq_len)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in sorted(self.sizes, reverse=True):
            for host in self.variants:
                inputs = self.planner.idle_inputs(size, self.max_seq_len, host=host)
                self.backend.plan(inputs.meta, for_graph=True)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(WARMUP_RUNS):
                        self.model(inputs.input_ids, inputs.positions, inputs.meta, self.backend)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.backend)
                self._graphs[size, host] = (graph, logits)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    def replay(self, size: int, rows: int, host: bool = False) -> torch.Tensor:
        """Run the graph of `size` (host: its host-tier variant) over what the planner staged;
        -> logits [rows, V] fp32."""
        graph, logits = self._graphs[size, host]
        graph.replay()
        return logits[:rows]
