"""Per-kernel GPU time of decode steps (CUDA graphs on), per KV format, on a random-weight shape.

    python3 tools/profile_kernels.py --shape qwen3-8b --prompt 32768 --kvs bf16,int8,k8v4

One prompt is prefilled per format, then `--steps` decode steps run under torch.profiler; prints the
step's wall time, its summed kernel time and the top kernels (us a step, calls a step, us a call).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from gpu_timing import kernel_table  # tools/, run as a script
from kvtier.bench.run import synthetic_ids
from kvtier.bench.shapes import random_model
from kvtier.config import CacheConfig, EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import Request, SamplingParams


def profile_format(net: torch.nn.Module, kv: str, prompt: int, steps: int) -> None:
    cfg = EngineConfig(device="cuda", dtype="bf16", prefill_chunk=8192, max_model_len=prompt + 256,
                       cache=CacheConfig(kv_dtype=kv, gpu_kv_mib=12000))
    eng = Engine(net, None, cfg, model_name="p")
    eng.add_request(Request("r", synthetic_ids(prompt, net.spec.vocab_size, 31),
                            SamplingParams(max_tokens=10 + 3 * steps, ignore_eos=True)))
    for _ in range(prompt // 8192 + 6):  # the prefill chunks and a few decode steps (graphs captured)
        eng.step()
    torch.cuda.synchronize()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps * 1e3
    total, rows = kernel_table(prof, steps, width=70)
    print(f"\n=== kv={kv} prompt={prompt}: wall {wall:.3f} ms a step, GPU kernels {total / 1e3:.3f} ms a step")
    print("\n".join(rows))
    del eng
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--prompt", type=int, default=32768)
    p.add_argument("--kvs", default="bf16,int8,k8v4")
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    hf, net = random_model(a.shape, torch.bfloat16, torch.device("cuda"))
    del hf
    for kv in a.kvs.split(","):
        profile_format(net, kv, a.prompt, a.steps)


if __name__ == "__main__":
    main()
