"""Timing helpers shared by the GPU sweep and profile tools (CUDA only).

- replay_us(fn): GPU time of one call of fn, from `calls` calls captured in one CUDA graph and
  replayed `reps` times (no launch overhead, no host work);
- synced_steps_ms(engine, n): wall ms of n engine steps, each between two synchronizations;
- cprofile_steps(engine, n, lines): cProfile of n engine steps, top `lines` by cumulative time;
- kernel_table(prof, steps): a torch.profiler run's CUDA kernels over `steps` steps: the total
  us a step and the top rows (us a step, calls a step, us a call, name).
"""

from __future__ import annotations

import collections
import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch


def replay_us(fn: Callable[[], object], calls: int = 20, reps: int = 5) -> float:
    for _ in range(3):  # compile and warm
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * calls)


def synced_steps_ms(engine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def cprofile_steps(engine, n: int, lines: int = 12) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(lines)
    return s.getvalue()


def kernel_table(prof, steps: int, rows: int = 18, width: int = 90) -> tuple[float, list[str]]:
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name[:width]][0] += 1
            agg[e.name[:width]][1] += e.device_time
    total = sum(v[1] for v in agg.values()) / steps
    top = sorted(agg.items(), key=lambda item: -item[1][1])[:rows]
    return total, [f"  {us / steps:9.1f} us/step  {n / steps:6.1f}/step  {us / n:7.2f} us/call  {name}"
                   for name, (n, us) in top]
