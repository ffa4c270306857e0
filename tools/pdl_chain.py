"""GPU time of a Qwen3-8B-shaped decode chain without attention (36 layers of RMSNorm, qkv, o_proj
+ residual, RMSNorm, gate_up, SiLU, down + residual; random 4-bit and 8-bit weights, group 32),
captured in one CUDA graph, with programmatic dependent launch (kernels/pdl.py) off, on for every
kernel, and on for every kernel but the GEMV; bit-equality of the outputs with the first.
Each variant is timed twice (gpu_timing.replay_us: the mean of 20 replays), the better printed.

    PYTHONPATH=. python3 tools/pdl_chain.py
"""
from dataclasses import replace

import torch

from gpu_timing import replay_us  # tools/, run as a script
from sweep_wq import SHAPES
from kvtier.bench.run import measure_bandwidth
from kvtier.kernels import fused, pdl
from kvtier.kernels import wq_matmul as wq
from kvtier.layers.qweight import quantize_rtn

LAYERS = 36
LAYER_SHAPES = {name: SHAPES[name] for name in ("qkv", "o_proj", "gate_up", "down")}
# the chain's variants: PDL for every kernel, none, or all but the GEMV
VARIANTS = ("off", "all", "no-gemv")


def build(bits):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [{k: quantize_rtn(torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02, bits, 32)
             for k, s in LAYER_SHAPES.items()} for _ in range(LAYERS)]


def chain(ws, norm, x):
    for w in ws:
        y = wq.wq_linear(fused.rms_norm(x, norm, 1e-6), w["qkv"])
        h = wq.wq_linear(y[:, :4096], w["o_proj"], residual=x)
        g = wq.wq_linear(fused.rms_norm(h, norm, 1e-6), w["gate_up"])
        x = wq.wq_linear(fused.silu_mul(g), w["down"], residual=h)
    return x


def timed(ws, norm, x, variant):
    """(us a replay of the chain in one CUDA graph, its output) with `variant`'s launches."""
    pdl.ENABLED = not variant.startswith("off")
    wq.GEMV_CONFIG = replace(wq.GEMV_CONFIG, pdl=variant.startswith("all"))
    return replay_us(lambda: chain(ws, norm, x), calls=1, reps=20), chain(ws, norm, x)


def main():
    bw = measure_bandwidth(torch.device("cuda"))
    print(f"bandwidth {bw / 1e9:.0f} GB/s")
    norm = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    for bits in (4, 8):
        ws = build(bits)
        nb = sum(q.nbytes() for w in ws for q in w.values())
        for m in (1, 2):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            res = {}
            for variant in VARIANTS * 2:
                res.setdefault(variant, []).append(timed(ws, norm, x, variant))
            ref = res["off"][0][1]
            row = []
            for k, v in res.items():
                us = min(t for t, _ in v)
                row.append(f"{k} {us:.0f} us ({100 * nb / (us * 1e-6) / bw:.0f}%, equal "
                           f"{all(torch.equal(y, ref) for _, y in v)})")
            print(f"{bits}-bit M={m}: {nb / 1e9:.2f} GB, finite {bool(ref.isfinite().all())}: " + ", ".join(row),
                  flush=True)
        del ws
        torch.cuda.empty_cache()


main()
