"""Profile one prefill and a few decode steps of a random-weight shape on CUDA (torch.profiler).

    python3 tools/profile_step.py --shape qwen3-8b --prompt 1024 [--graphs off] [--backend dense]

Prints step wall times and the top CUDA kernels / CPU ops of a prefill step and of decode steps.
"""

from __future__ import annotations

import argparse
import time

import torch

from gpu_timing import cprofile_steps  # tools/, run as a script
from kvtier.bench.run import synthetic_ids
from kvtier.bench.shapes import random_model
from kvtier.config import CacheConfig, EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import Request, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--graphs", default="auto")
    p.add_argument("--backend", default="auto")
    p.add_argument("--kv", default="bf16")
    p.add_argument("--chunk", type=int, default=512)
    a = p.parse_args()
    dev = torch.device("cuda")
    hf, net = random_model(a.shape, torch.bfloat16, dev)  # int4 / int8 shapes: QuantWeights, no HF
    del hf
    cfg = EngineConfig(device="cuda", dtype="bf16", attention_backend=a.backend, cuda_graphs=a.graphs,
                       prefill_chunk=a.chunk, max_model_len=a.prompt + 256,
                       cache=CacheConfig(kv_dtype=a.kv, gpu_kv_mib=8192))
    eng = Engine(net, None, cfg, model_name="p")
    for rep in range(2):
        ids = synthetic_ids(a.prompt, net.spec.vocab_size, 31 + 2 * rep)  # no prefix-cache hit
        eng.add_request(Request(f"r{rep}", ids, SamplingParams(max_tokens=24, ignore_eos=True)))
        times = []
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA]) if rep else None
        if prof:
            prof.__enter__()
        while eng.has_unfinished():
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        if prof:
            prof.__exit__(None, None, None)
        print(f"run {rep}: step ms " + " ".join(f"{x * 1e3:.1f}" for x in times))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    eng.add_request(Request("r9", synthetic_ids(a.prompt, net.spec.vocab_size, 91),
                            SamplingParams(max_tokens=40, ignore_eos=True)))
    for _ in range(4):
        eng.step()  # prefill + first decodes
    print(cprofile_steps(eng, 20, 12))
    eng.add_request(Request("r10", synthetic_ids(a.prompt, net.spec.vocab_size, 97),
                            SamplingParams(max_tokens=2, ignore_eos=True)))
    pr = cProfile.Profile()
    pr.enable()
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    pr.disable()
    print(f"prefill of {a.prompt} tokens (+1 decode): {(time.perf_counter() - t) * 1e3:.1f} ms")
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    g = eng.runner.graphs
    if g is not None:  # pure replay time of the batch-1 graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            g.replay(1, 1)
        end.record()
        torch.cuda.synchronize()
        print(f"graph replay: {start.elapsed_time(end) / 50:.3f} ms per decode step")


if __name__ == "__main__":
    main()
