"""paged_decode at B = 1 with the stored-domain moves folded into the kernels vs as launches of
their own (kernels/paged_attention.py FOLD_MAX_SPLITS), per format and context.

    PYTHONPATH=. python3 tools/sweep_fold.py

For bf16 / int8 / k8v4 pools (Hkv 8, Hq 32, D 128, 16-token pages), contexts 32K / 4K / 1K, pages in
order and scattered, the heuristic's splits: us a call (CUDA-graph replay) of the plain kernel on
q already in the stored domain; for the rotating formats also `folded` (raw q in, NativeDomain)
and `separate` (transform_rows on q, the plain kernel, transform_rows on the output), and folded
with 16 / 32 splits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_paged as sp  # noqa: E402
from gpu_timing import replay_us as timed  # noqa: E402

from kvtier.kernels import kv_transform  # noqa: E402
from kvtier.kernels import paged_attention as pa  # noqa: E402


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in ("bf16", "int8", "k8v4"):
        pool = sp.pool_for(name, 32768 // sp.PS + 16)
        fmt, st = pool.fmt, pool.layers[0]
        sink = (pool.sink_k[0], pool.sink_v[0], pool.sink_slot) if pool.sink_slots else None
        for ctx in (32768, 4096, 1024):
            pages = ctx // sp.PS
            for order in ("contig", "scatter"):
                ids = (torch.arange(pages, device="cuda") if order == "contig"
                       else torch.randperm(pool.num_pages, device="cuda")[:pages])
                bt = ids.to(torch.int32).view(1, pages)
                lens = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
                q = torch.randn(1, sp.HKV * sp.G, sp.D, device="cuda", dtype=torch.bfloat16)
                s = pa.choose_num_splits(1, sp.HKV, ctx, sp.PS, sms)
                row = [f"{name} {ctx // 1024}K {order} s{s}: plain "
                       f"{timed(lambda: pa.paged_decode(q, st, fmt, bt, lens, 0.088, s, sink=sink)):6.1f}"]
                if fmt.rotate_k or fmt.rotate_v:
                    scale = torch.rand(sp.HKV, sp.D, device="cuda") + 0.5
                    nat = pa.NativeDomain(scale, fmt.rotate_k, fmt.rotate_v)

                    def separate():
                        qn = kv_transform.transform_rows(q, fmt.rotate_k, scale)
                        o = pa.paged_decode(qn, st, fmt, bt, lens, 0.088, s, sink=sink)
                        return kv_transform.transform_rows(o, True) if fmt.rotate_v else o
                    folded = timed(lambda: pa.paged_decode(q, st, fmt, bt, lens, 0.088, s, sink=sink, native=nat))
                    row.append(f"folded {folded:6.1f}  separate {timed(separate):6.1f}")
                    for fs in (16, 32):
                        if fs < s:
                            us = timed(lambda: pa.paged_decode(q, st, fmt, bt, lens, 0.088, fs, sink=sink, native=nat))
                            row.append(f"folded s{fs} {us:6.1f}")
                print(" ".join(row), flush=True)


if __name__ == "__main__":
    main()
