"""Per-kernel GPU time of decode steps (CUDA graphs on), per KV format, on a random-weight shape.

    python3 tools/profile_kernels.py --shape qwen3-8b --prompt 32768 --kvs bf16,int8,k8v4

One prompt is prefilled per format, then `--steps` decode steps run under torch.profiler; prints the
step's wall time, its summed kernel time and the top kernels (us a step, calls a step, us a call).
"""
import argparse
import collections
import gc
import time

import torch
from kvtier.bench.run import synthetic_ids
from kvtier.bench.shapes import random_model
from kvtier.config import CacheConfig, EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import Request, SamplingParams

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen3-8b")
p.add_argument("--prompt", type=int, default=32768)
p.add_argument("--kvs", default="bf16,int8,k8v4")
p.add_argument("--steps", type=int, default=8)
a = p.parse_args()
dev = torch.device("cuda")
hf, net = random_model(a.shape, torch.bfloat16, dev)
del hf
for kv in a.kvs.split(","):
    cfg = EngineConfig(device="cuda", dtype="bf16", prefill_chunk=8192, max_model_len=a.prompt + 256,
                       cache=CacheConfig(kv_dtype=kv, gpu_kv_mib=12000))
    eng = Engine(net, None, cfg, model_name="p")
    ids = synthetic_ids(a.prompt, net.spec.vocab_size, 31)
    eng.add_request(Request("r", ids, SamplingParams(max_tokens=10 + 3 * a.steps, ignore_eos=True)))
    for _ in range(a.prompt // 8192 + 6):
        eng.step()
    torch.cuda.synchronize()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with prof:
        for _ in range(a.steps):
            eng.step()
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / a.steps * 1e3
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = e.name[:70]
            agg[k][0] += 1
            agg[k][1] += e.device_time
    tot = sum(v[1] for v in agg.values()) / a.steps
    print(f"\n=== {a.shape} kv={kv} prompt={a.prompt}: wall {wall:.3f} ms/step, GPU kernels {tot/1e3:.3f} ms/step")
    for k, (n, us) in sorted(agg.items(), key=lambda kv_: -kv_[1][1])[:18]:
        print(f"  {us / a.steps:9.1f} us/step  {n / a.steps:6.1f}/step  {us / n:7.2f} us/call  {k}")
    del eng
    gc.collect(); torch.cuda.empty_cache()
