"""K smoothing is calibrated once at engine start from a fixed text, not from traffic."""

from __future__ import annotations

import torch

from kvtier.engine.request import Request, SamplingParams
from kvtier.engine.calibrate import CALIBRATION_TOKENS, calibrate_pool, calibration_tokens
from kvtier.kv.formats import make_format
from kvtier.kv.pool import PagePool

PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,", "Once upon a time"]


def greedy_outputs(eng, order: list[int]) -> dict[int, list[int]]:
    reqs = [Request(str(i), eng.tokenizer.encode(PROMPTS[i]), SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True)) for i in order]
    outs = eng.generate_sync(reqs)
    return {int(rid): [t for o in out for t in o.token_ids] for rid, out in outs.items()}


def test_quantized_kv_does_not_depend_on_the_first_request(make_engine) -> None:
    a = make_engine(kv_dtype="int8", max_batch=1)
    shift = [t.clone() for t in a.pool.k_shift]  # fixed before any request
    assert all(s is not None for s in shift)
    first = greedy_outputs(a, [0, 1, 2, 3])
    assert all(torch.equal(x, y) for x, y in zip(shift, a.pool.k_shift))  # requests do not move them
    b = make_engine(kv_dtype="int8", max_batch=4)  # another order, all batched together
    assert greedy_outputs(b, [3, 2, 1, 0]) == first
    assert all(torch.equal(x, y) for x, y in zip(shift, b.pool.k_shift))


def test_calibration_tokens_are_fixed_prose(smol_parts) -> None:
    _, tok = smol_parts
    ids = calibration_tokens(tok, 49152)
    assert len(ids) == CALIBRATION_TOKENS and ids == calibration_tokens(tok, 49152)
    assert "Python" in tok.decode(ids) or "object" in tok.decode(ids)
    rnd = calibration_tokens(None, 1000)
    assert len(rnd) == CALIBRATION_TOKENS and max(rnd) < 1000 and rnd == calibration_tokens(None, 1000)


def test_calibrate_pool_sets_every_layer_and_writes_no_page(smol_parts) -> None:
    model, tok = smol_parts
    layers, heads, dim = model.kv_shape
    pool = PagePool(make_format("k8v4"), layers, 4, heads, 16, dim, "cpu")
    before = {name: t.clone() for name, t in pool.storage.items()}
    calibrate_pool(model, pool, calibration_tokens(tok, model.spec.vocab_size)[:64])
    assert all(s is not None and torch.isfinite(s).all() for s in pool.k_shift)
    assert all(c is not None and (c > 0).all() for c in pool.k_channel_scale)
    assert all(torch.equal(before[name], t) for name, t in pool.storage.items())
    plain = PagePool(make_format("bf16"), layers, 4, heads, 16, dim, "cpu")
    calibrate_pool(model, plain, [1, 2, 3])
    assert all(s is None for s in plain.k_shift)
