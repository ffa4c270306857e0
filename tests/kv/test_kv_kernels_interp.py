"""kv_quant Triton kernels vs the PyTorch reference under TRITON_INTERPRET=1 (CPU, tiny sizes).

The interpreter must be chosen before triton is first imported, so the cases
run in a fresh interpreter process (tests/kv/kernel_cases.py).
"""

from __future__ import annotations

import pytest

from tests.interp import run_interpreted

pytest.importorskip("triton")


def test_kernels_match_reference_interpreted() -> None:
    run_interpreted("tests/kv/kernel_cases.py")
