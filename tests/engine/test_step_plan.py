"""StepPlanner: the persistent step buffers hold exactly what the batch says (CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.engine.request import Request, SamplingParams
from kvtier.engine.scheduler import Batch, ScheduledSeq, Sequence
from kvtier.engine.step_plan import StepPlanner

PS = 4


def _batch(rng: random.Random, n_seqs: int) -> Batch:
    batch = Batch()
    for i in range(n_seqs):
        length = rng.randint(2, 40)
        toks = [rng.randrange(1000) for _ in range(length)]
        n = 1 if rng.random() < 0.5 else rng.randint(1, length)
        start = length - n
        pages = rng.sample(range(100), -(-length // PS) + rng.randint(0, 2))  # spare pages at the end
        seq = Sequence(request=Request(f"r{i}", toks, SamplingParams()), tokens=toks, prompt_len=length)
        batch.seqs.append(ScheduledSeq(seq, start, n, pages, sample=rng.random() < 0.8))
    return batch


def _expected(batch: Batch) -> dict[str, list[int]]:
    ids, pos, slots, rows, lens = [], [], [], [], []
    for s in batch.seqs:
        for p in range(s.start, s.start + s.num_tokens):
            ids.append(s.seq.tokens[p])
            pos.append(p)
            slots.append(s.page_table[p // PS] * PS + p % PS)
        if s.sample:
            rows.append(len(ids) - 1)
        lens.append(s.start + s.num_tokens)
    return {"ids": ids, "pos": pos, "slots": slots, "rows": rows, "lens": lens}


@pytest.mark.parametrize("seed", range(6))
def test_plan_matches_the_batch(seed):
    rng = random.Random(seed)
    planner = StepPlanner(torch.device("cpu"), PS, max_tokens=300, max_seqs=8, max_pages=12, scratch_slot=396)
    for _ in range(3):  # buffers are reused step after step
        batch = _batch(rng, rng.randint(1, 8))
        step = planner.plan(batch)
        want = _expected(batch)
        assert step.input_ids.tolist() == want["ids"]
        assert step.positions.tolist() == want["pos"]
        assert step.meta.slot_mapping.tolist() == want["slots"]
        assert step.meta.logits_indices.tolist() == want["rows"]
        assert step.meta.seq_lens == want["lens"] == step.meta.seq_lens_t.tolist()
        assert step.meta.query_start_loc_t.tolist() == step.meta.query_start_loc
        for b, s in enumerate(batch.seqs):
            used = -(-want["lens"][b] // PS)
            row = step.meta.block_table[b].tolist()
            assert row[:used] == s.page_table[:used] and not any(row[used:])


def test_padding_rows_attend_to_nothing_and_write_to_scratch():
    rng = random.Random(1)
    planner = StepPlanner(torch.device("cpu"), PS, max_tokens=64, max_seqs=8, max_pages=12, scratch_slot=396)
    batch = _batch(rng, 3)
    for s in batch.seqs:  # decodes
        s.start, s.num_tokens, s.sample = len(s.seq.tokens) - 1, 1, True
    step = planner.plan(batch, pad_to=8, max_seq_len=48)
    assert step.num_rows == 3 and step.meta.max_seq_len == 48
    assert step.meta.seq_lens_t.tolist()[3:] == [0] * 5
    assert step.meta.slot_mapping.tolist()[3:] == [396] * 5
    assert step.meta.logits_indices.tolist() == list(range(8))
    assert step.meta.query_start_loc_t.tolist() == list(range(9))
    assert step.input_ids.shape == (8,)


def test_over_capacity_is_refused():
    planner = StepPlanner(torch.device("cpu"), PS, max_tokens=8, max_seqs=2, max_pages=3)
    with pytest.raises(ValueError, match="capacity"):
        planner.plan(_batch(random.Random(0), 3))


@pytest.mark.parametrize("max_batch", [1, 5, 32, 40, 256])
def test_graph_sizes_round_to_the_same_power_of_two(max_batch):
    """A step of n decodes replays the graph of size s >= n; the backend's split choice rounds the
    batch to a power of two, which must be the same for n and s (graph == eager, bit for bit)."""
    from kvtier.engine.cuda_graph import DecodeGraphs

    graphs = DecodeGraphs(None, None, None, max_batch, 128)
    pow2 = lambda n: 1 << max(0, n - 1).bit_length()  # noqa: E731
    for n in range(1, max_batch + 1):
        size = graphs.size_for(n)
        assert size is not None and n <= size <= max_batch and pow2(size) == pow2(n)
    assert graphs.size_for(max_batch + 1) is None
