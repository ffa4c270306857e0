"""Where a retrieval decode step's time goes: a 12 GiB-like pool, k8v4 KV, a random int4 8B shape.

    PYTHONPATH=. python3 tools/profile_retrieval.py --cases 4096:262400,65536:262400

Each case is PROMPT:MAX_MODEL_LEN[:eager]: an engine with that max_model_len (the retrieval graph's
table width), a `--gpu-kv-mib` pool (1432 MiB: what the plan gives 8B-int4 under 12 GiB) and a host
tier, one prompt prefilled; then synced and unsynced decode step times, the step's kernels under
torch.profiler (us a step, calls a step, us a call), and with --host-side its CPU ops and a
cProfile of six steps. An
`eager` case also reports how many of each (layer 5 / 20, kv head) selection's pages the previous
step chose too (whether a GPU cache of selected host pages would hit).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import cprofile_steps, kernel_table, synced_steps_ms  # noqa: E402

from kvtier.bench.run import synthetic_ids  # noqa: E402
from kvtier.bench.shapes import random_model  # noqa: E402
from kvtier.config import CacheConfig, EngineConfig, RetrievalConfig  # noqa: E402
from kvtier.engine.engine import Engine  # noqa: E402
from kvtier.engine.request import Request, SamplingParams  # noqa: E402
from kvtier.layers.retrieval import RetrievalAttention  # noqa: E402


def overlap(sels: list, layer: int) -> None:
    s = [x for l_, x in sels if l_ == layer]
    got = []
    for x, y in zip(s, s[1:]):
        for h in range(x.shape[1]):
            a, b = set(x[0, h].tolist()) - {-1}, set(y[0, h].tolist()) - {-1}
            got.append(len(a & b) / max(1, len(b)))
    print(f"   layer {layer}: pages the previous step chose too, mean {sum(got) / max(1, len(got)):.3f} "
          f"over {len(got)} (step, kv head) pairs")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b-int4")
    p.add_argument("--cases", default="4096:262400,4096:4352,65536:262400,65536:262400:eager")
    p.add_argument("--gpu-kv-mib", type=int, default=1432)
    p.add_argument("--host-kv-mib", type=int, default=8000)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--selector", default="hybrid", help="a config.SELECTORS name")
    p.add_argument("--summary-bits", type=int, default=16, choices=(8, 16), help="--kvmem-summary-bits")
    p.add_argument("--host-side", action="store_true",
                   help="also the step's CPU ops (torch.profiler) and a cProfile of six steps")
    a = p.parse_args()
    _, net = random_model(a.shape, torch.bfloat16, torch.device("cuda"))
    for case in a.cases.split(","):
        parts = case.split(":")
        prompt, mml = int(parts[0]), int(parts[1])
        graphs = "off" if "eager" in parts else "auto"
        cfg = EngineConfig(device="cuda", dtype="bf16", cuda_graphs=graphs, max_model_len=mml, max_batch=2,
                           retrieval=RetrievalConfig(budget=a.budget, selector=a.selector,
                                                     summary_bits=a.summary_bits),
                           cache=CacheConfig(kv_dtype="k8v4", gpu_kv_mib=a.gpu_kv_mib, host_kv_mib=a.host_kv_mib))
        t = time.perf_counter()
        eng = Engine(net, None, cfg, model_name="p")
        print(f"\n=== prompt {prompt} max_model_len {mml} graphs {graphs}: engine built "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        eng.add_request(Request("r", synthetic_ids(prompt, net.spec.vocab_size, 31),
                                SamplingParams(max_tokens=200, ignore_eos=True)))
        t = time.perf_counter()
        while not any(o.token_ids for o in eng.step()):
            pass
        torch.cuda.synchronize()
        print(f"   prefill {time.perf_counter() - t:.2f} s", flush=True)
        sels: list = []
        orig = RetrievalAttention.select
        if graphs == "off":
            def rec(self, layer, q, sel, _o=orig):
                r = _o(self, layer, q, sel)
                if layer in (5, 20):
                    sels.append((layer, r[1].clone()))
                return r
            RetrievalAttention.select = rec
        for _ in range(3):
            eng.step()
        print("   synced step ms " + " ".join(f"{x:.2f}" for x in synced_steps_ms(eng, 8)))
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(16):
            eng.step()
        torch.cuda.synchronize()
        print(f"   unsynced {(time.perf_counter() - t) / 16 * 1e3:.2f} ms/step", flush=True)
        RetrievalAttention.select = orig
        for layer in (5, 20) if sels else ():
            overlap(sels, layer)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                eng.step()
            torch.cuda.synchronize()
        total, rows = kernel_table(prof, 4, rows=16)
        print(f"   GPU kernel time {total / 1e3:.3f} ms/step")
        print("\n".join(rows))
        if a.host_side:  # long: a device script that keeps only its tail loses the kernel table
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
            print(cprofile_steps(eng, 6, 22)[-4500:])
        del eng
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
