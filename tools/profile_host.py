"""Profile decode steps of a long sequence on CUDA, all in the GPU pool or with its head in the host tier.

    python3 tools/profile_host.py --shape qwen3-8b-int4 --prompt 16384 --kv k8v4

For each variant (GPU pool eager; host tier dense; host tier retrieval): synced wall ms of decode
steps and the top CUDA kernels / CPU ops of a few of them (torch.profiler).
"""

from __future__ import annotations

import argparse

import torch

from gpu_timing import synced_steps_ms  # tools/, run as a script
from kvtier.bench.run import synthetic_ids
from kvtier.bench.shapes import random_model
from kvtier.config import CacheConfig, EngineConfig, RetrievalConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import Request, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b-int4")
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--kv", default="k8v4")
    p.add_argument("--gpu-kv-mib", type=int, default=512)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--rows", type=int, default=12)
    a = p.parse_args()
    dev = torch.device("cuda")
    _, net = random_model(a.shape, torch.bfloat16, dev)
    variants = [("gpu pool, eager", dict(gpu_kv_mib=0), 0, "off"),
                ("host tier, dense", dict(gpu_kv_mib=a.gpu_kv_mib, host_kv_mib=60000), 0, "auto"),
                ("host tier, retrieval", dict(gpu_kv_mib=a.gpu_kv_mib, host_kv_mib=60000), a.budget, "auto")]
    for name, cache, budget, graphs in variants:
        cfg = EngineConfig(device="cuda", dtype="bf16", cuda_graphs=graphs, max_model_len=a.prompt + 256,
                           retrieval=RetrievalConfig(budget=budget, sink=16, window=256),
                           cache=CacheConfig(kv_dtype=a.kv, **{k: v for k, v in cache.items() if v}))
        eng = Engine(net, None, cfg, model_name="p")
        eng.add_request(Request("r", synthetic_ids(a.prompt, net.spec.vocab_size, 31),
                                SamplingParams(max_tokens=40, ignore_eos=True)))
        while not any(o.token_ids for o in eng.step()):  # the prefill chunks, up to the first token
            pass
        for _ in range(3):  # past the prefill, warm
            eng.step()
        times = synced_steps_ms(eng, 8)
        print(f"== {name}: decode step ms " + " ".join(f"{x:.1f}" for x in times), flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                eng.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
