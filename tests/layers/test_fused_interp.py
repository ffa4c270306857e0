"""Fused Triton kernels (kvtier/kernels/fused.py) vs their PyTorch references under
TRITON_INTERPRET=1 (CPU, tiny sizes).

Cases: (tests/layers/fused_cases.py).
"""

from __future__ import annotations

import pytest

from tests.interp import run_interpreted

pytest.importorskip("triton")


def test_fused_kernels_match_reference_interpreted() -> None:
    run_interpreted("tests/layers/fused_cases.py")
