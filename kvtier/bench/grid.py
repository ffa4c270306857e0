"""`kvtier bench --contexts ... --batches ... --kv-dtypes ...`: decode speed over a grid.

One model (a random-weight shape or a checkpoint) is built once; for each KV
format an Engine is made over it (its pool, CUDA graphs), and for each context
and batch size B, B greedy requests of that prompt length run together:

    TTFT        time until every request has its first token (B prompts prefilled)
    decode      B * (gen - 1) tokens / time from then to the end
    % of bound  step rate * bytes a step reads / measured bandwidth, where a step
                reads every weight once plus each sequence's whole KV context
                (codes, scales and sink share: pool.kv_bytes_per_token x layers);
                with retrieval past its budget, the budget's KV instead, plus the
                page summaries of the whole context the selection scores (host-tier
                pages among the chosen ones cross the bus, not counted apart)

HF transformers runs the batch-1 rows of the first format in the same process
on the same weights (same token ids), for reference.
"""

from __future__ import annotations

import argparse
import gc
import time
import uuid
from dataclasses import dataclass, replace

import torch
from rich.console import Console
from rich.table import Table

from kvtier.config import EngineConfig

from kvtier.bench.run import bench_hf_model, measure_bandwidth, synthetic_ids, _sync

# the request each engine runs before the timed rows (kernels compiled, graphs warm): counted in
# max_model_len, so a grid of short contexts fits it
WARMUP_PROMPT = 64
WARMUP_GEN = 8


@dataclass
class GridRow:
    engine: str
    kv: str
    context: int
    batch: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float  # aggregate over the batch
    step_bytes: float  # bytes one decode step reads from device memory (weights + KV at the mean context)
    bandwidth: float
    bus_s: float = 0.0  # seconds a step's streamed layers take over the host bus at its measured speed
    step_ms: tuple[float, float] = (0.0, 0.0)  # decode step wall time, median and slowest

    @property
    def bw_pct(self) -> float:
        steps_per_s = self.decode_tok_s / self.batch
        return 100 * steps_per_s * (self.step_bytes / self.bandwidth + self.bus_s)


def _csv(text: str, cast=str) -> list:
    return [cast(x) for x in text.split(",") if x.strip()]


