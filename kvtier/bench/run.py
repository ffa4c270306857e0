"""`kvtier bench`: prefill and decode speed of kvtier vs HF transformers (and llama.cpp).

Decode speed is also given as a share of the memory-bandwidth bound: every
decode step reads all weights once, so tokens/s <= bandwidth / weight bytes.
Bandwidth is measured in the same run with a large device copy.
"""

from __future__ import annotations

import argparse
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

# Bytes moved by the bandwidth probe: large enough to defeat caches.
PROBE_BYTES = 512 * 2**20
SEED_TEXT = ("The quick brown fox jumps over the lazy dog while the engineers measure how fast "
             "a language model can read its own history. ")


@dataclass
class Result:
    engine: str
    prompt_tokens: int
    gen_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    weight_bytes: int
    bandwidth: float  # bytes/s measured on the same device

    @property
    def bw_pct(self) -> float:
        return 100 * self.decode_tok_s * self.weight_bytes / self.bandwidth


def measure_bandwidth(device: torch.device) -> float:
    """Achievable read+write bandwidth of a large copy (bytes/s, counting read and write)."""
    n = PROBE_BYTES // 4
    a = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * PROBE_BYTES / best


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(SEED_TEXT)
    return ids[:n]


def bench_kvtier(engine, ids: list[int], gen: int, bandwidth: float) -> Result:
    from kvtier.engine.request import Request, SamplingParams

    p = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    engine.generate_sync([Request("warmup", ids[:16], SamplingParams(temperature=0, max_tokens=4))])
    req = Request(uuid.uuid4().hex, ids, p)
    engine.add_request(req)
    t0 = time.perf_counter()
    ttft, n = None, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_ids and ttft is None:
                _sync(engine.device)
                ttft = time.perf_counter() - t0
            n += len(o.token_ids)
    _sync(engine.device)
    total = time.perf_counter() - t0
    wbytes = sum(t.numel() * t.element_size() for t in engine.model.parameters())
    return Result("kvtier", len(ids), n, ttft, len(ids) / ttft, (n - 1) / (total - ttft), wbytes, bandwidth)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_hf(path: Path, ids: list[int], gen: int, device: torch.device, dtype: torch.dtype,
             bandwidth: float) -> Result:
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    src = str(path.parent) if path.suffix == ".gguf" else str(path)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw).to(device).eval()
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        model.generate(x[:, :16], max_new_tokens=4, do_sample=False)
        _sync(device)
        t0 = time.perf_counter()
        model(x)
        _sync(device)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
        _sync(device)
        total = time.perf_counter() - t0
    n = out.shape[1] - x.shape[1]
    wbytes = sum(t.numel() * t.element_size() for t in model.parameters())
    return Result("hf-transformers", len(ids), n, ttft, len(ids) / ttft,
                  (n - 1) / max(total - ttft, 1e-9), wbytes, bandwidth)


def bench_llama_cpp(path: Path, ids: list[int], gen: int, threads: int, bandwidth: float) -> Result | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=len(ids) + gen + 16, n_threads=threads, verbose=False)
    t0 = time.perf_counter()
    llm.eval(ids)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(gen):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    dt = time.perf_counter() - t0
    return Result("llama.cpp", len(ids), gen, ttft, len(ids) / ttft, gen / dt, path.stat().st_size, bandwidth)


def run_bench(a: argparse.Namespace) -> int:
    from kvtier.cli import _engine_config
    from kvtier.engine.build import DTYPES, build_engine
    from kvtier.models.hub import resolve_model

    console = Console()
    engine = build_engine(a.model, _engine_config(a), console=Console(stderr=True))
    path = Path(resolve_model(a.model))
    ids = prompt_ids(engine.tokenizer, a.prompt_tokens)
    bw = measure_bandwidth(engine.device)
    results = [bench_kvtier(engine, ids, a.gen_tokens, bw)]
    if not a.no_hf:
        results.append(bench_hf(path, ids, a.gen_tokens, engine.device, DTYPES[engine.config.dtype], bw))
    if a.llama_cpp and path.suffix == ".gguf":
        r = bench_llama_cpp(path, ids, a.gen_tokens, torch.get_num_threads(), bw)
        if r is None:
            console.print("[yellow]llama-cpp-python is not installed; skipped[/]")
        else:
            results.append(r)
    table = Table(title=f"{engine.model_name} on {engine.device.type} "
                        f"({torch.get_num_threads()} threads), bandwidth {bw / 1e9:.1f} GB/s")
    for col in ("engine", "prompt", "gen", "TTFT ms", "prefill tok/s", "decode tok/s", "% BW bound"):
        table.add_column(col, justify="right")
    rows = []
    for r in results:
        row = (r.engine, str(r.prompt_tokens), str(r.gen_tokens), f"{r.ttft_s * 1000:.0f}",
               f"{r.prefill_tok_s:.0f}", f"{r.decode_tok_s:.1f}", f"{r.bw_pct:.0f}%")
        table.add_row(*row)
        rows.append(row)
    console.print(table)
    if a.out:
        with open(a.out, "a") as f:
            f.write(f"\n{table.title}\n\n| " + " | ".join(c.header for c in table.columns) + " |\n")
            f.write("|" + "---|" * len(table.columns) + "\n")
            for row in rows:
                f.write("| " + " | ".join(row) + " |\n")
    return 0
