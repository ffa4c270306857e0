"""Offline sm_90 builds of retrieval's top-k kernels (kernels/retrieval_attention.py), no GPU
needed: registers and SASS instructions a program, for the chunked path (chunk sort + merge) and
the filtered one (TOPK_FILTER: sub-block maxima, threshold + gather, pick), at the launch settings
topk_columns gives a 256K table (16,386 columns, k 56: hybrid-mid's halves).

    PYTHONPATH=. python3 tools/sass_topk.py
"""
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvtier.kernels.retrieval_attention as ra  # noqa: E402
from sass_tools import report  # noqa: E402

C, K = 16386, 56


def build(label: str, fn, ptrs: dict, const: dict, warps: int) -> None:
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in fn.arg_names}
    report(label, fn, sig, const, [], warps, 1, loops_shown=1)


kp = triton.next_power_of_2(K)
ch = max(ra.TOPK_CHUNK, ra.TOPK_CHUNK_PICKS * kp, triton.next_power_of_2(triton.cdiv(C, ra.TOPK_MAX_CHUNKS)))
nch = triton.cdiv(C, ch)
build(f"chunked: chunk sort, {ch} columns, {kp} picks", ra._topk_chunk_kernel,
      {"s_ptr": "*fp32", "live_ptr": "*i32", "out_ptr": "*i64"}, dict(CH=ch, KP=kp, HAS_LIVE=True), ra.TOPK_CHUNK_WARPS)
np_ = triton.next_power_of_2(nch) * kp
build(f"chunked: merge of {np_} keys", ra._topk_merge_kernel,
      {"key_ptr": "*i64", "live_ptr": "*i32", "out_ptr": "*i64", "exc_ptr": "*fp32"},
      dict(KP=kp, NP=np_, GROUP=ra.TOPK_MERGE_GROUP, EXCLUDE=True),
      min(16, max(4, np_ // ra.TOPK_MERGE_KEYS_PER_WARP)))
z = ra.filter_sizes(C, kp)
for coarse in (False, True):
    tag = "coarse" if coarse else "ticket"
    build(f"filtered ({tag}): maxima of {z['sub']} columns"
          + ("" if coarse else f" + the last program's threshold ({z['tp']} a step)"), ra._topk_max_kernel,
          {"s_ptr": "*fp32", "live_ptr": "*i32", "max_ptr": "*i32", "state_ptr": "*i32", "thr_ptr": "*i32",
           "cmax_ptr": "*i32"},
          dict(CH=z["ch"], SUB=z["sub"], TP=z["tp"], KTP=kp, HAS_LIVE=True, COARSE=coarse, G=z["g"]),
          ra.TOPK_FILTER_WARPS)
    build(f"filtered ({tag}): gather" + (f" with the threshold of {z['gr']} grouped maxima" if coarse else ""),
          ra._topk_filter_kernel,
          {"s_ptr": "*fp32", "live_ptr": "*i32", "thr_ptr": "*i32", "max_ptr": "*i32", "cnt_ptr": "*i32",
           "cand_ptr": "*i64"},
          dict(CH=z["ch"], CAP=z["cap"], HAS_LIVE=True, COARSE=coarse, SUB=z["sub"], G=z["g"], GR=z["gr"],
               KTP=min(kp, z["gr"])), ra.TOPK_FILTER_WARPS)
    build(f"filtered ({tag}): pick, every branch", ra._topk_pick_kernel,
          {"s_ptr": "*fp32", "live_ptr": "*i32", "cnt_ptr": "*i32", "cand_ptr": "*i64", "out_ptr": "*i64",
           "exc_ptr": "*fp32", "max_ptr": "*i32"},
          dict(KP=kp, SMALL=z["small"], MID=z["mid"], CAP=z["cap"], TILE=max(ra.TOPK_FILTER_CHUNK, kp),
               HAS_LIVE=True, EXCLUDE=True, COARSE=coarse, SUB=z["sub"], TP=z["tp"]), ra.TOPK_FILTER_WARPS)
