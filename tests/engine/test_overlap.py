"""Overlap scheduling (engine/engine.py): decode steps launched before the step before them is read
back must give exactly what the synchronous loop gives, output by output, whatever stops, finishes,
arrives or is aborted in between. CPU runs the same bookkeeping (ops just do not run ahead)."""

from __future__ import annotations

from dataclasses import astuple

from kvtier.engine.request import Request, SamplingParams
from tests.engine.test_engine import PROMPTS, alone, greedy, run  # noqa: F401 - alone: a fixture


def outputs(engine, prompts, params) -> dict[str, list[tuple]]:
    """Every Output of every request, as comparable tuples (tokens, text, finish, usage...)."""
    tok = engine.tokenizer
    ps = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [Request(f"r{i}", tok.encode(p), q) for i, (p, q) in enumerate(zip(prompts, ps))]
    res = engine.generate_sync(reqs)
    return {rid: [(o.token_ids, o.text, o.finish_reason, o.stop_reason, astuple(o.usage),
                   o.progress is not None) for o in outs] for rid, outs in res.items()}


def test_overlap_equals_alone_batched(make_engine, alone):
    eng = make_engine(max_batch=8, overlap="on")
    assert run(eng, PROMPTS, greedy()) == alone
    assert eng.overlap_steps > 10  # steps really chained
    assert eng._inflight is None or all(eng._seqs.get(s.seq_id) is not s for s in eng._inflight.rows)
    eng.manager.check_integrity()


def test_overlap_same_outputs_with_stops_lengths_and_eos(make_engine):
    """Stop strings, stop ids, EOS and max_tokens end rows one step before the step in flight is
    read: every Output (text deltas, finish reasons, usage) is the synchronous loop's."""
    ref_eng = make_engine(max_batch=8)
    tok = ref_eng.tokenizer
    text = tok.decode(run(ref_eng, ["1, 2, 3, 4,"], greedy(12))[0])
    stop = text.strip().split(",")[1].strip()
    params = [greedy(12, stop=(stop,)), greedy(3), greedy(40), greedy(7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=(tok.encode(" 7")[0],)),
              greedy(1), greedy(20), greedy(5)]
    prompts = ["1, 2, 3, 4,"] + PROMPTS[1:]
    ref = outputs(make_engine(max_batch=8), prompts, params)
    eng = make_engine(max_batch=8, overlap="on")
    assert outputs(eng, prompts, params) == ref
    assert eng.overlap_steps > 0
    eng.manager.check_integrity()


def test_overlap_with_tiny_pool_preemption_and_host_tier(make_engine, alone):
    eng = make_engine(num_pages=12, max_batch=8, overlap="on")
    assert run(eng, PROMPTS, greedy()) == alone
    assert eng.scheduler.preemptions > 0 and eng.overlap_steps > 0
    eng.manager.check_integrity()
    eng = make_engine(num_pages=4, host_kv_mib=64, max_batch=2, overlap="on")
    assert run(eng, PROMPTS, greedy()) == alone
    assert run(eng, PROMPTS, greedy()) == alone  # hits, GPU and host, of pages committed while chaining
    assert eng.manager.stats()["hit_tokens_host"] > 0
    eng.manager.check_integrity()


def test_overlap_prefix_cache_commits_real_tokens(make_engine):
    """KV pages committed while steps chain are indexed by their real tokens: a repeat of a finished
    conversation plus its answer hits the cache for the answer's full pages too."""
    eng = make_engine(overlap="on")
    tok = eng.tokenizer
    prompt = tok.encode("Once upon a time, in a land far away,")
    first = run(eng, ["Once upon a time, in a land far away,"], greedy(60))[0]
    assert eng.overlap_steps > 40
    follow = prompt + first + tok.encode(" And then")
    outs = eng.generate_sync([Request("f", follow, greedy(4))])["f"]
    assert outs[-1].usage.cached_tokens == (len(prompt) + len(first) - 1) // 16 * 16
    ref = make_engine()
    assert ([t for o in outs for t in o.token_ids]
            == [t for o in ref.generate_sync([Request("f", follow, greedy(4))])["f"] for t in o.token_ids])
    eng.manager.check_integrity()


def test_overlap_arrivals_and_aborts_between_steps(make_engine, alone):
    """A request added while a step is in flight, and one aborted while its row is in flight."""
    eng = make_engine(max_batch=8, overlap="on")
    tok = eng.tokenizer
    eng.add_request(Request("a", tok.encode(PROMPTS[0]), greedy()))
    eng.add_request(Request("x", tok.encode(PROMPTS[2]), greedy(50)))
    got: dict[str, list] = {"a": [], "b": [], "x": []}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].append(o)
        steps += 1
        if steps == 4:
            eng.add_request(Request("b", tok.encode(PROMPTS[4]), greedy()))
        if steps == 7:
            assert eng._inflight is not None
            out = eng.abort("x")
            got["x"].append(out)
    assert [t for o in got["a"] for t in o.token_ids] == alone[0]
    assert [t for o in got["b"] for t in o.token_ids] == alone[4]
    x = got["x"]
    assert x[-1].finish_reason == "abort"
    assert x[-1].usage.completion_tokens == sum(len(o.token_ids) for o in x)
    assert eng.overlap_steps > 0
    eng.manager.check_integrity()


def test_overlap_sampling_and_penalties(make_engine):
    """Seeded sampling chains and equals the synchronous loop; rows with penalties (which read the
    token history) never chain and equal it too."""
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12)
    pen = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3)
    prompts = PROMPTS[:3]
    for params, chains in ((seeded, True), (pen, False)):
        ref = outputs(make_engine(max_batch=4), prompts, params)
        eng = make_engine(max_batch=4, overlap="on")
        assert outputs(eng, prompts, params) == ref
        assert (eng.overlap_steps > 0) == chains
