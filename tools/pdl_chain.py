"""GPU time of a Qwen3-8B-shaped decode chain without attention (36 layers of RMSNorm, qkv, o_proj
+ residual, RMSNorm, gate_up, SiLU, down + residual; random 4-bit and 8-bit weights, group 32),
captured in one CUDA graph, with programmatic dependent launch (kernels/pdl.py) off, on for every
kernel, and on for every kernel but the GEMV; each of the first two also with the GEMV's split-K
sums done by its last program (GemvConfig.fused_reduce); bit-equality of the outputs with the first.

    PYTHONPATH=. python3 tools/pdl_chain.py
"""
from dataclasses import replace

import torch

from kvtier.bench.run import measure_bandwidth
from kvtier.kernels import wq_matmul as wq
from kvtier.layers.qweight import quantize_rtn

LAYERS = 36
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def build(bits):
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(LAYERS):
        out.append({k: quantize_rtn(torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02, bits, 32)
                    for k, s in SHAPES.items()})
    return out


NORM = None


def chain(ws, x):
    from kvtier.kernels import fused
    for w in ws:
        y = wq.wq_linear(fused.rms_norm(x, NORM, 1e-6), w["qkv"])
        h = wq.wq_linear(y[:, :4096], w["o"], residual=x)
        g = wq.wq_linear(fused.rms_norm(h, NORM, 1e-6), w["gate_up"])
        x = wq.wq_linear(fused.silu_mul(g), w["down"], residual=h)
    return x


def nbytes(ws):
    return sum(t.numel() * t.element_size() for w in ws for q in w.values()
               for t in (q.qweight, q.scales) + ((q.mins,) if q.mins is not None else ()))


def timed(ws, x, pdl, reps=20):
    from kvtier.kernels import pdl as P
    P.ENABLED = not pdl.startswith("off")
    wq.GEMV_CONFIG = replace(wq.GEMV_CONFIG, pdl=pdl.startswith("all"), fused_reduce=pdl.endswith("fused-reduce"))
    chain(ws, x)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(ws, x)
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        y = chain(ws, x)
    gr.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        gr.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2], y.clone()


def main():
    bw = measure_bandwidth(torch.device("cuda"))
    print(f"bandwidth {bw / 1e9:.0f} GB/s")
    global NORM
    NORM = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    for bits in (4, 8):
        ws = build(bits)
        nb = nbytes(ws)
        for m in (1, 2):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            res = {}
            for pdl in ("off", "all", "no-gemv", "off-fused-reduce", "all-fused-reduce") * 2:
                ms, y = timed(ws, x, pdl)
                res.setdefault(pdl, []).append((ms, y))
            pct = lambda ms: 100 * nb / (ms * 1e-3) / bw
            ref = res["off"][0][1]
            row = [f"{k} {min(r[0] for r in v) * 1e3:.0f} us ({pct(min(r[0] for r in v)):.0f}%, equal "
                   f"{all(torch.equal(r[1], ref) for r in v)})" for k, v in res.items()]
            print(f"{bits}-bit M={m}: {nb / 1e9:.2f} GB, finite {bool(ref.isfinite().all())}: " + ", ".join(row), flush=True)
        del ws
        torch.cuda.empty_cache()


main()
