"""Time one decode pass over a real model's CPU weight matrices alone (every VNNIWeight in layer
order, one activation row each), so the weights come from DRAM as in a decode step, with nothing
else in the step: how near the matmul kernel alone gets to the box's read bandwidth.

    python3 tools/cpu_weight_stream.py -m qwen2.5-coder-1.5b [--passes 7] [--threads 2]

Prints the median pass (bytes, ms, GB/s), then the time per kind of matrix, and for scale a plain
read (torch sum) of 1 GiB with the same threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvtier.config import EngineConfig
from kvtier.engine.build import build_engine
from kvtier.layers.qlinear import VNNIWeight


def _nbytes(w: VNNIWeight) -> int:
    return sum(b.numel() * b.element_size() for b in (w.codes, w.hbits, w.sm) if b is not None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", "-m", default="qwen2.5-coder-1.5b")
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    eng = build_engine(a.model, EngineConfig(device="cpu"), show_progress=False)
    # the matmuls of a decode step (a token-embedding table in this layout is only looked up)
    weights = [(n, m) for n, m in eng.model.named_modules() if isinstance(m, VNNIWeight) and "embed" not in n]
    if not weights:
        raise SystemExit("no VNNIWeight matrices: this CPU lacks AVX512-VNNI, or the model loads dense")
    xs = [torch.randn(1, m.shape[1], dtype=torch.bfloat16) for _, m in weights]
    total = sum(_nbytes(m) for _, m in weights)
    passes, per_kind = [], {}
    for _ in range(a.passes):
        t0 = time.perf_counter()
        for (name, m), x in zip(weights, xs):
            t = time.perf_counter()
            m.gemv(x)
            kind = (m.bits, name.split(".")[-2] if "." in name else name)
            per_kind.setdefault(kind, [0, []])
            per_kind[kind][1].append(time.perf_counter() - t)
        passes.append(time.perf_counter() - t0)
    dt = statistics.median(passes)
    print(f"{a.model}: {len(weights)} matrices, {total / 1e6:.0f} MB a pass, median {dt * 1e3:.1f} ms "
          f"= {total / dt / 1e9:.1f} GB/s ({a.threads} threads)")
    for (name, m) in weights:
        per_kind[(m.bits, name.split(".")[-2] if "." in name else name)][0] += _nbytes(m)
    for (bits, kind), (nbytes, times) in sorted(per_kind.items(), key=lambda kv: -sum(kv[1][1])):
        t = sum(times) / a.passes
        print(f"  {kind:>10} {bits}-bit  {nbytes / 1e6:6.0f} MB  {t * 1e3:6.1f} ms  {nbytes / t / 1e9:5.1f} GB/s")
    x = torch.randn(2**28)
    x.sum()
    t = time.perf_counter()
    x.sum()
    print(f"plain read (torch sum of 1 GiB fp32): {x.numel() * 4 / (time.perf_counter() - t) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
