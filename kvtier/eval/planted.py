"""`kvtier eval planted`: does the page index find needles at lengths past any model's context?

No model: one attention layer of a real shape (default Qwen3-8B: 8 kv heads x 4 query heads,
head_dim 128) over `length` tokens of random keys and values, written through the pool's own
write path (its KV format) with the page summaries retrieval serves with. Each trial draws one
decode query row q and, per kv head h, one needle page at a random place between the sink and
the window. Every key of that page (head h's rows only; the other heads keep their random keys)
is planted to match h's queries:

    k = a * u_h + noise,   u_h = the unit mean of h's G query rows,
    a such that scale * (q_mean . k) = (the largest logit a random key gives any of h's
    queries) + margin   (nats: how far above the strongest distractor the needle stands)

The decode row then runs through RetrievalAttention (each selector) and through dense attention
over every key. Reported per (length, margin, selector): the share of (trial, kv head) needles the
selection holds, the mean dense softmax mass the selection covers, and the output's error against
dense attention (|o - o_dense| / |o_dense|, mean over trials and query heads).

Lengths are rounded down to whole pages; the decode row starts a new page, so repeated trials
never fold into an earlier trial's page summary.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch

from kvtier.eval import retrieval_methods
from kvtier.kv.formats import make_format
from kvtier.kv.pool import PagePool
from kvtier.kv.summaries import PageSummaries
from kvtier.layers.attention import AttentionMetadata

# Tokens written per chunk while filling the pool (bounds the fp32 temporaries).
FILL_CHUNK = 8192
# Noise on planted keys, relative to the random keys' std: a needle page is not 16 copies of one key.
NEEDLE_NOISE = 0.1


@dataclass(frozen=True)
class PlantedRow:
    length: int
    margin: float
    method: str
    found: float  # share of (trial, kv head) needles in the selection
    mass: float  # mean dense softmax mass on the selected keys
    rel_err: float  # mean |o - o_dense| / |o_dense|


@torch.inference_mode()
def run_planted(length: int, margins: list[float], trials: int, budget: int, selectors: list[str],
                kv_heads: int = 8, gqa: int = 4, head_dim: int = 128, page_size: int = 16, sink: int = 16,
                window: int = 256, kv_dtype: str = "bf16", device: str = "cpu", seed: int = 0) -> list[PlantedRow]:
    """One pool of `length` random tokens; per margin, `trials` planted rows through each selector
    method ("<selector>/8": over 8-bit page summaries, kv/summaries.py; as `kvtier eval recall`)."""
    dev = torch.device(device)
    compute = torch.float32 if kv_dtype == "fp32" else (torch.bfloat16 if dev.type == "cpu" else torch.float16)
    n_pages = length // page_size + 1  # + the decode row's page
    ctx = (n_pages - 1) * page_size
    pool = PagePool(make_format(kv_dtype), 1, n_pages, kv_heads, page_size, head_dim, dev, compute_dtype=compute)
    scale = head_dim ** -0.5
    by_bits, methods = retrieval_methods(pool, scale, selectors, budget, sink, window, record=True, kernel=False)
    summaries = list(by_bits.values())
    lo_page, hi_page = -(-sink // page_size), (ctx - window) // page_size
    if hi_page - lo_page < 1:
        raise ValueError(f"length {length} leaves no page between the sink and the window")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rng = random.Random(seed)
    hq = kv_heads * gqa
    n_runs = len(margins) * trials
    queries = torch.randn(n_runs, hq, head_dim, generator=gen)  # [N, Hq, D]
    needle_pages = [[rng.randrange(lo_page, hi_page) for _ in range(kv_heads)] for _ in range(n_runs)]
    keep = sorted({p for run in needle_pages for p in run})
    saved_k: dict[int, torch.Tensor] = {}
    saved_v: dict[int, torch.Tensor] = {}
    # fill: random keys and values, the largest logit any key gives each run's query heads
    max_logit = torch.full((n_runs, hq), float("-inf"))
    qg = queries.view(n_runs, kv_heads, gqa, head_dim)
    for start in range(0, ctx, FILL_CHUNK):
        n = min(FILL_CHUNK, ctx - start)
        k = torch.randn(n, kv_heads, head_dim, generator=gen)
        v = torch.randn(n, kv_heads, head_dim, generator=gen)
        if start == 0 and pool.fmt.smooth_k:
            pool.calibrate(0, k.to(dev))
        logits = torch.einsum("nhgd,thd->nhgt", qg, k).mul_(scale).amax(-1)  # [N, Hkv, g]
        max_logit = torch.maximum(max_logit, logits.reshape(n_runs, hq))
        for p in keep:
            lo = p * page_size - start
            if 0 <= lo < n:
                saved_k[p], saved_v[p] = k[lo:lo + page_size].clone(), v[lo:lo + page_size].clone()
        _write(pool, summaries, start, k.to(dev, compute), v.to(dev, compute))
    table = list(range(n_pages))
    out: list[PlantedRow] = []
    for mi, margin in enumerate(margins):
        stats = {s: [0, 0.0, 0.0] for s in methods}  # found, mass, err
        for t in range(trials):
            run = mi * trials + t
            q = queries[run]
            planted: dict[int, torch.Tensor] = {}  # page -> its keys, every needle of it planted
            for h, p in enumerate(needle_pages[run]):
                qbar = qg[run, h].mean(0)
                u = qbar / qbar.norm()
                target = float(max_logit[run, h * gqa:(h + 1) * gqa].max()) + margin
                a = target / (scale * float(qbar @ u))
                k = planted.setdefault(p, saved_k[p].clone())
                k[:, h] = a * u + NEEDLE_NOISE * torch.randn(page_size, head_dim, generator=gen)
            for p, k in planted.items():
                _write(pool, summaries, p * page_size, k.to(dev, compute), saved_v[p].to(dev, compute))
            k_new = torch.randn(1, kv_heads, head_dim, generator=gen).to(dev, compute)
            v_new = torch.randn(1, kv_heads, head_dim, generator=gen).to(dev, compute)
            qd = q[None].to(dev, compute)
            dense = None
            for s, att in methods.items():
                meta = AttentionMetadata([0, 1], [ctx + 1], [table], torch.tensor([ctx], device=dev),
                                         torch.tensor([0], device=dev))
                att.plan(meta)
                att.last_selection.clear()
                o = att.forward(0, qd, k_new, v_new, meta).float()
                if dense is None:
                    dense = att.dense.attend(0, qd, meta).float()
                if 0 not in att.last_selection:  # within the budget: dense, every key attended
                    stats[s][0] += kv_heads
                    stats[s][1] += 1.0
                else:
                    idx, valid = att.last_selection[0]  # [1, Hkv, n_sel]
                    for h, p in enumerate(needle_pages[run]):
                        stats[s][0] += int(bool(((idx[0, h] == p) & valid[0, h]).any()))
                    stats[s][1] += float(torch.cat(att.mass_log).mean())
                    att.mass_log.clear()
                stats[s][2] += float(((o - dense).norm(dim=-1) / dense.norm(dim=-1)).mean())
            for p in planted:  # restore the random pages
                _write(pool, summaries, p * page_size, saved_k[p].to(dev, compute), saved_v[p].to(dev, compute))
        for s in methods:
            f, m, e = stats[s]
            out.append(PlantedRow(ctx, margin, s, f / (trials * kv_heads), m / trials, e / trials))
    return out


def _write(pool: PagePool, summaries: list[PageSummaries], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Rows start.. of the one sequence (pages 0.. in order) into the pool and each of its
    summaries; the row at position 0 also into its sink slot (quantized formats)."""
    slots = torch.arange(start, start + k.shape[0], device=k.device)
    sink = None
    if start == 0 and pool.sink_slots:
        sink = (torch.tensor([0], device=k.device), pool.assign_sinks([0]))
    pool.write(0, slots, k, v, sink=sink)
    for summ in summaries:
        summ.update(0, slots, k)


def main(args: argparse.Namespace) -> int:
    from kvtier.eval.recall import print_table

    dev = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    margins = [float(x) for x in args.margins.split(",")]
    selectors = [s for s in args.selectors.split(",") if s]
    rows: list[PlantedRow] = []
    for length in (int(x) for x in args.lengths.split(",")):
        rows += run_planted(length, margins, args.trials, args.budget, selectors, args.kv_heads, args.gqa,
                            args.head_dim, args.page_size, args.sink, args.window, args.kv_dtype, dev, args.seed)
    table = [["length", "margin (nats)", "selector", "needles found", "dense mass covered", "output error"]]
    table += [[f"{r.length:,}", f"{r.margin:g}", r.method, f"{100 * r.found:.1f}%", f"{r.mass:.3f}",
               f"{r.rel_err:.3f}"] for r in rows]
    title = (f"planted needles: {args.kv_heads} kv heads x {args.gqa}, head_dim {args.head_dim}, {args.kv_dtype} KV, "
             f"budget {args.budget} (sink {args.sink}, window {args.window}, page {args.page_size}), "
             f"{args.trials} trials x {args.kv_heads} heads, {dev}")
    md = print_table(title, table)
    if args.markdown:
        args.markdown.write_text(md + "\n")
    return 0
