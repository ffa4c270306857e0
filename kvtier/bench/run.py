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

import httpx
import torch
from rich.console import Console
from rich.table import Table

from kvtier.config import EngineConfig

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
    gaps_ms: tuple[float, float, float] | None = None  # streamed rows: chunk gaps, median / p99 / longest

    @property
    def bw_pct(self) -> float:
        return 100 * self.decode_tok_s * self.weight_bytes / self.bandwidth


def measure_bandwidth(device: torch.device) -> float:
    """Achievable memory bandwidth (bytes/s): the better of a large copy (read + write bytes)
    and a large read-only reduction. Decode mostly reads, and on CPUs a read stream beats a copy."""
    n = PROBE_BYTES // 4
    a = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a)
    rates = []
    for op, moved in ((lambda: b.copy_(a), 2 * PROBE_BYTES), (lambda: a.sum(), PROBE_BYTES)):
        best = float("inf")
        for _ in range(5):
            _sync(device)
            t = time.perf_counter()
            op()
            _sync(device)
            best = min(best, time.perf_counter() - t)
        rates.append(moved / best)
    return max(rates)


def synthetic_ids(n: int, vocab: int, stride: int) -> list[int]:
    """A deterministic, non-repeating-looking token sequence inside the vocabulary."""
    span = max(vocab - 200, 1)  # keep clear of special tokens at both ends
    return [(i * stride + 7) % span + 100 % vocab for i in range(n)]


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(SEED_TEXT)
    return ids[:n]


def _timed_request(engine, ids: list[int], gen: int) -> tuple[float, float, int]:
    """Run one greedy request alone. Returns (ttft s, total s, generated tokens)."""
    from kvtier.engine.request import Request, SamplingParams

    engine.add_request(Request(uuid.uuid4().hex, ids, SamplingParams(temperature=0.0, max_tokens=gen,
                                                                      ignore_eos=True)))
    _sync(engine.device)
    t0 = time.perf_counter()
    ttft, n = None, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_ids and ttft is None:
                _sync(engine.device)
                ttft = time.perf_counter() - t0
            n += len(o.token_ids)
    _sync(engine.device)
    return ttft, time.perf_counter() - t0, n


def bench_kvtier(engine, ids: list[int], gen: int, bandwidth: float) -> Result:
    _timed_request(engine, ids[:16], 4)  # warm-up: kernels, allocator
    ttft, total, n = _timed_request(engine, ids, gen)
    wbytes = engine.model.decode_weight_bytes()
    return Result("kvtier", len(ids), n, ttft, len(ids) / ttft, (n - 1) / (total - ttft), wbytes, bandwidth)


