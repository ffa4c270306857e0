"""Engine equivalences on the real SmolLM2 GGUF: batching, chunking, preemption,
prefix cache and host tier must not change greedy output."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtier.config import CacheConfig, EngineConfig
from kvtier.engine.engine import AsyncEngine, Engine
from kvtier.engine.request import ContextOverflowError, Request, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about",
    "1, 2, 3, 4,",
    "Explain what a KV cache is in one sentence. Be precise and brief, and do not repeat yourself.",
    "Hello",
]


def greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def run(engine, prompts, params) -> list[list[int]]:
    tok = engine.tokenizer
    reqs = [Request(f"r{i}", tok.encode(p), params) for i, p in enumerate(prompts)]
    res = engine.generate_sync(reqs)
    return [[t for o in res[r.request_id] for t in o.token_ids] for r in reqs]


@pytest.fixture(scope="module")
def alone(smol_parts):
    """Reference: each prompt alone, one-shot prefill."""
    from kvtier.config import CacheConfig, EngineConfig
    from kvtier.engine.engine import Engine

    model, tok = smol_parts
    out = []
    for p in PROMPTS:
        eng = Engine(model, tok, EngineConfig(device="cpu", dtype="fp32", prefill_chunk=4096,
                                              cache=CacheConfig(num_pages=64, enable_prefix_cache=False)))
        out.append(run(eng, [p], greedy())[0])
    return out


def test_concurrent_mixed_lengths_equal_alone(make_engine, alone):
    eng = make_engine(max_batch=8)
    assert run(eng, PROMPTS, greedy()) == alone
    eng.manager.check_integrity()


def test_chunked_prefill_equals_one_shot(make_engine, alone):
    eng = make_engine(prefill_chunk=5, enable_prefix_cache=False)
    assert run(eng, PROMPTS[:5], greedy()) == alone[:5]


def test_preemption_with_tiny_pool_equals_alone(make_engine, alone):
    eng = make_engine(num_pages=12, max_batch=8)  # 192 tokens for 8 sequences: forces preemption
    assert run(eng, PROMPTS, greedy()) == alone
    assert eng.scheduler.preemptions > 0
    eng.manager.check_integrity()


def test_prefix_hit_equals_cold(make_engine):
    eng = make_engine()
    tok = eng.tokenizer
    base = "You are a careful assistant. " * 12
    first = run(eng, [base + "Name a fruit."], greedy())[0]
    req = Request("again", tok.encode(base + "Name a fruit."), greedy())
    outs = eng.generate_sync([req])["again"]
    assert [t for o in outs for t in o.token_ids] == first
    assert outs[-1].usage.cached_tokens >= 64
    assert outs[-1].usage.computed_tokens == outs[-1].usage.prompt_tokens - outs[-1].usage.cached_tokens


def test_host_tier_forced_equals_gpu_only(make_engine, alone):
    # 4 compute pages and a host tier: finished conversations are evicted to host and hit again
    eng = make_engine(num_pages=4, host_kv_mib=64, max_batch=1)
    assert run(eng, PROMPTS, greedy()) == alone
    again = run(eng, PROMPTS, greedy())
    assert again == alone
    st = eng.manager.stats()
    assert st["swaps_out"] > 0 and st["hit_tokens_host"] > 0
    eng.manager.check_integrity()


def test_quantized_kv_host_tier_and_hits_equal_one_big_pool(make_engine):
    # int8 KV (smoothed, rotated, position-0 sink rows): conversations evicted to the host tier and
    # hit again read what one big GPU pool reads. Same batching in both, so both pools calibrate
    # their K smoothing on the same first write.
    ref = run(make_engine(kv_dtype="int8", max_batch=1), PROMPTS, greedy())
    eng = make_engine(kv_dtype="int8", num_pages=4, host_kv_mib=64, max_batch=1)
    assert run(eng, PROMPTS, greedy()) == ref
    assert eng.host_pool.sink_pages()  # first pages went down with their sink rows
    assert run(eng, PROMPTS, greedy()) == ref
    assert eng.manager.stats()["hit_tokens_host"] > 0
    for check in (eng.manager.check_integrity, eng.pool.check_integrity, eng.host_pool.check_integrity):
        check()


def test_stops_and_lengths(make_engine):
    eng = make_engine()
    tok = eng.tokenizer
    full = run(eng, ["1, 2, 3, 4,"], greedy(12))[0]
    text = tok.decode(full)
    stop = text.strip().split(",")[1].strip()  # a piece the model really produces
    req = Request("s", tok.encode("1, 2, 3, 4,"), greedy(12, stop=(stop,)))
    outs = eng.generate_sync([req])["s"]
    last = outs[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    streamed = "".join(o.text for o in outs)
    assert stop not in streamed and text.startswith(streamed)
    req = Request("l", tok.encode("Hello"), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = eng.generate_sync([req])["l"]
    assert outs[-1].finish_reason == "length" and outs[-1].usage.completion_tokens == 3


def test_context_overflow_rejected_up_front(make_engine):
    eng = make_engine()
    with pytest.raises(ContextOverflowError, match="maximum context length"):
        eng.add_request(Request("big", [1] * 10, SamplingParams(max_tokens=eng.max_model_len)))
    assert not eng.has_unfinished()


def test_prompt_past_both_kv_tiers_rejected_up_front(make_engine):
    """A prompt that the GPU pool and the host tier cannot hold together is a context overflow
    (naming the capacity) before anything is queued: it used to wait forever."""
    from kvtier.engine.request import KVCapacityError
    eng = make_engine(num_pages=4)  # 64 tokens, no host tier
    with pytest.raises(KVCapacityError, match="KV cache holds 64 tokens"):
        eng.add_request(Request("big", [1] * 65, SamplingParams(max_tokens=4)))
    assert not eng.has_unfinished()
    aeng = AsyncEngine(eng)  # the server's path: raised before any stream starts (a 400 there)

    async def first():
        async for out in aeng.generate(Request("big", [1] * 65, SamplingParams(max_tokens=4))):
            return out
    try:
        with pytest.raises(KVCapacityError):
            asyncio.run(first())
    finally:
        aeng.shutdown()
    eng = make_engine(num_pages=4, host_kv_mib=1)  # + the host tier's pages
    assert eng.manager.capacity_tokens == (4 + eng.manager.num_host_pages) * 16 > 64
    eng.add_request(Request("fits", [1] * 65, SamplingParams(max_tokens=2)))
    assert eng.has_unfinished()


def test_generation_that_fills_the_kv_cache_ends_with_length(make_engine):
    """A sequence whose prompt fits but whose generation runs past every page finishes with
    "length" when it has filled the cache, with what it generated so far (it used to spin)."""
    eng = make_engine(num_pages=4)  # 64 tokens
    req = Request("long", eng.tokenizer.encode("1, 2, 3, 4,"), SamplingParams(temperature=0, max_tokens=200,
                                                                              ignore_eos=True))
    eng.add_request(req)
    outs = []
    for _ in range(400):
        if not eng.has_unfinished():
            break
        outs += eng.step()
    assert not eng.has_unfinished(), "the engine spun on a sequence that cannot get a page"
    last = outs[-1]
    assert last.finish_reason == "length" and last.error is None
    assert 0 < last.usage.completion_tokens and last.usage.prompt_tokens + last.usage.completion_tokens <= 65
    eng.manager.check_integrity()


def test_seeded_sampling_reproducible_across_batches(make_engine):
    eng = make_engine()
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    a = run(eng, ["Tell me a story"], p)[0]
    b = run(eng, ["Say something", "Tell me a story", "Another"], p)[1]
    assert a == b


def test_async_engine_stream_and_abort(smol_parts):
    from kvtier.config import CacheConfig, EngineConfig
    from kvtier.engine.engine import AsyncEngine, Engine

    model, tok = smol_parts
    aeng = AsyncEngine(Engine(model, tok, EngineConfig(device="cpu", cache=CacheConfig(num_pages=64))))

    async def main():
        ids = tok.encode("Count to one hundred: 1, 2, 3,")
        got = []
        gen = aeng.generate(Request("a", ids, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
        async for out in gen:
            got.append(out)
            if len(got) == 3:
                break
        await gen.aclose()
        short = [o async for o in aeng.generate(Request("b", ids, greedy(4)))]
        return got, short

    try:
        got, short = asyncio.run(main())
        assert len(got) == 3 and short[-1].finished
        for _ in range(50):
            if aeng.stats()["running"] == 0:
                break
            import time
            time.sleep(0.05)
        assert aeng.stats()["running"] == 0 and aeng.stats()["waiting"] == 0
    finally:
        aeng.shutdown()


def test_decode_steps_run_on_decode_threads(smol_parts):
    """CPU: decode-only steps switch torch to `decode_threads` (--decode-threads), prefill steps
    back to all threads."""
    model, tok = smol_parts
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cfg = EngineConfig(device="cpu", dtype="fp32", cache=CacheConfig(num_pages=64), decode_threads=1)
        eng = Engine(model, tok, cfg, model_name="smollm2-135m")
        seen = []  # (decode-only step, torch threads while it ran)
        execute = eng.runner.execute

        def spy(batch):
            seen.append((batch.num_tokens == len(batch.seqs), torch.get_num_threads()))
            return execute(batch)

        eng.runner.execute = spy
        eng.generate_sync([Request("t", tok.encode("Hello there, how are"), SamplingParams(max_tokens=4))])
        assert seen[0] == (False, 2) and len(seen) > 2 and all(n == 1 for _, n in seen[1:])
    finally:
        torch.set_num_threads(before)


def test_async_engine_start_builds_on_the_step_thread(smol_parts):
    """AsyncEngine.start runs the build on the thread that then steps the engine (CPU: one OpenMP
    team), serves requests from it, and raises a build error in the caller."""
    import threading

    model, tok = smol_parts
    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return Engine(model, tok, EngineConfig(device="cpu", dtype="fp32", cache=CacheConfig(num_pages=64)),
                      model_name="smollm2-135m")

    aeng = AsyncEngine.start(build)
    try:
        assert built_on == [aeng._thread] and aeng._thread is not threading.current_thread()

        async def one():
            req = Request("s", tok.encode("Hello"), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            return [t async for o in aeng.generate(req) for t in o.token_ids]

        assert len(asyncio.run(one())) == 3
    finally:
        aeng.shutdown()

    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.start(broken)
