"""GPU time of the weight-only quantized matmul (kvtier/kernels/wq_matmul.py) per variant, with baselines.

    PYTHONPATH=. python3 tools/sweep_wq.py            # decode sweep, M 1..32, 5 shapes, ~150 s on an H200
    PYTHONPATH=. python3 tools/sweep_wq.py --quick    # defaults and baselines on 3 shapes, M 1/32/2048
    PYTHONPATH=. python3 tools/sweep_wq.py --all      # + every old skinny / GEMM switch (longer)

For each Qwen3-8B weight (N, K), 4-bit (RTN with mins, group 32: ~4.5 bits a weight) and 8-bit
(symmetric, group 32: 8.5 bits) and M rows of bf16 x: `calls` calls captured in one CUDA graph
and replayed (no launch overhead), cycling through enough copies of the weight that they do not
fit in L2. Variants: our kernels (wq_linear's default dispatch "default"; "old default", the
dispatch before the half2 kernel: skinny "fma" at M = 1, "dot" above; the half2 CUDA-core "gemv"
for M <= 8 with its rows per program, K split, prefetch and warps moved one at a time; with
--all the old skinny-kernel switches, GEMM tiles, dequantize+cuBLAS) and torch's baselines (bf16 F.linear on the dense weight, tinygemm
`_weight_int4pack_mm`, `_weight_int8pack_mm` with per-channel scales). Each row prints us per
call, GB/s of the bytes it reads (codes + scales + mins + x; the dense / tinygemm / int8 weight
for baselines) and that as % of the measured bandwidth (TFLOP/s instead for M >= 256), and max
|y - reference| / rms(reference). A failing variant prints its error and the sweep goes on.
The end: tables per (bits, M), and the best variant per regime by total time over the shapes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvtier.bench.run import measure_bandwidth  # noqa: E402
from kvtier.kernels import wq_matmul as wq  # noqa: E402
from kvtier.layers.qweight import QuantWeight, quantize_rtn  # noqa: E402

DEVICE = "cuda"
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
ROWS = (1, 2, 4, 8, 16, 32)
QUICK_SHAPES = ("o_proj", "gate_up", "down")
QUICK_ROWS = (1, 32, 2048)
GROUP = 32
WEIGHT_STD = 0.02
# Calls per graph: decode-sized calls are microseconds; prefill-sized ones milliseconds.
CALLS_SMALL, CALLS_LARGE = 20, 3
REPLAYS = 5
# Weight copies cycled through so that one graph's calls read at least this much (H200 L2: 50 MB).
ROTATE_BYTES = 256 * 2**20
# Rows from which a result is compute-bound: print TFLOP/s rather than % of bandwidth.
COMPUTE_ROWS = 256
# After this long, only the defaults and baselines run (the whole sweep must stay ~150 s).
TIME_BUDGET_S = 130
# Rows of x up to which the gemv default is timed (GEMV_MAX_M and one step past it); its
# one-change variants at M = 1 and 4 only (time budget).
GEMV_SWEEP_MAX_M = 8
# tinygemm: inner K tiles of its packed layout (2, 4 or 8; 8 as gpt-fast / torchao use).
INNER_K_TILES = 8
TINYGEMM_BIAS = 8  # tinygemm dequantizes (q - 8) * scale + zero


# ---------------------------------------------------------------- baselines' weight formats

def to_tinygemm(w: QuantWeight, high_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A 4-bit QuantWeight as torch's CUDA tinygemm wants it: (packed int32 from
    `_convert_weight_to_int4pack`, bf16 scales_and_zeros [K / group, N, 2]).

    Same weight: (q - 8) * scale + zero = q * scale + min with zero = min + 8 * scale (bf16-rounded,
    so not bit-exact). high_first: even columns in the high nibble (torchao's packing); our
    layout has them in the low one.
    """
    if w.bits != 4:
        raise ValueError("tinygemm takes 4-bit weights only")
    codes = w.codes().to(torch.uint8)  # [N, K]
    lo, hi = (codes[:, 1::2], codes[:, 0::2]) if high_first else (codes[:, 0::2], codes[:, 1::2])
    packed = torch._convert_weight_to_int4pack((lo | (hi << 4)).contiguous(), INNER_K_TILES)
    scale = w.scales.float()
    mins = w.mins.float() if w.mins is not None else torch.zeros_like(scale)
    sz = torch.stack((scale, mins + TINYGEMM_BIAS * scale), dim=-1)  # [N, K / group, 2]
    return packed, sz.transpose(0, 1).contiguous().to(torch.bfloat16)


