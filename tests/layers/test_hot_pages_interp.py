"""GPU cache of selected host pages (kvtier/kernels/hot_pages.py) vs its PyTorch reference.

Under TRITON_INTERPRET=1 (this file run as a script in a fresh process, tests/interp.py) the
kernel's programs run in order, so it must equal hot_lookup_reference exactly: ids, map, owners,
ring counters, stats and the pool pages it writes; plain, int8 and k8v4 pages; room for every
entry and a ring too small for them (entries past the window read in place); a repeated
selection hitting; an invalidated page brought up again. tests/layers/hot_pages_cases.py says what
each step checks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if __package__ in (None, ""):  # run as a script by tests/interp.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.layers import hot_pages_cases  # noqa: E402

# (format, quantized formats' compute dtype, slots)
CASES = [("fp32", torch.float32, 64), ("int8", torch.float16, 64), ("k8v4", torch.float32, 64),
         ("k8v4", torch.float16, 4)]


def main() -> None:
    import kvtier.kernels.hot_pages as hp
    import kvtier.kernels.retrieval_attention as ra
    failures = []
    for i, (name, dtype, slots) in enumerate(CASES):
        try:
            hot_pages_cases.check_hot_pages(hp, ra, name, dtype, "cpu", 40 + 10 * i, slots, exact=True,
                                            kernel_attention=False)
        except AssertionError as e:
            failures.append(str(e))
    for f in failures:
        print("FAIL", f)
    print("ALL OK" if not failures else f"{len(failures)} FAILED")


def test_hot_pages_match_reference_interpreted() -> None:
    pytest.importorskip("triton")
    from tests.interp import run_interpreted
    run_interpreted("tests/layers/test_hot_pages_interp.py")


def test_reference_alone_cpu() -> None:
    """Without the kernel: the reference's own invariants (attention unchanged, rows copied, hits)."""
    import kvtier.kernels.hot_pages as hp
    import kvtier.kernels.retrieval_attention as ra

    class RefHot(hp.HotPages):
        def lookup(self, layer, st, alt, page_ids, page_idx):  # type: ignore[override]
            return hp.hot_lookup_reference(self, layer, st, alt, page_ids, page_idx)

    class Mod:
        HotPages = RefHot
        hot_lookup_reference = staticmethod(hp.hot_lookup_reference)

    for i, (name, dtype, slots) in enumerate(CASES):
        hot_pages_cases.check_hot_pages(Mod, ra, name, dtype, "cpu", 90 + i, slots, exact=False,
                                        kernel_attention=False)


if __name__ == "__main__":
    main()
