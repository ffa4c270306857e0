"""Paged prefill Triton kernel vs its PyTorch reference under TRITON_INTERPRET=1 (CPU, tiny sizes).

Cases (tests/layers/prefill_cases.py): every KV format, GQA 1/2/4,
sequences of 0 / 1 / many new rows, chunks from position 0 and mid-page after cached
pages, several query and key tiles, with and without sink rows.
"""

from __future__ import annotations

import pytest

from tests.interp import run_interpreted

pytest.importorskip("triton")


def test_paged_prefill_matches_reference_interpreted() -> None:
    run_interpreted("tests/layers/prefill_cases.py")
