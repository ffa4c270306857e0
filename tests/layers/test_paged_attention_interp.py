"""Paged decode Triton kernel vs its PyTorch reference under TRITON_INTERPRET=1 (CPU, tiny sizes).

The interpreter must be chosen before triton is first imported, so the cases
run in a fresh interpreter process (tests/layers/paged_attention_cases.py):
every KV format, GQA 1/2/4, odd lengths, partial pages, seq_len-0 rows,
1 and 3 splits, with and without sink rows.
"""

from __future__ import annotations

import pytest

from tests.interp import run_interpreted

pytest.importorskip("triton")


def test_paged_decode_matches_reference_interpreted() -> None:
    run_interpreted("tests/layers/paged_attention_cases.py")
