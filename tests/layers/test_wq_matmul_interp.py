"""Weight-only quantized matmul kernels (kvtier/kernels/wq_matmul.py) vs `wq_linear_reference`
under TRITON_INTERPRET=1 (CPU, tiny sizes).

Cases: (tests/layers/wq_matmul_cases.py): every kernel path and switch, 4/8-bit codes with and
without mins, groups 16-128, M = 1 / 3 / 17, bias, residual, strided x, bf16 / fp16 / fp32 x.
"""

from __future__ import annotations

import pytest

from tests.interp import run_interpreted

pytest.importorskip("triton")


def test_wq_matmul_kernels_match_reference_interpreted() -> None:
    run_interpreted("tests/layers/wq_matmul_cases.py")