def bench_prefix(engine, ids: list[int], new: int, console: Console) -> tuple[float, float]:
    """TTFT of a prompt whose first len(ids) tokens are cached vs the same prompt cold."""
    vocab = engine.model.spec.vocab_size
    tail = synthetic_ids(new, vocab, 7)  # new tokens after the shared history
    ttft_cold, _, _ = _timed_request(engine, ids + tail, 1)
    tail2 = synthetic_ids(new, vocab, 11)
    ttft_hit, _, _ = _timed_request(engine, ids + tail2, 1)
    console.print(f"prefix cache: {len(ids)} cached + {new} new tokens: TTFT cold "
                  f"{ttft_cold * 1000:.1f} ms, hit {ttft_hit * 1000:.1f} ms "
                  f"({ttft_cold / ttft_hit:.1f}x)")
    return ttft_cold, ttft_hit


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def load_hf(path: Path, dtype: torch.dtype):
    """HF transformers' own model for a GGUF file or an HF directory.

    For GGUF this is what `from_pretrained(dir, gguf_file=...)` does (transformers
    reads and dequantises the file itself), minus that path's hard requirement on
    `accelerate`, which kvtier does not need.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    model.tie_weights()
    return model


def bench_hf(path: Path, ids: list[int], gen: int, device: torch.device, dtype: torch.dtype,
             bandwidth: float) -> Result:
    """HF transformers loading the same checkpoint itself (GGUF dequantised by transformers)."""
    model = load_hf(path, dtype).to(device).eval()
    return bench_hf_model(model, ids, gen, device, bandwidth, f"hf-transformers {DTYPE_NAMES[dtype]}")


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def bench_hf_model(model, ids: list[int], gen: int, device: torch.device, bandwidth: float,
                   label: str = "hf-transformers") -> Result:
    """HF transformers on a built model: TTFT of one forward, then greedy generate of `gen` tokens."""
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        model.generate(x[:, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)
        _sync(device)
        t0 = time.perf_counter()
        model(x)
        _sync(device)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=gen, min_new_tokens=gen, do_sample=False, pad_token_id=0)
        _sync(device)
        total = time.perf_counter() - t0
    n = out.shape[1] - x.shape[1]
    wbytes = sum(t.numel() * t.element_size() for t in model.parameters())
    return Result(label, len(ids), n, ttft, len(ids) / ttft, (n - 1) / max(total - ttft, 1e-9), wbytes,
                  bandwidth)


def bench_llama_cpp(path: Path, ids: list[int], gen: int, threads: int, bandwidth: float,
                    console: Console) -> Result | None:
    """llama.cpp on the same GGUF and token ids, in a child process (kvtier/bench/llamacpp.py)."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("llama_cpp") is None:
        console.print("[yellow]llama-cpp-python is not installed; skipped[/]")
        return None
    job = json.dumps({"path": str(path), "ids": ids, "gen": gen, "threads": threads})
    proc = subprocess.run([sys.executable, "-m", "kvtier.bench.llamacpp"], input=job, capture_output=True,
                          text=True, timeout=LLAMA_CPP_TIMEOUT_S)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [""])[-1]
        console.print(f"[yellow]llama.cpp run failed (exit {proc.returncode}) {tail}; skipped[/]")
        return None
    r = json.loads(proc.stdout)
    return Result("llama.cpp", len(ids), gen, r["ttft_s"], len(ids) / r["ttft_s"], gen / r["decode_s"],
                  path.stat().st_size, bandwidth)


# A llama.cpp child that runs longer than this is killed.
LLAMA_CPP_TIMEOUT_S = 600


def _build(a: argparse.Namespace, config: EngineConfig):
    """(engine, hf model or path, ids) for a named/path model or a random-weight shape."""
    from kvtier.engine.build import DTYPES, build_engine, prepare_model, resolve_device
    from kvtier.engine.engine import Engine
    from kvtier.models.hub import resolve_model

    if a.shape:
        from kvtier.bench.shapes import random_model

        cfg = resolve_device(config)
        dev, dt = torch.device(cfg.device), DTYPES[cfg.dtype]
        hf, net = random_model(a.shape, dt, dev, cfg.offload_layers or 0)  # hf None for a 4-bit shape
        net = prepare_model(net, cfg)
        engine = Engine(net, None, cfg, model_name=f"random-{a.shape}")
        ids = synthetic_ids(a.prompt_tokens, net.spec.vocab_size, 31)
        return engine, hf, ids
    engine = build_engine(a.model, config, console=Console(stderr=True))
    return engine, Path(resolve_model(a.model)), prompt_ids(engine.tokenizer, a.prompt_tokens)


