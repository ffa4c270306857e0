"""GemLite (Triton, pip `gemlite`) against kvtier's own weight-only matmuls and bf16 F.linear.

    PYTHONPATH=. python3 tools/sweep_gemlite.py [--rows 1,4,16,32] [--groups 32,64,128]

For each Qwen3-8B weight shape and M rows of bf16 x: GPU time per call from CUDA-graph replay
(calls cycle through enough weight copies to leave L2), GB/s of the bytes a call reads and %
of the copy bandwidth measured in the same run, and max |y - ref| / rms(ref) against the fp32
dequantized weight. Variants: `kvtier` (wq_linear, group 32, ~4.5 / 8.5 bits a weight),
`gemlite gN` (A16W4 / A16W8 with asymmetric groups of N, our scale / min as GemLite's fma
mode), `bf16` (cuBLAS). GemLite autotunes on first call per (shape, M); that time is printed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvtier.bench.run import measure_bandwidth  # noqa: E402
from kvtier.kernels.wq_matmul import wq_linear  # noqa: E402
from kvtier.layers.qweight import quantize_rtn  # noqa: E402
from tools.sweep_wq import time_us  # noqa: E402  (one graph-replay timer for both sweeps)

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROTATE_BYTES = 256 * 2**20
CALLS = 20


def gemlite_linear(gemlite, w, bits: int, group: int):
    """Our QuantWeight (codes, scale, min) as a GemLite layer: W = q * scale + min, i.e. GemLite's
    (q - zero) * scale with zero = -min / scale in its fma mode."""
    from gemlite import DType, GemLiteLinear

    n, k = w.shape
    codes = w.codes()
    if bits == 8:
        codes = codes.to(torch.int16) + 128  # unsigned 0..255 for GemLite's 8-bit packing
        mins = -128.0 * w.scales.float() + (w.mins.float() if w.mins is not None else 0.0)
    else:
        mins = w.mins.float()
    scale = w.scales.float()
    zeros = (-mins / scale).to(torch.bfloat16)
    lin = GemLiteLinear(bits, group_size=group, in_features=k, out_features=n,
                        input_dtype=DType.BF16, output_dtype=DType.BF16)
    lin.pack(codes.to(torch.uint8), scale.to(torch.bfloat16), zeros, None)
    return lin


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,4,16,32")
    p.add_argument("--groups", default="32,64,128")
    p.add_argument("--bits", default="4,8")
    a = p.parse_args()
    rows = [int(x) for x in a.rows.split(",")]
    groups = [int(x) for x in a.groups.split(",")]
    torch.manual_seed(0)
    bw = measure_bandwidth(torch.device("cuda"))
    print(f"bandwidth {bw / 1e9:.0f} GB/s, {torch.cuda.get_device_name()}")
    try:
        import gemlite
        print(f"gemlite {getattr(gemlite, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        gemlite = None
        print(f"gemlite unavailable: {e}")
    totals: dict[tuple, float] = {}
    for bits in [int(b) for b in a.bits.split(",")]:
        for name, (n, k) in SHAPES.items():
            dense = 0.02 * torch.randn(n, k, device="cuda")
            variants: dict[str, tuple[list, int]] = {}
            ref_w = {}
            for g in sorted(set([32] + groups)):
                w = quantize_rtn(dense, bits, g)
                ref_w[g] = w.dequantize(torch.float32)
                wbytes = w.nbytes()
                copies = max(1, min(CALLS, math.ceil(ROTATE_BYTES / wbytes)))
                if g == 32:
                    ws = [w] + [quantize_rtn(dense, bits, g) for _ in range(copies - 1)]
                    variants["kvtier g32"] = (ws, wbytes)
                if gemlite is not None and g in groups:
                    try:
                        t0 = time.perf_counter()
                        lins = [gemlite_linear(gemlite, w, bits, g) for _ in range(copies)]
                        variants[f"gemlite g{g}"] = (lins, wbytes)
                        print(f"  pack gemlite g{g} {name}: {time.perf_counter() - t0:.1f} s")
                    except Exception as e:  # noqa: BLE001
                        print(f"  gemlite g{g} {name} failed to pack: {type(e).__name__}: {e}")
            wb = dense.to(torch.bfloat16)
            copies = max(1, min(CALLS, math.ceil(ROTATE_BYTES / (n * k * 2))))
            variants["bf16"] = ([wb] + [wb.clone() for _ in range(copies - 1)], n * k * 2)
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for vname, (objs, nbytes) in variants.items():
                    g = int(vname.split("g")[-1]) if "g" in vname.split()[-1] else 32
                    ref = x.float() @ (ref_w[g] if vname != "bf16" else wb.float()).t()
                    if vname.startswith("kvtier"):
                        fns = [lambda w=w: wq_linear(x, w) for w in objs]
                    elif vname.startswith("gemlite"):
                        fns = [lambda lin=lin: lin(x) for lin in objs]
                    else:
                        fns = [lambda w=w: F.linear(x, w) for w in objs]
                    try:
                        t0 = time.perf_counter()
                        y = fns[0]()
                        torch.cuda.synchronize()
                        first = time.perf_counter() - t0
                        err = ((y.float() - ref).abs().max() / ref.pow(2).mean().sqrt()).item()
                        us, _ = time_us(lambda i: fns[i % len(fns)](), CALLS)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {bits}b {name:8s} M={m:3d} {vname:12s} FAILED {type(e).__name__}: {e}")
                        continue
                    gbs = (nbytes + x.numel() * 2) / us / 1e3
                    totals[(bits, m, vname)] = totals.get((bits, m, vname), 0.0) + us
                    print(f"  {bits}b {name:8s} M={m:3d} {vname:12s} {us:8.1f} us {gbs:7.0f} GB/s "
                          f"{100 * gbs * 1e9 / bw:5.1f}%  err {err:.2e}  first {first:.1f} s")
    print("\nsum over the four shapes, us per layer's matmuls:")
    for (bits, m, vname), us in sorted(totals.items()):
        print(f"  {bits}b M={m:3d} {vname:12s} {us:8.1f} us")


if __name__ == "__main__":
    main()
