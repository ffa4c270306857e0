"""Pinned spans in the engine (issue 12): the admission rule against the retrieval budget, and the
step planner's AttentionMetadata.pinned_pages (CPU)."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import RetrievalConfig
from kvtier.engine.request import PinnedBudget, PinnedOverBudgetError, Request, SamplingParams
from kvtier.engine.scheduler import Batch, ScheduledSeq, Sequence
from kvtier.engine.step_plan import StepPlanner, pinned_page_indices
from tests.engine.test_retrieval_engine import engine, tiny_model

PS = 4


def _scheduled(rid: str, length: int, start: int, n: int, spans=()) -> ScheduledSeq:
    toks = list(range(length))
    seq = Sequence(request=Request(rid, toks, SamplingParams(), pinned_spans=spans), tokens=toks,
                   prompt_len=length)
    return ScheduledSeq(seq, start, n, list(range(100, 100 + -(-length // PS))), sample=True)


def test_pinned_page_indices_round_out_merge_and_clip():
    assert pinned_page_indices(((0, 5), (13, 20)), PS, 10) == [0, 1, 3, 4]
    assert pinned_page_indices(((0, 5), (6, 9)), PS, 10) == [0, 1, 2]  # a shared page once
    assert pinned_page_indices(((3, 4),), PS, 10) == [0]
    assert pinned_page_indices(((8, 30),), PS, 4) == [2, 3]  # only the pages the step has


def test_planner_fills_pinned_pages_only_when_a_sequence_has_spans():
    planner = StepPlanner(torch.device("cpu"), PS, max_tokens=64, max_seqs=4, max_pages=16, scratch_slot=0)
    plain = Batch([_scheduled("a", 10, 9, 1), _scheduled("b", 7, 0, 7)])
    assert planner.plan(plain).meta.pinned_pages is None
    batch = Batch([_scheduled("a", 10, 9, 1), _scheduled("b", 30, 29, 1, ((0, 6), (21, 30))),
                   _scheduled("c", 30, 0, 12, ((0, 6), (21, 30)))])  # prefill: pages so far only
    meta = planner.plan(batch).meta
    assert meta.pinned_pages == [[], [0, 1, 5, 6, 7], [0, 1]]
    padded = planner.plan(batch, pad_to=4).meta  # one list per real sequence, like page_tables
    assert padded.pinned_pages == meta.pinned_pages and len(padded.page_tables) == 3


# ---- admission ----------------------------------------------------------------------------------

# budget 64 tokens = 16 pages of 4; sink 4 tokens = 1 page; window 16 tokens = 5 pages
LIMITS = PinnedBudget(RetrievalConfig(budget=64, sink=4, window=16), PS)


def test_spans_within_the_budget_are_admitted():
    LIMITS.check((), 500, 10)
    LIMITS.check(((0, 21), (480, 500)), 500, 10)  # pages 0-5 (0 is the sink's) + 120-124 + 5 window = 16
    LIMITS.check(((0, 60),), 60, 4)  # never past the budget: dense all along


def test_spans_past_the_budget_are_refused_naming_the_figures():
    with pytest.raises(PinnedOverBudgetError) as e:
        LIMITS.check(((0, 25), (480, 500)), 500, 10)  # 7 + 5 pinned pages + 5 window = 17 > 16
    assert (e.value.need, e.value.pinned, e.value.budget) == (68, 48, 64)
    assert isinstance(e.value, ValueError)
    assert "need 68 tokens" in str(e.value) and "over the --kvmem-budget of 64" in str(e.value)


def test_malformed_spans_are_a_value_error():
    for spans in (((5, 5),), ((0, 501),), ((10, 20), (15, 30)), ((20, 30), (0, 5))):
        with pytest.raises(ValueError, match="pinned spans"):
            LIMITS.check(spans, 500, 10)


def test_engine_refuses_at_add_request_and_plans_pins_for_admitted_requests():
    eng = engine(tiny_model(), RetrievalConfig(budget=48, sink=4, window=16), prefill_chunk=32)
    assert eng.pinned_budget is not None
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [i % 60 for i in range(90)]
    with pytest.raises(PinnedOverBudgetError, match="over the --kvmem-budget of 48"):
        eng.add_request(Request("big", prompt, params, pinned_spans=((0, 40),)))
    seen = []
    plan = eng.runner.planner.plan

    def spy(batch, **kw):
        step = plan(batch, **kw)
        seen.append(step.meta.pinned_pages)
        return step

    eng.runner.planner.plan = spy
    out = eng.generate_sync([Request("ok", prompt, params, pinned_spans=((0, 6), (86, 90)))])
    assert sum(len(o.token_ids) for o in out["ok"]) == 8
    assert seen[-1] == [[0, 1, 21, 22]]
    eng.manager.check_integrity()