def _copy(w: QuantWeight) -> QuantWeight:
    keep = (lambda t: None if t is None else t.clone())
    return QuantWeight(w.bits, w.group, w.qweight.clone(), w.scales.clone(), keep(w.mins))


@dataclass
class Subject:
    """One weight (N, K, bits) in every format a variant reads, each in `copies` copies."""

    n: int
    k: int
    bits: int
    qws: list[QuantWeight]
    w32: torch.Tensor  # fp32 dequantized [N, K]: the reference
    cache: dict[str, list] = field(default_factory=dict)

    @classmethod
    def make(cls, n: int, k: int, bits: int, seed: int) -> "Subject":
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        w = quantize_rtn(WEIGHT_STD * torch.randn(n, k, device=DEVICE, generator=g), bits, GROUP)
        copies = max(1, min(CALLS_SMALL, math.ceil(ROTATE_BYTES / w.nbytes())))
        return cls(n, k, bits, [w] + [_copy(w) for _ in range(copies - 1)], w.dequantize(torch.float32))

    def formats(self, name: str, convert: Callable[[QuantWeight], object], elem_bytes: int) -> list:
        """`convert` of each copy, as many copies as ROTATE_BYTES needs at elem_bytes per weight."""
        if name not in self.cache:
            copies = max(1, min(len(self.qws), math.ceil(ROTATE_BYTES / (self.n * self.k * elem_bytes))))
            self.cache[name] = [convert(w) for w in self.qws[:copies]]
        return self.cache[name]


# A variant: (subject, x) -> (call(i) using copy i, bytes one call reads, its own reference or None).
Make = Callable[[Subject, torch.Tensor], tuple[Callable[[int], torch.Tensor], int, torch.Tensor | None]]


def _qbytes(s: Subject, x: torch.Tensor) -> int:
    return s.qws[0].nbytes() + x.numel() * x.element_size()


def ours(fn: Callable[[torch.Tensor, QuantWeight], torch.Tensor]) -> Make:
    def make(s: Subject, x: torch.Tensor):  # noqa: ANN202
        return (lambda i: fn(x, s.qws[i % len(s.qws)])), _qbytes(s, x), None
    return make


def torch_bf16(s: Subject, x: torch.Tensor):  # noqa: ANN201
    ws = s.formats("bf16", lambda w: w.dequantize(torch.bfloat16), 2)
    return (lambda i: F.linear(x, ws[i % len(ws)])), s.n * s.k * 2 + x.numel() * 2, None


def tinygemm(s: Subject, x: torch.Tensor):  # noqa: ANN201
    """torch._weight_int4pack_mm; the nibble order that matches the reference (checked on copy 0)."""
    if "tiny" not in s.cache:
        probe = x[:1]
        for high_first in (True, False):
            packed, sz = to_tinygemm(s.qws[0], high_first)
            got = torch._weight_int4pack_mm(probe, packed, GROUP, sz).float()
            want = probe.float() @ s.w32.t()
            if float((got - want).abs().max()) <= 0.05 * float(want.pow(2).mean().sqrt()):
                break
        else:
            raise RuntimeError("neither nibble order matches the reference")
        s.cache["tiny_order"] = ["high-first" if high_first else "low-first"]
        s.formats("tiny", lambda w: to_tinygemm(w, high_first), 0.5)
    ws = s.cache["tiny"]
    nbytes = s.n * s.k // 2 + s.n * (s.k // GROUP) * 4 + x.numel() * 2
    return (lambda i: torch._weight_int4pack_mm(x, ws[i % len(ws)][0], GROUP, ws[i % len(ws)][1])), nbytes, None


