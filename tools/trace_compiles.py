"""Run a kvtier command and print every Triton kernel compiled on the way: when, which, how long.

    PYTHONPATH=. python3 tools/trace_compiles.py bench --shape qwen3-8b-int4 --contexts 4096,131072 ...

A compile in the middle of decode shows as a step far slower than its median (the grid bench's
"slowest" column). Run with an empty TRITON_CACHE_DIR to see every compile (a warm disk cache
hides them: the in-memory miss then costs a load, not a compile). Each line: seconds since start,
ms the compile (or disk load) took, the kernel, and the constexpr arguments that differ from the
kernel's previous compile in this process (the first compile of a kernel prints them all).
"""

from __future__ import annotations

import sys
import time

from triton.runtime.jit import JITFunction

T0 = time.perf_counter()
_last: dict[str, dict[str, object]] = {}
_do_compile = JITFunction._do_compile


def _traced(self, key, signature, device, constexprs, options, attrs, warmup):
    t = time.perf_counter()
    kernel = _do_compile(self, key, signature, device, constexprs, options, attrs, warmup)
    ms = (time.perf_counter() - t) * 1e3
    name = getattr(self, "__name__", None) or getattr(self.fn, "__name__", "?")
    names = self.arg_names
    now = {names[path[0]] if len(path) == 1 else str(path): v for path, v in constexprs.items()}
    prev = _last.get(name)
    shown = now if prev is None else {k: v for k, v in now.items() if prev.get(k) != v}
    _last[name] = now
    opts = f"warps={getattr(options, 'num_warps', '?')} stages={getattr(options, 'num_stages', '?')}"
    print(f"[compile {time.perf_counter() - T0:8.2f}s {ms:8.1f} ms] {name} {opts} {shown}",
          file=sys.stderr, flush=True)
    return kernel


JITFunction._do_compile = _traced

if __name__ == "__main__":
    from kvtier.cli import main

    sys.argv = ["kvtier", *sys.argv[1:]]
    sys.exit(main())
