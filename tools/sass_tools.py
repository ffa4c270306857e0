"""Offline sm_90 builds of Triton kernels, no GPU needed (Triton's bundled ptxas / nvdisasm /
cuobjdump): registers, spill stack, shared memory, and the SASS op counts of the longest loops.
Used by tools/sass_prefill.py and tools/sass_decode.py."""
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SIG = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int8: "*i8",
       torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv"}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def report(label: str, fn, sig: dict, const: dict, aligned: list[str], warps: int, stages: int,
           loops_shown: int = 2) -> None:
    """Compile `fn` (argument types `sig`, constexprs `const`, `aligned` arguments divisible by
    16) for sm_90 and print its resources and its longest loops' op counts (LDG: synchronous
    global loads inside a loop; LDGSTS: pipelined copies)."""
    names = fn.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
        path = f.name
    sass = subprocess.run([f"{BIN}/nvdisasm", "-c", path], capture_output=True, text=True).stdout
    insts, labels = [], {}
    for line in sass.splitlines():
        lm = re.match(r"\.(L_x_\d+):", line.strip())
        if lm:
            labels[lm.group(1)] = len(insts)
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            insts.append((m.group(2), m.group(3)))
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
    os.unlink(path)
    print(f"{label} regs={reg} stack={stack} shared={shared} sass={len(insts)}", flush=True)
    for n, c in loops[:loops_shown]:
        print(f"   loop {n} instructions, LDG {c['LDG']}, LDGSTS {c['LDGSTS']}: "
              + " ".join(f"{o}:{k}" for o, k in c.most_common(14)), flush=True)
