"""Streamed layers (layers/offload.py): weights in host RAM copied into one staging buffer before
each streamed layer runs give the same logits, bit for bit, as the model held whole. On CPU the
"host" and the device are the same memory, so this checks the mechanism (layouts, views, the copy
order across layers of different formats); tests/gpu/test_offload.py checks it on CUDA with pinned
buffers and CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from kvtier.eval.recall import _Runner
from kvtier.layers.offload import MIN_STREAM_BYTES, LayerOffload
from kvtier.models.decoder import Decoder
from kvtier.models.loading import load_checkpoint


def _build(path, dtype, weights, offload_layers=0, after=0):
    ckpt = load_checkpoint(path, dtype=dtype, weights=weights)
    net = Decoder.from_tensors(ckpt.spec, ckpt.tensors, dtype=dtype, device="cpu", consume=True,
                               offload_layers=offload_layers)
    if after:
        net.offload_last_layers(after)
    return net


def _logits(net, ids):
    runner = _Runner(net, len(ids) + 8, budget=0, selectors=[], sink=4, window=16, page_size=16, record=False)
    first = runner.prefill(ids)
    steps = [first]
    tok = int(first.argmax())
    for i in range(4):  # a few decode steps over the streamed layers too
        logits = runner.step(runner.backends["dense"], [tok], len(ids) + i)[-1]
        steps.append(logits)
        tok = int(logits.argmax())
    return torch.stack(steps)


@pytest.mark.parametrize("dtype,weights", [(torch.bfloat16, "stored"), (torch.float32, "dense")])
def test_streamed_layers_give_the_same_logits(smollm2_path, dtype, weights):
    ids = list(range(200, 300)) + list(range(5000, 5037))  # 137 tokens: prefill chunks and partial pages
    whole = _build(smollm2_path, dtype, weights)
    ref = _logits(whole, ids)
    layers = whole.spec.num_layers
    del whole
    for built, after in ((layers // 3, 0), (0, layers)):  # offloaded while built; all layers, after the build
        net = _build(smollm2_path, dtype, weights, built, after)
        off = net.offload
        assert off is not None and off.layers == list(range(layers - built - after, layers))
        staged = off.staging.untyped_storage().data_ptr()
        moved = [s for i in off.layers for s in off.slots[i]]
        assert moved and all((s.module._parameters if s.is_param else s.module._buffers)[s.name]
                             .untyped_storage().data_ptr() == staged for s in moved)
        assert net.weight_bytes()["cpu"] >= off.host_bytes() > 0
        assert torch.equal(_logits(net, ids), ref)


def test_small_tensors_stay_and_take_after_finish_refuses():
    layer = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
    big = layer[0].weight.detach().clone()
    off = LayerOffload("cpu")
    off.take(0, layer)
    off.finish()
    assert [s.name for s in off.slots[0]] == ["weight"]  # 256 KiB; the bias and norm (< 64 KiB) stay
    assert layer[0].bias.numel() * 4 < MIN_STREAM_BYTES
    off.before(0)
    assert torch.equal(layer[0].weight, big)
    with pytest.raises(RuntimeError, match="after finish"):
        off.take(1, torch.nn.Linear(256, 256))


@pytest.mark.parametrize("shape", ["llama-tiny-int4", "llama-tiny-int8"])
def test_random_quant_shape_streams_while_built(monkeypatch, shape: str):
    """bench --shape: the random QuantWeights (4- and 8-bit) are made per tensor as the build asks
    (their own seeds), so a streamed build equals the whole one."""
    import kvtier.layers.offload as offload_mod
    from kvtier.bench.shapes import random_quant_decoder

    monkeypatch.setattr(offload_mod, "MIN_STREAM_BYTES", 0)  # a tiny shape: stream every tensor
    ids = list(range(3, 40))
    whole = random_quant_decoder(shape, torch.bfloat16, torch.device("cpu"))
    streamed = random_quant_decoder(shape, torch.bfloat16, torch.device("cpu"), offload_layers=2)
    from kvtier.layers.qlinear import QuantLinear
    assert {m.weight.bits for m in whole.modules() if isinstance(m, QuantLinear)} == {int(shape[-1])}
    assert streamed.offload is not None and streamed.offload.layers == [0, 1]
    assert torch.equal(_logits(streamed, ids), _logits(whole, ids))