def run_bench(a: argparse.Namespace, config: EngineConfig) -> int:
    """config: the EngineConfig the command line asked for (kvtier/cli.py)."""
    from kvtier.engine.build import DTYPES

    console = Console()
    engine, ref, ids = _build(a, config)
    bw = measure_bandwidth(engine.device)
    if a.cached_tokens:
        vocab = engine.model.spec.vocab_size
        cold, hit = bench_prefix(engine, synthetic_ids(a.cached_tokens, vocab, 13), a.new_tokens, console)
        if a.out:
            with open(a.out, "a") as f:
                f.write(f"\n{engine.model_name} on {engine.device.type}: {a.cached_tokens} cached + "
                        f"{a.new_tokens} new tokens: TTFT cold {cold * 1000:.1f} ms, prefix hit "
                        f"{hit * 1000:.1f} ms ({cold / hit:.1f}x)\n")
        return 0
    results = [bench_kvtier(engine, ids, a.gen_tokens, bw)]
    if not a.no_hf and ref is not None:
        if isinstance(ref, Path):
            dtypes = [DTYPES[engine.config.dtype]]
            if engine.device.type == "cpu" and torch.float32 not in dtypes:
                dtypes.append(torch.float32)  # transformers' own CPU default, for reference
            for dt in dtypes:
                results.append(bench_hf(ref, ids, a.gen_tokens, engine.device, dt, bw))
        else:
            results.append(bench_hf_model(ref, ids, a.gen_tokens, engine.device, bw))
    if a.llama_cpp and isinstance(ref, Path) and ref.suffix == ".gguf":
        r = bench_llama_cpp(ref, ids, a.gen_tokens, torch.get_num_threads(), bw, console)
        if r is not None:
            results.append(r)
    title = _title(engine, bw)
    if a.serve and not a.shape:
        from kvtier.bench.serve import bench_serve

        wbytes = results[0].weight_bytes
        del engine  # the server child loads its own copy (GPU memory)
        _free_device_memory()
        ttft, tok_s, n, gaps = bench_serve(a, ids, a.gen_tokens)
        results.insert(1, Result("kvtier serve, streamed", len(ids), n, ttft, len(ids) / ttft, tok_s, wbytes, bw,
                                 gaps))
    if a.llama_server and isinstance(ref, Path) and ref.suffix == ".gguf":
        from kvtier.bench.serve import bench_llama_server

        try:
            ttft, tok_s, n, gaps = bench_llama_server(a.llama_server, str(ref), ids, a.gen_tokens,
                                                      a.threads or torch.get_num_threads())
            results.append(Result("llama-server, streamed", len(ids), n, ttft, len(ids) / ttft, tok_s,
                                  ref.stat().st_size, bw, gaps))
        except (RuntimeError, OSError, httpx.HTTPError) as e:
            console.print(f"[yellow]llama-server run failed ({e}); skipped[/]")
    _report(console, title, results, a.out)
    return 0


def _free_device_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _title(engine, bw: float) -> str:
    dev = torch.cuda.get_device_name() if engine.device.type == "cuda" else \
        f"cpu, {torch.get_num_threads()} threads"
    weights = engine.config.dtype + (", int8/int4 decode weights" if engine.config.decode_weights == "int8" else "")
    return f"{engine.model_name} ({weights}) on {dev}; memory bandwidth {bw / 1e9:.1f} GB/s"


def _report(console: Console, title: str, results: list[Result], out: str | None) -> None:
    table = Table(title=title)
    table.add_column("engine", no_wrap=True, min_width=max(len(r.engine) for r in results))
    cols = ("prompt", "gen", "TTFT ms", "prefill tok/s", "decode tok/s", "% BW bound")
    streamed = any(r.gaps_ms for r in results)
    if streamed:
        cols += ("token gap ms (median / p99 / max)",)
    for col in cols:
        table.add_column(col, justify="right")
    rows = []
    for r in results:
        row = (r.engine, str(r.prompt_tokens), str(r.gen_tokens), f"{r.ttft_s * 1000:.0f}",
               f"{r.prefill_tok_s:.0f}", f"{r.decode_tok_s:.1f}", f"{r.bw_pct:.0f}%")
        if streamed:
            row += ("{:.1f} / {:.1f} / {:.1f}".format(*r.gaps_ms) if r.gaps_ms else "",)
        table.add_row(*row)
        rows.append(row)
    console.print(table)
    if out:
        with open(out, "a") as f:
            f.write(f"\n{table.title}\n\n| " + " | ".join(c.header for c in table.columns) + " |\n")
            f.write("|" + "---|" * len(table.columns) + "\n")
            for row in rows:
                f.write("| " + " | ".join(row) + " |\n")
