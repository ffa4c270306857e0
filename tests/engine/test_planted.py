"""`kvtier eval planted` (eval/planted.py): needles planted into random keys, found by the page index.

A budget covering the whole context selects every page (every needle found, output == dense); a
needle standing far above every random key is found by each selector.
"""

from __future__ import annotations

import pytest

from kvtier.eval.planted import run_planted

SMALL = dict(kv_heads=2, gqa=2, head_dim=32, page_size=16, sink=16, window=64, device="cpu")


def test_budget_covering_the_context_is_dense():
    rows = run_planted(1024, [2.0], trials=2, budget=2048, selectors=["quest", "meankey"], kv_dtype="fp32", **SMALL)
    assert {r.method for r in rows} == {"quest", "meankey"}
    for r in rows:
        assert r.length == 1024 and r.found == 1.0
        assert r.mass == pytest.approx(1.0, abs=1e-5) and r.rel_err < 1e-4


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_strong_needles_are_found_by_every_selector(kv_dtype):
    rows = run_planted(1024, [24.0], trials=2, budget=256, selectors=["quest", "quest-max", "meankey"],
                       kv_dtype=kv_dtype, **SMALL)
    for r in rows:
        assert r.found == 1.0, r
        assert r.mass > 0.9 and r.rel_err < 0.2, r


def test_centroid_selectors_find_needles_the_quest_bound_misses():
    """Isotropic random keys: every page's per-channel spread inflates its Quest bound past a
    needle page's true score, so quest misses needles a few nats above the strongest random key;
    the page's mean key (centroid, and hybrid's centroid half) still points at them."""
    shape = {**SMALL, "head_dim": 64}  # the bound's inflation grows with head_dim
    rows = {r.method: r for r in run_planted(2048, [2.0], trials=2, budget=512,
                                             selectors=["quest", "centroid", "hybrid"], kv_dtype="bf16", **shape)}
    assert rows["centroid"].found == rows["hybrid"].found == 1.0
    assert rows["quest"].found < 0.5


def test_8bit_summary_methods_rank_like_16bit():
    """A "<selector>/8" method scores 8-bit page summaries (outward-rounded codes, kv/summaries.py)
    beside the 16-bit ones in one run: the same needles found, nearly the same mass covered."""
    shape = {**SMALL, "head_dim": 64}
    rows = {r.method: r for r in run_planted(2048, [3.0], trials=2, budget=512,
                                             selectors=["hybrid-mid", "hybrid-mid/8", "quest", "quest/8"],
                                             kv_dtype="bf16", **shape)}
    assert set(rows) == {"hybrid-mid", "hybrid-mid/8", "quest", "quest/8"}
    for s in ("hybrid-mid", "quest"):
        assert rows[s + "/8"].found == rows[s].found, (rows[s], rows[s + "/8"])
        assert rows[s + "/8"].mass == pytest.approx(rows[s].mass, abs=0.05)
    assert rows["hybrid-mid/8"].found == 1.0