def measure_bus(dev: torch.device, mib: int = 512) -> float:
    """Host-to-device bytes/s from pinned memory (what a streamed layer's copy gets)."""
    src = torch.empty(mib << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(dev)
    return 4 * (mib << 20) / (time.perf_counter() - t0)


def run_batch(engine, prompts: list[list[int]], gen: int) -> tuple[float, float, int, tuple[float, float]]:
    """All prompts at once, greedy. -> (TTFT of the last first token, decode seconds, tokens,
    (median, slowest) decode step in ms: a stall, e.g. a garbage collection or a wait on the
    prefill's copies, shows as a slowest step far above the median)."""
    from kvtier.engine.request import Request, SamplingParams

    for ids in prompts:
        engine.add_request(Request(uuid.uuid4().hex, ids, SamplingParams(temperature=0.0, max_tokens=gen,
                                                                          ignore_eos=True)))
    _sync(engine.device)
    t0 = time.perf_counter()
    first: set[str] = set()
    t_first = None
    n = 0
    steps: list[float] = []
    while engine.has_unfinished():
        t_step = time.perf_counter()
        outs = engine.step()
        if t_first is not None:
            steps.append(time.perf_counter() - t_step)
        for o in outs:
            n += len(o.token_ids)
            if o.token_ids and o.request_id not in first:
                first.add(o.request_id)
                if len(first) == len(prompts):
                    _sync(engine.device)
                    t_first = time.perf_counter()
    _sync(engine.device)
    t_end = time.perf_counter()
    assert t_first is not None
    steps.sort()
    step_ms = (steps[len(steps) // 2] * 1e3, steps[-1] * 1e3) if steps else (0.0, 0.0)
    return t_first - t0, t_end - t_first, n, step_ms


def _gpu_cache_stats(engine) -> dict[str, int]:
    """Retrieval's GPU cache of selected host pages so far ({} without one)."""
    from kvtier.layers.retrieval import RetrievalAttention
    backend = engine.runner.backend
    return backend.gpu_cache_stats() if isinstance(backend, RetrievalAttention) else {}


def run_grid(a: argparse.Namespace, config: EngineConfig) -> int:
    """config: the EngineConfig the command line asked for; the grid varies its KV format."""
    from kvtier.bench.shapes import random_model
    from kvtier.engine.build import DTYPES, prepare_model, resolve_device
    from kvtier.engine.engine import Engine
    from kvtier.kv.formats import make_format
    from kvtier.kv.pool import kv_bytes_per_token
    from kvtier.kv.summaries import summary_bytes_per_token, summary_dtype

    console = Console()
    if not a.shape:
        raise ValueError("the grid bench runs on a random-weight --shape")
    base = resolve_device(config)
    dev, dt = torch.device(base.device), DTYPES[base.dtype]
    hf, net = random_model(a.shape, dt, dev, base.offload_layers or 0)
    net = prepare_model(net, base)
    spec = net.spec
    bw = measure_bandwidth(dev)
    wbytes = net.decode_weight_bytes()
    streamed, bus_s = 0, 0.0
    if getattr(net, "offload", None) is not None and dev.type == "cuda":
        streamed = net.offload.host_bytes()  # crosses the bus each step instead of read from device memory
        bus = measure_bus(dev)
        bus_s = streamed / bus
        console.print(f"[dim]{len(net.offload.layers)} layers streamed: {streamed / 1e9:.2f} GB a step over "
                      f"the bus at {bus / 1e9:.1f} GB/s ({bus_s * 1e3:.1f} ms)[/]")
    contexts, batches = _csv(a.contexts, int), _csv(a.batches, int)
    rows: list[GridRow] = []
    peak = 0
    for i, kv in enumerate(_csv(a.kv_dtypes)):
        need = max([c + a.gen_tokens for c in contexts] + [WARMUP_PROMPT + WARMUP_GEN])
        cfg = replace(base, cache=replace(base.cache, kv_dtype=kv),
                      max_model_len=max(base.max_model_len or 0, need))
        engine = Engine(net, None, cfg, model_name=f"random-{a.shape}")
        console.print(f"[dim]{kv}: backend {engine.runner.backend.name}, CUDA graphs captured in "
                      f"{engine.graph_capture_seconds:.1f} s, {engine.manager.num_gpu_pages} pages[/]")
        kvpt = kv_bytes_per_token(make_format(kv), spec.num_kv_heads, spec.head_dim, cfg.cache.page_size,
                                  dt) * spec.num_layers
        ret = cfg.retrieval
        summ_pt = summary_bytes_per_token(spec.num_kv_heads, spec.head_dim, cfg.cache.page_size, spec.num_layers,
                                          summary_dtype(dev, dt, ret.summary_bits), ret.key_sums) if ret.enabled else 0.0
        run_batch(engine, [synthetic_ids(WARMUP_PROMPT, spec.vocab_size, 3)], WARMUP_GEN)  # warm-up
        gc.collect()
        gc.freeze()  # as `kvtier serve` does: no collection walks the startup objects mid-row
        for ctx in contexts:
            for b in batches:
                if b * (ctx + a.gen_tokens) > engine.manager.num_gpu_pages * cfg.cache.page_size \
                        and engine.host_pool is None:  # with a host tier, the rest lives there
                    console.print(f"[yellow]skip {kv} ctx {ctx} batch {b}: pool too small (no host tier)[/]")
                    continue
                if b > 1 and b * ctx > a.grid_max_tokens:
                    console.print(f"[dim]skip {kv} ctx {ctx} batch {b}: over --grid-max-tokens[/]")
                    continue
                prompts = [synthetic_ids(ctx, spec.vocab_size, 31 + 2 * j) for j in range(b)]
                cache0 = _gpu_cache_stats(engine)
                ttft, dec_s, n, step_ms = run_batch(engine, prompts, a.gen_tokens)
                mean_ctx = ctx + a.gen_tokens / 2
                kv_read = step_kv_bytes(mean_ctx, b, kvpt, ret.budget, summ_pt)  # budget 0: retrieval off
                rows.append(GridRow("kvtier", kv, ctx, b, ttft, b * ctx / ttft, (n - b) / dec_s,
                                    wbytes - streamed + kv_read, bw, bus_s, step_ms))
                console.print(_fmt(rows[-1]))
                cache = _gpu_cache_stats(engine)
                if cache.get("asked", 0) > cache0.get("asked", 0):
                    asked, hits = (cache[k] - cache0[k] for k in ("asked", "hits"))
                    console.print(f"[dim]  GPU cache of selected host pages ({engine.gpu_cache_pages} pages): "
                                  f"{hits:,} of {asked:,} host list entries hit ({hits / asked:.0%}), "
                                  f"{cache['brought'] - cache0['brought']:,} pages brought up[/]")
                if i == 0 and b == 1 and not a.no_hf and hf is not None:
                    r = bench_hf_model(hf, prompts[0], a.gen_tokens, dev, bw)
                    hf_bytes = r.weight_bytes + mean_ctx * 2 * spec.num_layers * spec.num_kv_heads \
                        * spec.head_dim * torch.empty((), dtype=dt).element_size()
                    rows.append(GridRow("hf-transformers", "bf16", ctx, 1, r.ttft_s, r.prefill_tok_s,
                                        r.decode_tok_s, hf_bytes, bw))
                    console.print(_fmt(rows[-1]))
        if dev.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_reserved(dev))
            console.print(f"[dim]{kv}: peak GPU memory {peak / 2**30:.2f} GiB (torch's allocator)[/]")
        del engine
        gc.unfreeze()
        gc.collect()
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    _report(console, a, rows, bw, wbytes, peak, streamed, len(net.offload.layers) if streamed else 0)
    return 0


def step_kv_bytes(context: float, batch: int, kv_per_token: float, budget: int = 0,
                  summary_per_token: float = 0.0) -> float:
    """KV bytes a decode step reads for `batch` sequences at `context` tokens: the whole context,
    or with retrieval past its `budget` (tokens) the budget's KV plus the summaries of the whole
    context (summary_per_token: kv/summaries.py summary_bytes_per_token)."""
    if budget and context > budget:
        return batch * (budget * kv_per_token + context * summary_per_token)
    return batch * context * kv_per_token


def _fmt(r: GridRow) -> str:
    return (f"{r.engine:16s} kv {r.kv:5s} ctx {r.context:6d} batch {r.batch:3d}: TTFT {r.ttft_s * 1e3:8.1f} ms, "
            f"prefill {r.prefill_tok_s:8.0f} tok/s, decode {r.decode_tok_s:8.1f} tok/s, "
            f"{r.bw_pct:4.0f}% of bound" + (f", step ms {r.step_ms[0]:.2f} median / {r.step_ms[1]:.2f} slowest"
                                             if r.step_ms[1] else ""))


def _report(console: Console, a: argparse.Namespace, rows: list[GridRow], bw: float, wbytes: int,
            peak: int = 0, streamed: int = 0, streamed_layers: int = 0) -> None:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    title = (f"random-{a.shape} on {dev}; weights read per step {wbytes / 1e9:.2f} GB; "
             f"bandwidth {bw / 1e9:.0f} GB/s")
    if streamed:
        title += f"; {streamed_layers} layers streamed from host RAM ({streamed / 1e9:.2f} GB a step)"
    if peak:
        title += f"; peak GPU memory {peak / 2**30:.2f} GiB"
        if getattr(a, "gpu_memory_limit", None):
            title += f" (--gpu-memory-limit {a.gpu_memory_limit})"
    table = Table(title=title)
    cols = ("engine", "KV", "context", "batch", "TTFT ms", "prefill tok/s", "decode tok/s", "% of bound",
            "step ms (median / slowest)")
    for c in cols:
        table.add_column(c, justify="left" if c in ("engine", "KV") else "right", no_wrap=True)
    out = []
    for r in rows:
        row = (r.engine, r.kv, str(r.context), str(r.batch), f"{r.ttft_s * 1e3:.0f}", f"{r.prefill_tok_s:.0f}",
               f"{r.decode_tok_s:.1f}", f"{r.bw_pct:.0f}%",
               f"{r.step_ms[0]:.2f} / {r.step_ms[1]:.2f}" if r.step_ms[1] else "")
        table.add_row(*row)
        out.append(row)
    console.print(table)
    if a.out:
        with open(a.out, "a") as f:
            f.write(f"\n{title}\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
            for row in out:
                f.write("| " + " | ".join(row) + " |\n")
