"""llama.cpp (llama-cpp-python) timing, run in its own process by `kvtier bench --llama-cpp`.

Its own process: llama.cpp ships its own OpenMP/ggml threads, and a crash in a
local build must not take the benchmark (or torch's thread pool) down with it.

    python -m kvtier.bench.llamacpp < {"path": ..., "ids": [...], "gen": N, "threads": T}
    -> {"ttft_s": ..., "decode_s": ..., "gen": N} on stdout
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    job = json.load(sys.stdin)
    from llama_cpp import Llama

    ids, gen = job["ids"], job["gen"]
    llm = Llama(model_path=job["path"], n_ctx=len(ids) + gen + 16, n_threads=job["threads"], verbose=False)
    t0 = time.perf_counter()
    llm.eval(ids)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(gen):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    json.dump({"ttft_s": ttft, "decode_s": time.perf_counter() - t0, "gen": gen}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
