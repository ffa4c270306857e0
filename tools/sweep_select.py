"""GPU time of one layer's whole retrieval selection (hybrid-mid, the CUDA default's kernels) per
top-k path, at 64K, 128K and 256K contexts in a 256K engine's table (16,386 columns).

    PYTHONPATH=. python3 tools/sweep_select.py

One layer of the fused path (layers/retrieval.py select): `quest_scores` (bound and midrange
from 8-bit summaries, pages split between the compute pool's 4,166 and the host tier's
summaries), the bound's top-k striking its picks from the midrange scores, the midrange's
top-k, `assemble_lists`. Rows: us a chain from CUDA-graph replay, for the chunked top-k and the
filtered one (TOPK_FILTER, with and without TOPK_FILTER_COARSE), and whether the lists equal the
chunked path's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import replay_us as timed  # noqa: E402
from sweep_quest import DEV_PAGES, HKV, PAGE, codes, summaries  # noqa: E402

import kvtier.kernels.retrieval_attention as ra  # noqa: E402

WIDTH = 16386  # a 256K engine's block table (max_model_len 262,400)
K = 110  # budget 2048: 128 pages less the sink page and 17 window pages


def chain(qg, dev, host, ids, lim, cand_idx, fixed_idx, fixed_ids, top_k):
    s1, s2 = ra.quest_scores(qg, dev, ids, False, host, limit=lim, cand_idx=cand_idx, midrange=True)
    top = torch.empty((1, HKV, K), dtype=torch.int64, device="cuda")
    k1 = K // 2
    ra.topk_columns(s1, k1, lim, out=top[..., :k1], exclude=s2)
    ra.topk_columns(s2, K - k1, lim, out=top[..., k1:])
    return ra.assemble_lists(top, cand_idx, ids, fixed_idx, fixed_ids, top_k)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, host = codes(summaries(DEV_PAGES, g)), codes(summaries(WIDTH - DEV_PAGES, g))
    ids = torch.cat([torch.arange(DEV_PAGES), -1 - torch.arange(WIDTH - DEV_PAGES)]).cuda()[None]
    qg = torch.randn(1, HKV, 4, 128, device="cuda", generator=g).bfloat16()
    flag = ra.TOPK_FILTER, ra.TOPK_FILTER_COARSE
    for ctx in (65536, 131072, 262144):
        pages = ctx // PAGE
        w0 = pages - 17
        lim = torch.tensor([w0], device="cuda")
        cols = torch.arange(WIDTH, device="cuda")[None]
        cand_idx = torch.where((cols >= 1) & (cols < w0), cols, -1)
        fixed_idx = torch.cat([torch.zeros(1, 1, dtype=torch.long), torch.arange(w0, pages)[None]], 1).cuda()
        fixed_ids = ids.gather(1, fixed_idx)
        top_k = torch.tensor([K], device="cuda")
        args = (qg, dev, host, ids, lim, cand_idx, fixed_idx, fixed_ids, top_k)
        row, want = [], None
        for ra.TOPK_FILTER, ra.TOPK_FILTER_COARSE in ((False, False), (True, False), (True, True)):
            us = timed(lambda: chain(*args))
            got = chain(*args)
            want = got if want is None else want
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            name = ('coarse' if ra.TOPK_FILTER_COARSE else 'filtered') if ra.TOPK_FILTER else 'chunked'
            row.append(f"{name} {us:6.1f} us{'' if same else ' DIFFERENT'}")
        print(f"ctx {ctx // 1024}K ({w0} live columns of {WIDTH}): " + "; ".join(row), flush=True)
    ra.TOPK_FILTER, ra.TOPK_FILTER_COARSE = flag


if __name__ == "__main__":
    main()
