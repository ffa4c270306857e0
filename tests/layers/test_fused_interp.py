"""Fused Triton kernels (kvtier/kernels/fused.py) vs their PyTorch references under
TRITON_INTERPRET=1 (CPU, tiny sizes).

The interpreter must be chosen before triton is first imported, so the cases run in a
fresh interpreter process (tests/layers/fused_cases.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def test_fused_kernels_match_reference_interpreted() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "tests/layers/fused_cases.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().startswith("ALL OK"), res.stdout[-3000:]
