"""Host->GPU page-swap bandwidth: scattered pages of a pinned host pool into a GPU pool,
through PagePool.copy_to (the path the runner uses), plus KV tokens per GiB by format."""

from __future__ import annotations

import random
import time

import torch
from rich.console import Console
from rich.table import Table

from kvtier.kv.formats import make_format
from kvtier.kv.pool import PagePool, kv_bytes_per_token

# Qwen3-8B KV geometry: 36 layers, 8 kv heads, head_dim 128.
LAYERS, KV_HEADS, HEAD_DIM = 36, 8, 128
FORMATS = ("bf16", "fp8", "int8", "k8v4", "int4")


def tokens_per_gib(fmt_name: str, layers: int = LAYERS, kv_heads: int = KV_HEADS,
                   head_dim: int = HEAD_DIM) -> int:
    """KV tokens one GiB of a pool holds (pages plus their share of the sink slots, bf16 compute)."""
    per_token = kv_bytes_per_token(make_format(fmt_name), kv_heads, head_dim, 16, torch.bfloat16)
    return int(2**30 // (per_token * layers))


def swap_bandwidth(fmt_name: str, pages: int, page_size: int, device: torch.device,
                   repeats: int = 3) -> float:
    """Bytes/s moving `pages` randomly scattered host pages to scattered GPU pages."""
    fmt = make_format(fmt_name)
    host = PagePool(fmt, LAYERS, pages * 2, KV_HEADS, page_size, HEAD_DIM, "cpu",
                    compute_dtype=torch.bfloat16, pin=device.type == "cuda")
    gpu = PagePool(fmt, LAYERS, pages * 2, KV_HEADS, page_size, HEAD_DIM, device,
                   compute_dtype=torch.bfloat16)
    rnd = random.Random(0)
    best = float("inf")
    for _ in range(repeats):
        src = rnd.sample(range(pages * 2), pages)
        dst = rnd.sample(range(pages * 2), pages)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        host.copy_to(gpu, src, dst)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return pages * host.bytes_per_page() / best


def run_swap_bench(pages: int, page_size: int, out: str | None) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    console = Console()
    t = Table("KV format", "tokens / GiB (Qwen3-8B)", f"host->{device.type} swap GB/s",
              title=f"{pages} scattered pages x {page_size} tokens, {LAYERS} layers")
    rows = []
    for name in FORMATS:
        row = (name, f"{tokens_per_gib(name):,}",
               f"{swap_bandwidth(name, pages, page_size, device) / 1e9:.1f}")
        t.add_row(*row)
        rows.append(row)
    console.print(t)
    if out:
        with open(out, "a") as f:
            f.write(f"\n{t.title} on {device.type}\n\n| KV format | tokens/GiB | swap GB/s |\n|---|---|---|\n")
            for row in rows:
                f.write("| " + " | ".join(row) + " |\n")
    return 0
