"""GPU time of retrieval's page scoring (kernels/retrieval_attention.py quest_scores) per variant,
over one layer of a long context's summaries (8 kv heads x 4 query heads, head_dim 128, bf16
min / max, 16-token pages).

    PYTHONPATH=. python3 tools/sweep_quest.py

Cases: 128K and 256K contexts (256K also with 8-bit summaries: int8 codes), with the pages split between the compute pool (the first 4,166
pages: 66,656 tokens, what a 12 GiB plan of 8B-int4 k8v4 keeps with hybrid-mid) and the host
tier's summaries (the rest, by negative ids). Rows: the bound with and without the midrange
scores, at three tile sizes (SCORE_TILE); us a call from CUDA-graph replay, % of the measured
bandwidth for the bytes the launch must read (min + max rows, ids, counts; scores written), and
the largest difference from quest_scores_reference relative to the scores' spread. (A variant
that summed the bound by tensor-core products, timed with this tool, lost 3-5x and was removed:
docs/benchmarks.md.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import replay_us as timed  # noqa: E402

import kvtier.kernels.retrieval_attention as ra  # noqa: E402
from kvtier.bench.run import measure_bandwidth  # noqa: E402

HKV, G, D, PAGE = 8, 4, 128, 16
DEV_PAGES = 4166


def summaries(pages: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, b = torch.randn(2, pages, HKV, D, device="cuda", generator=g)
    return (torch.minimum(a, b).bfloat16(), torch.maximum(a, b).bfloat16(),
            torch.full((pages,), PAGE, dtype=torch.int32, device="cuda"))


def codes(rows: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The same summaries as 8-bit codes (kv/summaries.py): (kmin, kmax codes, count, kexp)."""
    from kvtier.kv.summaries import encode_pages
    lo, hi, e = encode_pages(rows[0].float(), rows[1].float())
    count = rows[2]
    return lo.to(torch.int8), hi.to(torch.int8), count, e.to(torch.int8)


def main() -> None:
    bw = measure_bandwidth(torch.device("cuda"))
    print(f"bandwidth {bw / 1e9:.0f} GB/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    base = ra.SCORE_TILE, ra.SCORE_TILE_CODES
    for ctx, bits in ((131072, 16), (262144, 16), (262144, 8)):
        c = ctx // PAGE
        dev, host = summaries(DEV_PAGES, g), summaries(c - DEV_PAGES, g)
        if bits == 8:
            dev, host = codes(dev), codes(host)
        ids = torch.cat([torch.arange(DEV_PAGES), -1 - torch.arange(c - DEV_PAGES)]).cuda()[None]
        qg = torch.randn(1, HKV, G, D, device="cuda", generator=g).bfloat16()
        lim = torch.tensor([c], device="cuda")
        cand = torch.arange(c, device="cuda")[None]
        nbytes = c * (HKV * D * 2 * bits // 8 + HKV * (bits == 8) + 8 + 8 + 4) + c * HKV * 4
        want = ra.quest_scores_reference(qg.float(), dev, ids, False, host)
        spread = (want.max() - want.min()).item()
        print(f"ctx {ctx}, {bits}-bit: {c} pages, {nbytes / 1e6:.1f} MB a launch ({nbytes / bw * 1e6:.1f} us at the "
              f"bandwidth)")
        for tile in (1024, 2048, 4096, 8192):
            ra.SCORE_TILE = ra.SCORE_TILE_CODES = tile
            for mid in (False, True):
                def run():
                    return ra.quest_scores(qg, dev, ids, False, host, limit=lim, cand_idx=cand, midrange=mid)
                us = timed(run)
                got = run()
                got = got[0] if mid else got
                err = (got - want).abs().max().item() / spread
                print(f"   tile {tile:5d} mid {mid:d}: {us:7.1f} us {100 * nbytes / bw / (us * 1e-6):4.0f}%"
                      f"  max err {err:.1e} of the spread", flush=True)
    ra.SCORE_TILE, ra.SCORE_TILE_CODES = base


if __name__ == "__main__":
    main()
