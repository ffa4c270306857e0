"""Offline sm_90 build of the prefill kernel (kernels/paged_attention.py _prefill_kernel) per KV
format and block shape, no GPU needed: registers, spill stack, and the SASS op counts of its two
key loops (full tiles, diagonal tiles), with every global load (LDG: synchronous, in the loop)
against the pipelined copies (LDGSTS).

    PYTHONPATH=. python3 tools/sass_prefill.py [formats...]      # default: bf16 int4 int8 k8v4

Uses the ptxas / nvdisasm / cuobjdump that Triton bundles. Compute dtype bf16, head_dim 128,
4 query heads a kv head, 16-token pages, with sink rows."""
import os, re, subprocess, sys, tempfile, collections
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kvtier.kernels.paged_attention as pa
from kvtier.kv.formats import make_format
_SIG = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int8: "*i8",
        torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv"}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
def build(name, blocks=(128, 128, 8, 3), d=128, gqa=4, sink=True):
    fmt, compute = make_format(name), torch.bfloat16
    lay = {k: dt for k, (_, dt) in fmt.layout(8, 16, d).items()}
    ptrs = {"q_ptr": compute, "k_ptr": lay["k"], "ks_ptr": lay.get("k_scale", lay["k"]), "v_ptr": lay["v"],
            "vs_ptr": lay.get("v_scale", lay["v"]), "bt_ptr": torch.int32, "lens_ptr": torch.int32,
            "qsl_ptr": torch.int32, "sk_ptr": compute, "sv_ptr": compute, "slot_ptr": torch.int64, "o_ptr": compute}
    bm, bn, warps, stages = blocks
    const = pa.prefill_constants(fmt, d, 16, gqa, compute, sink, bm, bn, False)
    names = pa._prefill_kernel.arg_names
    sig = {n: _SIG[ptrs[n]] if n in ptrs else "constexpr" if n in const else "fp32" if n == "qk_scale" else "i32"
           for n in names}
    aligned = [*ptrs, "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_bt"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(ASTSource(pa._prefill_kernel, sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"]); path = f.name
    sass = subprocess.run([f"{BIN}/nvdisasm", "-c", path], capture_output=True, text=True).stdout
    insts, labels = [], {}
    for line in sass.splitlines():
        lm = re.match(r"\.(L_x_\d+):", line.strip())
        if lm: labels[lm.group(1)] = len(insts)
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m: insts.append((m.group(2), m.group(3)))
    loops = []
    for i, (op, rest) in enumerate(insts):
        if op.startswith("BRA"):
            t = re.search(r"\.(L_x_\d+)", rest)
            if t and labels.get(t.group(1), 1 << 30) < i:
                body = insts[labels[t.group(1)]:i + 1]
                loops.append((len(body), collections.Counter(o.split(".")[0] for o, _ in body)))
    loops.sort(key=lambda x: -x[0])
    res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", path], capture_output=True, text=True).stdout
    reg, stack = re.findall(r"REG:(\d+)", res), re.findall(r"STACK:(\d+)", res)
    shared = re.findall(r"SHARED:(\d+)", res)
    print(f"{name:5s} blocks={blocks} regs={reg} stack={stack} shared={shared} sass={len(insts)}", flush=True)
    for n, c in loops[:2]:
        print(f"   loop {n} instructions, LDG {c['LDG']}, LDGSTS {c['LDGSTS']}: "
              + " ".join(f"{o}:{k}" for o, k in c.most_common(12)), flush=True)
for name in sys.argv[1:] or ["bf16", "int4", "int8", "k8v4"]:
    for blocks in ((128, 128, 8, 3), (128, 64, 8, 3)):
        try:
            build(name, blocks)
        except Exception as e:
            print(name, blocks, "failed", type(e).__name__, str(e)[:200])
