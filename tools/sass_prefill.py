"""Offline sm_90 build of the prefill kernel (kernels/paged_attention.py _prefill_kernel) per KV
format and block shape, no GPU needed: registers, spill stack, and the SASS op counts of its two
key loops (full tiles, diagonal tiles), with every global load (LDG: synchronous, in the loop)
against the pipelined copies (LDGSTS).

    PYTHONPATH=. python3 tools/sass_prefill.py [formats...]      # default: bf16 int4 int8 k8v4

Compute dtype bf16, head_dim 128, 4 query heads a kv head, 16-token pages, with sink rows."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvtier.kernels.paged_attention as pa  # noqa: E402
from kvtier.kv.formats import make_format  # noqa: E402
from sass_tools import SIG, report  # noqa: E402


def build(name, blocks=(128, 128, 8, 3), d=128, gqa=4, sink=True):
    fmt, compute = make_format(name), torch.bfloat16
    lay = {k: dt for k, (_, dt) in fmt.layout(8, 16, d).items()}
    ptrs = {"q_ptr": compute, "k_ptr": lay["k"], "ks_ptr": lay.get("k_scale", lay["k"]), "v_ptr": lay["v"],
            "vs_ptr": lay.get("v_scale", lay["v"]), "bt_ptr": torch.int32, "lens_ptr": torch.int32,
            "qsl_ptr": torch.int32, "sk_ptr": compute, "sv_ptr": compute, "slot_ptr": torch.int64, "o_ptr": compute}
    bm, bn, warps, stages = blocks
    const = pa.prefill_constants(fmt, d, 16, gqa, compute, sink, bm, bn, False)
    sig = {n: SIG[ptrs[n]] if n in ptrs else "constexpr" if n in const else "fp32" if n == "qk_scale" else "i32"
           for n in pa._prefill_kernel.arg_names}
    aligned = [*ptrs, "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_bt"]
    report(f"{name:5s} blocks={blocks}", pa._prefill_kernel, sig, const, aligned, warps, stages)


for name in sys.argv[1:] or ["bf16", "int4", "int8", "k8v4"]:
    for blocks in ((128, 128, 8, 3), (128, 64, 8, 3)):
        try:
            build(name, blocks)
        except Exception as e:
            print(name, blocks, "failed", type(e).__name__, str(e)[:200])
