"""Run a cases script of Triton kernels under TRITON_INTERPRET=1 (CPU, tiny sizes).

The interpreter must be chosen before triton is first imported, so each cases script runs in a
fresh interpreter process and prints "ALL OK" last when every case matched its reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Seconds a cases script may run (the interpreter executes every program instance in Python).
TIMEOUT_S = 300


def run_interpreted(script: str) -> None:
    """Run tests/<script> (a path relative to the repo root) interpreted; fail with its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / script)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines and "ALL OK" in lines[-1], res.stdout[-3000:]
