"""Offline sm_90 build of the decode split kernel (kernels/paged_attention.py _split_kernel) per KV
format, no GPU needed: registers, spill stack, and the SASS op counts of its page loop, as the
engine launches it for one Qwen3-8B-shape layer at 32K (bf16 q, head_dim 128, 4 query heads a kv
head, 16-token pages, sink rows, 64 splits: the stored domain moved out of the kernel).

    PYTHONPATH=. python3 tools/sass_decode.py [formats...]      # default: bf16 int8 k8v4 int4
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvtier.kernels.paged_attention as pa  # noqa: E402
from kvtier.kv.formats import make_format  # noqa: E402
from sass_tools import SIG, report  # noqa: E402


def build(name: str, d: int = 128, gqa: int = 4, splits: int = 64, selected: bool = False) -> None:
    fmt, compute = make_format(name), torch.bfloat16
    lay = {k: dt for k, (_, dt) in fmt.layout(8, 16, d).items()}
    ptrs = {"q_ptr": compute, "k_ptr": lay["k"], "ks_ptr": lay.get("k_scale", lay["k"]), "v_ptr": lay["v"],
            "vs_ptr": lay.get("v_scale", lay["v"]), "bt_ptr": torch.int32, "lens_ptr": torch.int32,
            "idx_ptr": torch.int32, "ok_ptr": torch.int32, "sk_ptr": compute, "sv_ptr": compute,
            "slot_ptr": torch.int64, "o_ptr": torch.float32, "lse_ptr": torch.float32, "cs_ptr": compute}
    const = pa.split_constants(fmt, d, 16, gqa, compute, True, False, splits, None, selected=selected)
    sig = {n: SIG[ptrs[n]] if n in ptrs else "constexpr" if n in const else "fp32" if n == "qk_scale" else "i32"
           for n in pa._split_kernel.arg_names}
    aligned = [*ptrs, "stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_os", "stride_bt"]
    report(f"{name:5s} split kernel{' (selected lists)' if selected else ''} PAGES={const['PAGES']}",
           pa._split_kernel, sig, const, aligned, pa.NUM_WARPS, pa.decode_stages(fmt), loops_shown=1)


for name in sys.argv[1:] or ["bf16", "int8", "k8v4", "int4"]:
    try:
        build(name)
    except Exception as e:  # noqa: BLE001
        print(name, "failed", type(e).__name__, str(e)[:300])
