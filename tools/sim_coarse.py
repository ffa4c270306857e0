"""Would a coarse first pass keep retrieval's picks? An offline study (CPU, no model, no kernels).

Retrieval scores every page's summaries each decode step (at 256K, 16K pages a kv head), then
takes a top-k over all of them: at 256K most of a step's selection time (docs/benchmarks.md). A
two-level selection would score groups of C consecutive pages by the min / max over the group
(a looser Quest bound, and a midrange), keep the best groups, and score only their pages.

This tool plants needles as `kvtier eval planted` does (random keys of Qwen3-8B's attention shape,
one needle page per kv head whose keys match the head's queries by `margin` nats over the
strongest random key) and compares, per (trial, kv head):

    full    hybrid-mid over every page (what retrieval does)
    coarse  groups of C pages ranked by their bound and by their midrange; the best `keep` groups
            of each ranking kept; hybrid-mid over the kept groups' pages only

and prints: the needle found, the dense softmax mass each selection covers, and the share of the
full selection the coarse one reproduces.

    python3 tools/sim_coarse.py --length 262144 --group 8 --keep 64
"""
from __future__ import annotations

import argparse

import torch

PS, H, G, D = 16, 8, 4, 128
SINK_PAGES, WINDOW_PAGES = 1, 17  # 16 sink tokens, a 256-token window (+1: unaligned)


def hybrid_mid(bound: torch.Tensor, mid: torch.Tensor, k: int, allowed: torch.Tensor) -> torch.Tensor:
    """[P] scores of one kv head -> the chosen page ids: k // 2 by the bound, the rest by midrange."""
    b = bound.masked_fill(~allowed, float("-inf"))
    m = mid.masked_fill(~allowed, float("-inf"))
    first = b.topk(k // 2).indices
    m[first] = float("-inf")
    return torch.cat([first, m.topk(k - k // 2).indices])


def scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [G, D] one kv head's queries; lo / hi [N, D] -> (summed Quest bound, summed midrange) [N]."""
    qp, qn = q.clamp_min(0).sum(0), q.clamp_max(0).sum(0)
    return hi @ qp + lo @ qn, (lo + hi) @ (qp + qn) * 0.5


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=262144)
    p.add_argument("--group", type=int, default=8, help="pages a coarse group")
    p.add_argument("--keep", type=int, default=64, help="groups kept by each coarse ranking")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--margins", default="1,3,6")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(a.seed)
    pages = a.length // PS
    groups = pages // a.group
    pages = groups * a.group
    scale = D ** -0.5
    k_pages = a.budget // PS - SINK_PAGES - WINDOW_PAGES
    print(f"{a.length:,} tokens: {pages:,} pages, groups of {a.group} ({groups:,}), keep {a.keep} per ranking "
          f"({2 * a.keep * a.group} pages at most), {k_pages} picks a kv head")
    for margin in (float(x) for x in a.margins.split(",")):
        tot = {"found_full": 0, "found_coarse": 0, "mass_full": 0.0, "mass_coarse": 0.0, "same": 0.0, "n": 0}
        for _ in range(a.trials):
            q = torch.randn(H, G, D, generator=gen)
            kmin = torch.empty(pages, H, D)
            kmax = torch.empty(pages, H, D)
            logits = torch.empty(H, G, pages, PS)
            chunk = 1024
            for p0 in range(0, pages, chunk):
                k = torch.randn(min(chunk, pages - p0), PS, H, D, generator=gen).bfloat16().float()
                kmin[p0:p0 + len(k)], kmax[p0:p0 + len(k)] = k.amin(1), k.amax(1)
                logits[:, :, p0:p0 + len(k)] = torch.einsum("hgd,pshd->hgps", q, k) * scale
            allowed = torch.ones(pages, dtype=torch.bool)
            allowed[:SINK_PAGES] = False
            allowed[pages - WINDOW_PAGES:] = False
            for h in range(H):
                needle = int(torch.randint(SINK_PAGES, pages - WINDOW_PAGES, (1,), generator=gen))
                qbar = q[h].mean(0)
                u = qbar / qbar.norm()
                target = float(logits[h].amax()) + margin
                amp = target / (scale * float(qbar @ u))
                k = (amp * u + 0.1 * torch.randn(PS, D, generator=gen)).bfloat16().float()
                kmin[needle, h], kmax[needle, h] = k.amin(0), k.amax(0)
                logits[h, :, needle] = (q[h] @ k.T) * scale
                mass = logits[h].reshape(G, -1).softmax(-1).view(G, pages, PS).sum(-1).mean(0)  # [pages]
                bound, mid = scores(q[h], kmin[:, h], kmax[:, h])
                full = hybrid_mid(bound, mid, k_pages, allowed)
                glo = kmin[:, h].view(groups, a.group, D).amin(1)
                ghi = kmax[:, h].view(groups, a.group, D).amax(1)
                gb, gm = scores(q[h], glo, ghi)
                gallowed = allowed.view(groups, a.group).any(1)
                kept = torch.zeros(groups, dtype=torch.bool)
                kept[gb.masked_fill(~gallowed, float("-inf")).topk(a.keep).indices] = True
                kept[gm.masked_fill(~gallowed, float("-inf")).topk(a.keep).indices] = True
                coarse = hybrid_mid(bound, mid, k_pages, allowed & kept.repeat_interleave(a.group))
                fixed = mass[:SINK_PAGES].sum() + mass[pages - WINDOW_PAGES:].sum()
                tot["found_full"] += int(needle in full.tolist())
                tot["found_coarse"] += int(needle in coarse.tolist())
                tot["mass_full"] += float(mass[full].sum() + fixed)
                tot["mass_coarse"] += float(mass[coarse].sum() + fixed)
                tot["same"] += len(set(full.tolist()) & set(coarse.tolist())) / k_pages
                tot["n"] += 1
        n = tot["n"]
        print(f"margin {margin:g}: needle found full {100 * tot['found_full'] / n:.1f}% coarse "
              f"{100 * tot['found_coarse'] / n:.1f}%; mass covered full {tot['mass_full'] / n:.3f} coarse "
              f"{tot['mass_coarse'] / n:.3f}; coarse picks = full picks {100 * tot['same'] / n:.1f}%", flush=True)


if __name__ == "__main__":
    main()
