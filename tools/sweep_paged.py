"""GPU time of paged_decode per launch-parameter variant (CUDA-graph replay: no launch overhead).

    python3 tools/sweep_paged.py [--default | --few | --splits | --parts | --stages | --prefetch]

For each (warps, stages, tile bytes) variant and each format: B=1 at 32K and B=32 at 8K
context (Hkv 8, Hq 32, D 128, scattered 16-token pages), 20 calls captured in one graph and
replayed; prints us per call and GB/s of K/V bytes read.
"""

from __future__ import annotations

import itertools
import sys

import torch

from gpu_timing import replay_us  # tools/, run as a script
from kvtier.kernels import paged_attention as pa
from kvtier.kv.formats import make_format
from kvtier.kv.pool import PagePool

HKV, G, D, PS = 8, 4, 128, 16
CASES = ((1, 32768), (32, 8192), (1, 4096))
CALLS = 20


def pool_for(name: str, pages: int) -> PagePool:
    pool = PagePool(make_format(name), 1, pages, HKV, PS, D, "cuda", compute_dtype=torch.bfloat16)
    for lo in range(0, pages * PS, 1 << 18):  # random rows through the real store path
        n = min(1 << 18, pages * PS - lo)
        slots = torch.arange(lo, lo + n, device="cuda")
        k, v = torch.randn(2, n, HKV, D, device="cuda", dtype=torch.bfloat16)
        pool.write(0, slots, k, v)
    return pool


def time_case(pool: PagePool, batch: int, ctx: int, splits: int) -> float:
    pages = ctx // PS
    perm = torch.randperm(pool.num_pages, device="cuda")[:batch * pages].to(torch.int32).view(batch, pages)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HKV * G, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    sink = (pool.sink_k[0], pool.sink_v[0], pool.sink_slot) if pool.sink_slots else None
    call = lambda: pa.paged_decode(q, pool.layers[0], pool.fmt, perm, lens, D ** -0.5, splits,  # noqa: E731
                                   sink=sink, out=out)
    return replay_us(call, CALLS)


def case_row(name: str, pool: PagePool, batch: int, ctx: int, sms: int) -> str:
    """One case at the heuristic's splits: us a call and GB/s of K/V read (or why it failed)."""
    splits = pa.choose_num_splits(batch, HKV, ctx, PS, sms)
    try:
        us = time_case(pool, batch, ctx, splits)
    except Exception as e:  # a variant that does not compile (registers, shared memory)
        return f"{name} B{batch} {ctx // 1024}K: failed {type(e).__name__}"
    gbs = batch * ctx * pool.fmt.bytes_per_token(HKV, D) / (us * 1e-6) / 1e9
    return f"{name} B{batch} {ctx // 1024}K s{splits} {us:7.1f}us {gbs:5.0f}GB/s"


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pages = max(b * c for b, c in CASES) // PS
    pools = {n: pool_for(n, pages) for n in ("bf16", "int8", "k8v4", "int4")}
    base = (pa.NUM_WARPS, pa.NUM_STAGES, pa.TILE_BYTES, pa.PROGRAMS_PER_SM)
    long_tile = pa.LONG_TILE_BYTES
    print(f"default warps/stages/tile/programs-per-SM = {base}")
    variants = itertools.product((4, 8), (2, 3), (8192, 16384, 32768), (4,))
    if "--splits" in sys.argv:
        return sweep_splits(pools, sms)
    if "--parts" in sys.argv:
        return sweep_parts(pools, sms)
    if "--stages" in sys.argv:
        return sweep_stages(pools, sms)
    if "--prefetch" in sys.argv:
        return sweep_prefetch(pools, sms)
    if "--default" in sys.argv:
        variants = [base]
    elif "--few" in sys.argv:  # the default and longer tiles (what the code formats may want)
        variants = [base, (4, 2, 32768, 4), (8, 2, 32768, 4), (8, 3, 32768, 4)]
    stages_by_format, pa.DECODE_STAGES = pa.DECODE_STAGES, {}  # every format at the variant's stages
    for warps, stages, tile, pps in variants:
        pa.NUM_WARPS, pa.NUM_STAGES, pa.TILE_BYTES, pa.PROGRAMS_PER_SM = warps, stages, tile, pps
        pa.LONG_TILE_BYTES = long_tile if tile == base[2] else tile  # a variant row: one tile everywhere
        row = []
        for name, pool in pools.items():
            for batch, ctx in CASES:
                row.append(case_row(name, pool, batch, ctx, sms))
        print(f"warps {warps} stages {stages} tile {tile:5d} pps {pps}: " + " | ".join(row), flush=True)
    pa.NUM_WARPS, pa.NUM_STAGES, pa.TILE_BYTES, pa.PROGRAMS_PER_SM = base
    pa.LONG_TILE_BYTES, pa.DECODE_STAGES = long_tile, stages_by_format


