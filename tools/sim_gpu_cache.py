"""How often would retrieval decode find its chosen pages in the GPU cache, on real text? (CPU)

    PYTHONPATH=. python3 tools/sim_gpu_cache.py [--model smollm2-135m] [--tokens 7000] [--budget 1024]
    PYTHONPATH=. python3 tools/sim_gpu_cache.py --device cuda --gpu-kv-mib 90 --host-kv-mib 512 ...

Random-weight benches choose nearly new pages every step (13% repeat on an H100 profile), so they
cannot show what kernels/hot_pages.py's cache buys. This runs a real model on the CPU over a long
natural prompt (a chat turn: this repo's docs, then a question), records each decode step's
per-(layer, kv head) selection (RetrievalAttention's `record`), and replays the retrieved pages
(the top-k, not the sink or the window, which sit on the GPU anyway) through the cache's rule:
per (layer, head) a ring of C slots claimed in order, a step's claims within a window of C / 2
slots, a page whose slot falls in that window counted as a miss (kernels/hot_pages.py). Prints
the share of pages the previous step chose too, the share of retrieved entries that would read
the host tier if the oldest 50% / 75% of the pages sat there, and per cache size in budgets the
share of retrieved entries that hit.

--device cuda runs the real thing instead: the prompt over a small GPU pool (--gpu-kv-mib) and a
host tier, decode with the cache (--kvmem-gpu-cache as serve's; here -1, four budgets, by
default) and without it; prints decode tok/s and the cache's own counts (kernels/hot_pages.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtier.config import CacheConfig, EngineConfig, RetrievalConfig  # noqa: E402
from kvtier.engine.build import build_engine  # noqa: E402
from kvtier.engine.request import Request, SamplingParams  # noqa: E402


def ring_hits(steps: list[list[int]], slots: int) -> tuple[int, int]:
    """One (layer, head)'s retrieved page indices per step through the cache's ring -> (hits, asked)."""
    window = slots // 2
    where: dict[int, int] = {}  # page -> slot
    owner: dict[int, int] = {}  # slot -> page
    base = claim = 0
    hits = asked = 0
    for pages in steps:
        base = min(claim, base + window)
        claim = base
        for p in pages:
            asked += 1
            s = where.get(p)
            if s is not None and (s - base % slots) % slots >= window:
                hits += 1
                continue
            c = claim - base
            claim += 1
            if c >= window:
                continue
            new = (base + c) % slots
            old = owner.get(new)
            if old is not None and where.get(old) == new:
                del where[old]
            owner[new] = p
            where[p] = new
    return hits, asked


def prompt(tok, tokens: int) -> list[int]:
    """A chat turn: this repo's docs cut to about `tokens`, then a question about them."""
    text = "\n\n".join((ROOT / "docs" / f).read_text() for f in ("architecture.md", "benchmarks.md"))
    question = "\n\nWhat does the retrieval backend keep on the GPU, and why? Answer in a few sentences."
    wrap = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": question}])))
    doc = tok.decode(tok.encode(text)[: tokens - wrap])
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": doc + question}]))


def on_gpu(a: argparse.Namespace) -> None:
    """Decode over a small GPU pool and the host tier, with the GPU cache and without."""
    for cache in (a.kvmem_gpu_cache, 0):
        ret = RetrievalConfig(budget=a.budget, gpu_cache=cache)
        cfg = EngineConfig(device="cuda", max_batch=1, retrieval=ret,
                           cache=CacheConfig(gpu_kv_mib=a.gpu_kv_mib, host_kv_mib=a.host_kv_mib,
                                             enable_prefix_cache=False))
        eng = build_engine(a.model, cfg, show_progress=False)
        ids = prompt(eng.tokenizer, a.tokens)
        for rep in range(2):  # the first decode compiles what the capture did not
            eng.add_request(Request(f"r{rep}", ids, SamplingParams(temperature=0.0, max_tokens=a.gen,
                                                                   ignore_eos=True)))
            out: list[int] = []
            t_first = None
            while eng.has_unfinished():
                for o in eng.step():
                    out += o.token_ids
                    if t_first is None and out:
                        torch.cuda.synchronize()
                        t_first = time.perf_counter()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t_first
        be = eng.runner.backend
        print(f"gpu cache {eng.gpu_cache_pages} pages (asked {cache} tokens), pool {eng.manager.num_gpu_pages} "
              f"pages, {len(ids)} prompt tokens, budget {a.budget}: decode {(len(out) - 1) / dt:.1f} tok/s, "
              f"host rows {be.in_place_host_rows}, cache {be.gpu_cache_stats()}; {eng.tokenizer.decode(out)[:60]!r}")
        del eng
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=7000, help="prompt tokens (docs text, then the question)")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gpu-kv-mib", type=int, default=90)
    ap.add_argument("--host-kv-mib", type=int, default=512)
    ap.add_argument("--kvmem-gpu-cache", type=int, default=-1)
    a = ap.parse_args()
    if a.device == "cuda":
        on_gpu(a)
        return
    ret = RetrievalConfig(budget=a.budget)
    cfg = EngineConfig(device="cpu", max_batch=1, retrieval=ret, cache=CacheConfig(enable_prefix_cache=False))
    eng = build_engine(a.model, cfg, show_progress=False)
    tok = eng.tokenizer
    ids = prompt(tok, a.tokens)
    be = eng.runner.backend
    be.record = True
    eng.add_request(Request("r", ids, SamplingParams(temperature=0.0, max_tokens=a.gen, ignore_eos=True)))
    ps = eng.pool.page_size
    sink_pages, window_pages, _ = ret.page_counts(ps)
    per: dict[tuple[int, int], list[list[int]]] = {}
    out: list[int] = []
    while eng.has_unfinished():
        be.last_selection.clear()
        for o in eng.step():
            out += o.token_ids
        if not be.last_selection:
            continue
        ctx = len(ids) + len(out)
        w0 = max(sink_pages, (ctx - max(ret.window, 1)) // ps)
        for layer, (idx, valid) in be.last_selection.items():
            for h in range(idx.shape[1]):
                sel = idx[0, h][valid[0, h]].tolist()
                per.setdefault((layer, h), []).append([p for p in sel if sink_pages <= p < w0])
    be.mass_log.clear()
    print(f"{a.model}: {len(ids)} prompt tokens, budget {a.budget}, {len(out)} tokens decoded: "
          f"{tok.decode(out)[:120]!r}")
    repeat = total = 0
    for steps in per.values():
        for prev, cur in zip(steps, steps[1:]):
            repeat += len(set(prev) & set(cur))
            total += len(cur)
    print(f"retrieved pages the previous step chose too: {repeat / max(total, 1):.0%} "
          f"({len(per)} (layer, kv head) lists, {len(next(iter(per.values())))} steps)")
    ctx_pages = -(-(len(ids) + len(out)) // ps)
    for share in (0.5, 0.75):  # the oldest `share` of the context in the host tier
        old = sum(p < share * ctx_pages for steps in per.values() for pages in steps for p in pages)
        every = sum(len(pages) for steps in per.values() for pages in steps)
        print(f"with the oldest {share:.0%} of the pages in the host tier, {old / max(every, 1):.0%} of the "
              f"retrieved entries would read host pages")
    k = ret.page_counts(ps)[2]
    for budgets in (1, 2, 4):
        hits = asked = 0
        for steps in per.values():
            h, n = ring_hits(steps, budgets * k)
            hits += h
            asked += n
        print(f"cache of {budgets} budget(s) ({budgets * k} slots a (layer, head)): {hits / max(asked, 1):.0%} "
              f"of {asked:,} retrieved entries hit")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
