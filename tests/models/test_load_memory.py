"""Loading a GGUF holds each weight once: resident memory after load, and at its peak, stays near the file size.

Measured in a fresh process (tools/rss_load.py): RSS after importing torch and kvtier is the
runtime's own base; the load (GGUF -> QuantWeight, one tensor at a time from the mmap) and the
Decoder build (CPU packings replacing the QuantWeights) must add at most
MAX_OVER_FILE x the file size + FIXED_OVERHEAD, after load and at the peak.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

MAX_OVER_FILE = 1.3
# Fixed overhead on top of the weights: rotary tables, the allocator's slack and the in-flight
# repack temporaries of the loader's threads (CHUNK_BYTES each) and of one layer's packing, plus
# the transient second copy of the largest matrix while its CPU packing is built (SmolLM2's tied
# Q8_0 embedding / lm_head: 30 MB as QuantWeight, 35 MB as two int4pack halves).
FIXED_OVERHEAD = 128 << 20

TOOL = Path(__file__).resolve().parents[2] / "tools" / "rss_load.py"


def _tool():
    spec = importlib.util.spec_from_file_location("rss_load", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="RSS read from /proc (Linux)")
def test_smollm2_load_rss_near_file_size(smollm2_path: Path) -> None:
    rec = _tool().measure(str(smollm2_path), "bf16", "stored")
    file_bytes, base = rec["file_bytes"], rec["rss_base"]
    budget = MAX_OVER_FILE * file_bytes + FIXED_OVERHEAD
    print(rec)
    # the model holds about the file: 4-bit blocks as int4pack, the Q8_0 table split in two halves
    assert 0.9 * file_bytes < rec["weight_bytes"]["cpu"] < 1.2 * file_bytes
    assert rec["rss_after"] - base <= budget, (rec["rss_after"] - base) / file_bytes
    assert rec["peak"] - base <= budget, (rec["peak"] - base) / file_bytes
