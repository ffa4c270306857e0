"""Probe: does the first engine of a process give other greedy tokens than later ones? (CUDA)

    PYTHONPATH=. python3 tools/probe_first_engine.py

Seen on an H100 (2026-12-06): with k8v4 KV, a bf16 model and retrieval, the first engine in a
process disagreed with every later engine of the same config. For dense and retrieval attention,
k8v4 and int8 KV, graphs on and off, three engines each over the same requests
(tests/gpu/test_host_tier.py's model and `run`): prints which runs agree.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.config import RetrievalConfig  # noqa: E402
from tests.gpu import test_host_tier as t  # noqa: E402


def main() -> None:
    model = t.random_model(torch.bfloat16)
    for graphs in ("auto", "off"):
        for name, r in (("dense", None), ("retrieval", RetrievalConfig(budget=96, sink=4, window=32))):
            for kv in ("k8v4", "int8"):
                runs = [t.run(model, kv, 128, retrieval=r, max_batch=1, graphs=graphs)[0] for _ in range(3)]
                print(f"graphs {graphs:4s} {name:9s} {kv}: run1==run2 {runs[0] == runs[1]}, "
                      f"run2==run3 {runs[1] == runs[2]}, per request {[a == b for a, b in zip(runs[0], runs[1])]}")


if __name__ == "__main__":
    main()