def sweep_parts(pools: dict, sms: int) -> None:
    """--parts: int8 V tiles as one interleaved tile vs four column sets, one dot each
    (paged_attention.code_parts)."""
    base = pa.PARTS_DECODE
    for parts in (False, True):
        pa.PARTS_DECODE = parts
        row = [case_row(name, pool, batch, ctx, sms) for name, pool in pools.items() if name != "bf16"
               for batch, ctx in CASES]
        print(f"parts {parts}:\n   " + "\n   ".join(row), flush=True)
    pa.PARTS_DECODE = base


def sweep_stages(pools: dict, sms: int) -> None:
    """--stages: pipeline stages of the split kernel per format (paged_attention.DECODE_STAGES), B = 1."""
    base = dict(pa.DECODE_STAGES)
    for stages in (1, 2, 3):
        pa.DECODE_STAGES = {name: stages for name in pools}
        row = [case_row(name, pool, 1, ctx, sms) for name, pool in pools.items() for ctx in (32768, 4096)]
        print(f"stages {stages}:\n   " + "\n   ".join(row), flush=True)
    pa.DECODE_STAGES = base


def sweep_prefetch(pools: dict, sms: int) -> None:
    """--prefetch: every format at one stage, the next tile's page ids loaded ahead or not
    (paged_attention.PREFETCH_AT_ONE_STAGE), B = 1 at 32K and 4K."""
    base, stages = pa.PREFETCH_AT_ONE_STAGE, dict(pa.DECODE_STAGES)
    pa.DECODE_STAGES = {name: 1 for name in pools}
    for on in (False, True):
        pa.PREFETCH_AT_ONE_STAGE = on
        row = [case_row(name, pool, 1, ctx, sms) for name, pool in pools.items() for ctx in (32768, 4096)]
        print(f"one stage, ids prefetched {on}:\n   " + "\n   ".join(row), flush=True)
    pa.PREFETCH_AT_ONE_STAGE, pa.DECODE_STAGES = base, stages


def sweep_splits(pools: dict, sms: int) -> None:
    """--splits: the split heuristic's (programs per SM, most splits, fewest tokens a split) moved
    together, default tiles and warps; cases B1 32K / 4K, B8 32K, B32 8K."""
    base = (pa.PROGRAMS_PER_SM, pa.MAX_SPLITS, pa.MIN_SPLIT_TOKENS)
    cases = ((1, 32768), (1, 4096), (8, 32768), (32, 8192))
    for pps, most, least in ((4, 64, 128), (8, 128, 128), (16, 256, 128), (8, 256, 64), (16, 512, 64),
                             (32, 512, 64)):
        pa.PROGRAMS_PER_SM, pa.MAX_SPLITS, pa.MIN_SPLIT_TOKENS = pps, most, least
        row = []
        for name, pool in pools.items():
            for batch, ctx in cases:
                if batch * ctx // PS > pool.num_pages:
                    continue
                row.append(case_row(name, pool, batch, ctx, sms))
        print(f"programs/SM {pps} max splits {most} min split {least}:\n   " + "\n   ".join(row), flush=True)
    pa.PROGRAMS_PER_SM, pa.MAX_SPLITS, pa.MIN_SPLIT_TOKENS = base


if __name__ == "__main__":
    main()
