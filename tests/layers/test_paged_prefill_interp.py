"""Paged prefill Triton kernel vs its PyTorch reference under TRITON_INTERPRET=1 (CPU, tiny sizes).

The interpreter must be chosen before triton is first imported, so the cases run in a
fresh interpreter process (tests/layers/prefill_cases.py): every KV format, GQA 1/2/4,
sequences of 0 / 1 / many new rows, chunks from position 0 and mid-page after cached
pages, several query and key tiles, with and without sink rows.
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


def test_paged_prefill_matches_reference_interpreted() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "tests/layers/prefill_cases.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ALL OK"), res.stdout[-3000:]
