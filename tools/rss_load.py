"""Peak and settled resident memory of loading a model the way the engine does, in a fresh process.

    .venv/bin/python tools/rss_load.py MODEL [MODEL ...] [--dtype bf16] [--weights stored|dense|int8|int4]

For each model a child process imports torch, records its RSS (the fixed runtime overhead), then
loads the checkpoint and builds the Decoder (build.py's path, no KV pool), and prints one JSON
line: file size, RSS before / after, VmHWM (peak) and the decoder's resident weight bytes,
with the ratios to the file size that tests/models/test_load_memory.py bounds on SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
from kvtier.engine.build import DTYPES

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

def peak_rss():
    # VmHWM: this process image's high-water mark. Not ru_maxrss: Linux carries it across fork +
    # execve, so a child of a large process (a long pytest run) would report its parent's peak.
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

from kvtier.models.decoder import Decoder
from kvtier.models.loading import load_checkpoint
from kvtier.models.hub import resolve_model

path, dtype, weights, threads = sys.argv[1], DTYPES[sys.argv[2]], sys.argv[3], int(sys.argv[4])
if threads:
    torch.set_num_threads(threads)
path = resolve_model(path)
base = rss()
t0 = time.monotonic()
ckpt = load_checkpoint(path, dtype=dtype, weights=weights)
net = Decoder.from_tensors(ckpt.spec, ckpt.tensors, dtype, "cpu", consume=True)
seconds = time.monotonic() - t0
import os
print(json.dumps({"model": str(path), "file_bytes": os.path.getsize(path), "weights": weights,
                  "rss_base": base, "rss_after": rss(),
                  "peak": peak_rss(),
                  "weight_bytes": net.weight_bytes(), "load_s": round(seconds, 1)}))
"""


def measure(model: str, dtype: str = "bf16", weights: str = "stored", threads: int = 0) -> dict:
    """One model's load in a child process -> the JSON record (see module doc), ratios added."""
    out = subprocess.run([sys.executable, "-c", CHILD, model, dtype, weights, str(threads)],
                         check=True, capture_output=True, text=True)
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    f = rec["file_bytes"]
    rec["after_over_file"] = round((rec["rss_after"] - rec["rss_base"]) / f, 3)
    rec["peak_over_file"] = round((rec["peak"] - rec["rss_base"]) / f, 3)
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="model names (kvtier models list) or paths")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--weights", default="stored", choices=("dense", "stored", "int8", "int4"))
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    for m in a.models:
        rec = measure(m, a.dtype, a.weights, a.threads)
        mib = (lambda n: f"{n / 2**20:,.0f} MiB")  # noqa: E731
        print(json.dumps(rec))
        print(f"{m}: file {mib(rec['file_bytes'])}; runtime base {mib(rec['rss_base'])}; after load "
              f"{mib(rec['rss_after'])} (+{rec['after_over_file']}x file); peak {mib(rec['peak'])} "
              f"(+{rec['peak_over_file']}x file); weights {rec['weight_bytes']}; {rec['load_s']} s",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
