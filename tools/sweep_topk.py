"""GPU time of retrieval's chunked top-k (kernels/retrieval_attention.py topk_columns) per launch
setting, beside torch.topk, over score rows of a retrieval graph's shapes (8 kv heads).

    PYTHONPATH=. python3 tools/sweep_topk.py            # chunk / warp settings
    PYTHONPATH=. python3 tools/sweep_topk.py --merge    # the merge's chunks a step (TOPK_MERGE_GROUP)
    PYTHONPATH=. python3 tools/sweep_topk.py --filter   # chunked against filtered (TOPK_FILTER)

--filter also times a hybrid's pair (k1 with exclude=, then k2 over the struck table) and scores
that rise towards the row's end (recent pages scoring higher, as real text's do), where the best
keys crowd few sub-blocks and the filter keeps more candidates.

Cases (columns, k, live columns): a 256K table's 16,386 columns with every column live and with
256 (a 4K context in a 256K engine), k 56 (hybrid's halves) and 112, and 4,352 columns. Each row:
us a call from CUDA-graph replay, and whether it equals topk_columns_reference.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import replay_us as timed  # noqa: E402

import kvtier.kernels.retrieval_attention as ra  # noqa: E402


def main() -> None:
    s = torch.randn(1, 8, 16386, device="cuda")
    base = (ra.TOPK_CHUNK, ra.TOPK_CHUNK_WARPS, ra.TOPK_MERGE_KEYS_PER_WARP, ra.TOPK_CHUNK_PICKS)
    group = ra.TOPK_MERGE_GROUP
    if "--filter" in sys.argv:
        return filtered(s)
    for c, k, lv in ((16386, 56, 16386), (16386, 56, 256), (16386, 112, 16386), (4352, 56, 4352)):
        x = s[..., :c].contiguous()
        live = torch.tensor([lv], device="cuda")
        print(f"C {c} k {k} live {lv}: torch.topk {timed(lambda: x.topk(k, dim=-1)):.1f} us", flush=True)
        if "--merge" in sys.argv:
            for ra.TOPK_MERGE_GROUP in (0, 2, 4, 8):
                us = timed(lambda: ra.topk_columns(x, k, live))
                ok = torch.equal(ra.topk_columns(x, k, live), ra.topk_columns_reference(x, k, live))
                print(f"   merge group {ra.TOPK_MERGE_GROUP}: {us:6.1f} us {'' if ok else 'WRONG'}", flush=True)
            ra.TOPK_MERGE_GROUP = group
            continue
        for ch, cw, kpw in itertools.product((1024, 2048, 4096), (4, 8), (128, 512)):
            ra.TOPK_CHUNK, ra.TOPK_CHUNK_WARPS, ra.TOPK_MERGE_KEYS_PER_WARP, ra.TOPK_CHUNK_PICKS = ch, cw, kpw, 2
            us = timed(lambda: ra.topk_columns(x, k, live))
            ok = torch.equal(ra.topk_columns(x, k, live), ra.topk_columns_reference(x, k, live))
            print(f"   chunk {ch} warps {cw} merge keys/warp {kpw}: {us:6.1f} us {'' if ok else 'WRONG'}", flush=True)
    ra.TOPK_CHUNK, ra.TOPK_CHUNK_WARPS, ra.TOPK_MERGE_KEYS_PER_WARP, ra.TOPK_CHUNK_PICKS = base


def filtered(s: torch.Tensor) -> None:
    flag = ra.TOPK_FILTER
    ramp = torch.linspace(0, 6, s.shape[-1], device="cuda")
    cases = [(16386, 56, 16386, "random"), (16386, 56, 256, "random"), (16386, 112, 16386, "random"),
             (4352, 56, 4352, "random"), (16386, 56, 16386, "rising"), (65538, 56, 65538, "random")]
    for c, k, lv, kind in cases:
        x = (torch.randn(1, 8, c, device="cuda") if c > s.shape[-1] else s[..., :c]).contiguous()
        if kind == "rising":
            x = x + ramp[:c]
        live = torch.tensor([lv], device="cuda")
        want = ra.topk_columns_reference(x, k, live)
        row = []
        for ra.TOPK_FILTER in (False, True):
            us = timed(lambda: ra.topk_columns(x, k, live))
            ok = torch.equal(ra.topk_columns(x, k, live), want)
            # a hybrid's pair: the first half strikes its picks from a second table
            y = torch.randn_like(x)

            def pair():
                ra.topk_columns(x, k, live, exclude=y)
                ra.topk_columns(y, k, live)
            pus = timed(pair)
            row.append(f"{'filtered' if ra.TOPK_FILTER else 'chunked'} {us:5.1f} us, pair {pus:5.1f}"
                       f"{'' if ok else ' WRONG'}")
        print(f"C {c} k {k} live {lv} {kind}: " + "; ".join(row), flush=True)
    ra.TOPK_FILTER = flag


if __name__ == "__main__":
    main()