def int8pack(s: Subject, x: torch.Tensor):  # noqa: ANN201
    """torch._weight_int8pack_mm: per-channel scales only (the first group's), so its own reference."""
    ws = s.formats("int8", lambda w: (w.qweight, w.scales[:, 0].to(x.dtype).contiguous()), 1)
    q, sc = ws[0]
    ref = x.float() @ (q.float() * sc.float()[:, None]).t()
    return ((lambda i: torch._weight_int8pack_mm(x, ws[i % len(ws)][0], ws[i % len(ws)][1])),
            s.n * s.k + s.n * 2 + x.numel() * 2, ref)


# ---------------------------------------------------------------- variants

def _diff(cfg: object, base: object) -> str:
    """The fields of a config that differ from its base, short."""
    short = {"block_n": "bn", "block_k": "bk", "block_m": "bm", "num_warps": "w", "num_stages": "st",
             "group_m": "gm", "split_k": "split"}
    out = []
    for f in fields(cfg):
        a, b = getattr(cfg, f.name), getattr(base, f.name)
        if a != b:
            if f.name in short:
                out.append(f"{short[f.name]}{a}")
            else:
                out.append(("+" if a else "-") + f.name if isinstance(a, bool) else f"{f.name}={a}")
    return " ".join(out)


def skinny_variants(base: wq.SkinnyConfig, label: str, quick: bool) -> dict[str, wq.SkinnyConfig]:
    """base, then one change at a time: tiles, warps, prefetch, code loads and conversion, split-K."""
    out = {label: base}
    if quick:
        return out
    bn, bk = base.block_n, base.block_k
    changes = [dict(block_n=bn // 2), dict(block_n=bn * 2), dict(block_k=bk * 2), dict(block_k=bk // 2),
               dict(num_warps=8), dict(prefetch=not base.prefetch), dict(words=not base.words), dict(split_k=1)]
    if base.use_dot:  # x^T feeds tl.dot: Triton's pipeliner streams it num_stages deep
        changes += [dict(num_stages=2), dict(num_stages=4), dict(cvt="magic"), dict(cvt="cvt"),
                    dict(group_scale=True, cvt="magic")]  # ("unit" codes are inexact in a bf16 dot)
    else:
        changes += [dict(cvt="magic"), dict(cvt="cvt"), dict(group_scale=False)]
    for ch in changes:
        cfg = replace(base, **ch)
        out[f"{label} {_diff(cfg, base)}"] = cfg
    return out


def gemm_variants(quick: bool) -> dict[str, wq.GemmConfig]:
    base = wq.GEMM_CONFIG
    out = {"gemm": base}
    if quick:
        return out
    for ch in (dict(block_n=256), dict(block_m=64, num_warps=4), dict(block_k=128), dict(num_stages=4),
               dict(block_m=64, block_n=64, num_warps=4), dict(words=True), dict(cvt="magic"), dict(cvt="cvt")):
        cfg = replace(base, **ch)
        out[f"gemm {_diff(cfg, base)}"] = cfg
    return out


def gemv_variants(quick: bool) -> dict[str, wq.GemvConfig]:
    """The half2 kernel's default, then one change at a time (rows per program, K split, prefetch, warps)."""
    base = wq.GEMV_CONFIG
    out = {"gemv": base}
    if quick:
        return out
    for ch in (dict(block_n=16), dict(block_n=64), dict(chunks=1), dict(chunks=8), dict(prefetch=False),
               dict(num_warps=8), dict(vector_x=False), dict(vector_x=False, chunks=1)):
        cfg = replace(base, **ch)
        out[f"gemv {_diff(cfg, base)}"] = cfg
    return out


def old_default(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """wq_linear's dispatch for M <= SKINNY_MAX_M before wq_gemv (skinny fma at M = 1, dot above)."""
    return wq.wq_skinny(x, w, cfg=wq.FMA_CONFIG if x.shape[0] <= wq.FMA_MAX_M else wq.DOT_CONFIG)


def variants(bits: int, m: int, quick: bool, every: bool) -> dict[str, Make]:
    out: dict[str, Make] = {"default": ours(wq.wq_linear)}
    if m <= wq.SKINNY_MAX_M:
        out["old default"] = ours(old_default)
    if m <= GEMV_SWEEP_MAX_M:
        for name, cfg in gemv_variants(quick or m not in (1, 4)).items():
            out[name] = ours(lambda x, w, cfg=cfg: wq.wq_gemv(x, w, cfg=cfg))
    if m <= wq.SKINNY_MAX_M and every:
        cfgs = {}
        if m <= wq.MAX_FMA_BLOCK_M:  # the CUDA-core path takes one row of x per program
            cfgs.update(skinny_variants(wq.FMA_CONFIG, "fma", quick))
        cfgs.update(skinny_variants(wq.DOT_CONFIG, "dot", quick or m not in (1, 32)))
        for name, cfg in cfgs.items():
            out[name] = ours(lambda x, w, cfg=cfg: wq.wq_skinny(x, w, cfg=cfg))
    if m >= 16 and (every or m >= COMPUTE_ROWS):
        for name, cfg in gemm_variants(quick or m < COMPUTE_ROWS).items():
            out[name] = ours(lambda x, w, cfg=cfg: wq.wq_gemm(x, w, cfg=cfg))
        out["dequant+mm"] = ours(wq.wq_dequant_matmul)
    out["torch bf16"] = torch_bf16
    out["tinygemm" if bits == 4 else "int8pack"] = tinygemm if bits == 4 else int8pack
    return out


BASELINES = ("torch bf16", "tinygemm", "int8pack")


# ---------------------------------------------------------------- timing

def time_us(call: Callable[[int], torch.Tensor], calls: int) -> tuple[float, str]:
    """us per call: `calls` calls in one CUDA graph, replayed; eager events if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                call(i)
        run, how = graph.replay, ""
    except RuntimeError:  # not capturable: time eagerly (launch overhead included)
        torch.cuda.synchronize()

        def run() -> None:
            for i in range(calls):
                call(i)
        how = " (eager)"
    run()
    start.record()
    for _ in range(REPLAYS):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * calls), how


@dataclass
class Result:
    us: float
    nbytes: int
    flops: float
    err: float
    how: str = ""


def measure(make: Make, s: Subject, x: torch.Tensor, ref: torch.Tensor) -> Result:
    call, nbytes, own_ref = make(s, x)
    y = call(0).float()
    want = own_ref if own_ref is not None else ref
    err = float((y - want).abs().max()) / float(want.pow(2).mean().sqrt())
    us, how = time_us(call, CALLS_SMALL if x.shape[0] < COMPUTE_ROWS else CALLS_LARGE)
    return Result(us, nbytes, 2.0 * x.shape[0] * s.n * s.k, err, how)


def run_one(make: Make, s: Subject, x: torch.Tensor, ref: torch.Tensor, label: str, bw: float) -> Result | str:
    """measure(), printed as it comes; a failure is printed and returned as a short string."""
    try:
        r = measure(make, s, x, ref)
    except Exception as e:  # noqa: BLE001 (a variant that does not compile or run)
        print(f"{label} {type(e).__name__}: {str(e)[:300]}", flush=True)
        return f"failed {type(e).__name__}"
    print(f"{label} {cell(r, x.shape[0], bw)}  err {r.err:.1e}{r.how}", flush=True)
    return r


def cell(r: Result | str, m: int, bw: float) -> str:
    if isinstance(r, str):
        return f"{r[:18]:>18}"
    rate = f"{r.flops / r.us / 1e6:5.0f}TF" if m >= COMPUTE_ROWS else f"{100 * r.nbytes / (r.us * 1e-6) / bw:4.0f}%BW"
    return f"{r.us:8.1f}us {rate}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="defaults and baselines, 3 shapes, M 1/32/2048")
    p.add_argument("--all", action="store_true", help="also every old skinny-kernel switch and GEMM tile")
    p.add_argument("--bits", default="4,8", help="comma-separated: 4, 8")
    args = p.parse_args()
    t0 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = measure_bandwidth(torch.device(DEVICE))
    print(f"{torch.cuda.get_device_name(0)}: {sms} SMs, measured bandwidth {bw / 1e9:.0f} GB/s; "
          f"defaults: FMA_MAX_M={wq.FMA_MAX_M} SKINNY_MAX_M={wq.SKINNY_MAX_M} DEQUANT_MIN_M={wq.DEQUANT_MIN_M}\n"
          f"GEMV_MAX_M={wq.GEMV_MAX_M}\n  gemv {wq.GEMV_CONFIG}\n  fma {wq.FMA_CONFIG}\n  dot {wq.DOT_CONFIG}\n"
          f"  gemm {wq.GEMM_CONFIG}", flush=True)
    shapes = QUICK_SHAPES if args.quick else tuple(SHAPES)
    rows = QUICK_ROWS if args.quick else ROWS
    bits_list = [int(b) for b in args.bits.split(",")]
    subjects = {(shape, bits): Subject.make(*SHAPES[shape], bits, seed=sum(SHAPES[shape]) + bits)
                for shape in shapes for bits in bits_list}
    print(f"weights ready ({time.perf_counter() - t0:.0f} s)", flush=True)
    results: dict[tuple[int, int], dict[str, dict[str, Result | str]]] = {}
    skipped = 0
    for m in rows:  # budget cuts fall on the last regimes, each variant still on every shape
        xs = {k: (torch.randn(m, k, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(m + k))
                  + 0.1).to(torch.bfloat16) for k in {SHAPES[s][1] for s in shapes}}
        for bits in bits_list:
            refs = {shape: xs[SHAPES[shape][1]].float() @ subjects[shape, bits].w32.t() for shape in shapes}
            table = results.setdefault((bits, m), {})
            for name, make in variants(bits, m, args.quick, args.all).items():
                if time.perf_counter() - t0 > TIME_BUDGET_S and name != "default" and name not in BASELINES:
                    skipped += 1
                    continue
                for shape in shapes:
                    label = f"{shape:8s} bits{bits} M={m:<5d} {name:28s}"
                    x = xs[SHAPES[shape][1]]
                    table.setdefault(name, {})[shape] = run_one(make, subjects[shape, bits], x, refs[shape], label, bw)
            del refs
    for (shape, bits), s in subjects.items():
        if "tiny_order" in s.cache:
            print(f"tinygemm nibble order ({shape}): {s.cache['tiny_order'][0]}")
    print_tables(results, shapes, bw)
    if skipped:
        print(f"\n(time budget of {TIME_BUDGET_S} s reached: {skipped} non-default variant runs skipped)")
    print(f"\nsweep took {time.perf_counter() - t0:.0f} s")


def print_tables(results: dict, shapes: tuple[str, ...], bw: float) -> None:
    summary = []
    for (bits, m), table in sorted(results.items()):
        print(f"\n== {bits}-bit, M = {m}: us per call, {'TFLOP/s' if m >= COMPUTE_ROWS else '% of bandwidth'}, "
              "max err / rms")
        print(f"{'variant':30s}" + "".join(f"{s:>22s}" for s in shapes) + f"{'total us':>11s}{'err':>9s}")
        totals = {}
        for name, per in table.items():
            ok = [per.get(s) for s in shapes if isinstance(per.get(s), Result)]
            total = sum(r.us for r in ok) if len(ok) == len(shapes) else float("nan")
            err = max((r.err for r in ok), default=float("nan"))
            print(f"{name:30s}" + "".join(f"{cell(per.get(s, '-'), m, bw):>22s}" for s in shapes)
                  + f"{total:11.1f}{err:9.1e}")
            if not math.isnan(total) and name not in BASELINES:
                totals[name] = total
        if totals:
            best = min(totals, key=totals.get)
            base = {n: t for n, t in totals.items() if n == "default"}
            line = f"{bits}-bit M={m:<5d} best: {best} ({totals[best]:.1f} us total"
            if base:
                line += f", default {base['default']:.1f} us"
            for b in BASELINES:
                per = table.get(b, {})
                if all(isinstance(per.get(s), Result) for s in shapes):
                    line += f", {b} {sum(per[s].us for s in shapes):.1f} us"
            summary.append(line + ")")
    print("\n== best of ours per regime (total time over the shapes)")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
