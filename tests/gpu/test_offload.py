"""Streamed layers on CUDA (layers/offload.py): weights in pinned host RAM, copied into one staging
buffer before each streamed layer, give the tokens of the model held whole, in CUDA graphs and
eagerly, for dense fp32 weights and 4-bit QuantWeights (CUDA only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import kvtier.layers.offload as offload_mod  # noqa: E402
from kvtier.bench.shapes import random_quant_decoder  # noqa: E402
from kvtier.models.decoder import Decoder  # noqa: E402
from tests.gpu.test_runtime import greedy, make_engine, prompts  # noqa: E402
from tests.models.test_hf_equivalence import hf_spec_and_tensors, make_hf_model  # noqa: E402

CUDA = "cuda"


@pytest.fixture(autouse=True)
def _stream_every_tensor(monkeypatch):
    """These test models are tiny: stream every tensor of a layer, norms and biases too."""
    monkeypatch.setattr(offload_mod, "MIN_STREAM_BYTES", 0)


def _check_offloaded(model: Decoder, n: int) -> None:
    off = model.offload
    assert off is not None and off.layers == list(range(model.spec.num_layers - n, model.spec.num_layers))
    assert off.staging.is_cuda and all(f.is_pinned() for f in off.host.values())
    assert model.weight_bytes()["cpu"] >= off.host_bytes() > 0


@pytest.mark.parametrize("graphs", ["auto", "off"])
def test_streamed_dense_layers_equal_the_whole_model(tmp_path, graphs):
    hf = make_hf_model("qwen3", False, seed=5, max_position_embeddings=256)
    hf.save_pretrained(tmp_path)
    spec, tensors = hf_spec_and_tensors(tmp_path)
    whole = Decoder.from_tensors(spec, dict(tensors), torch.float32, CUDA)
    ps = prompts()
    want = greedy(make_engine(whole, graphs=graphs), ps)
    streamed = Decoder.from_tensors(spec, dict(tensors), torch.float32, CUDA, offload_layers=spec.num_layers - 1)
    _check_offloaded(streamed, spec.num_layers - 1)
    engine = make_engine(streamed, graphs=graphs)
    assert greedy(engine, ps) == want
    if graphs == "auto":
        assert engine.runner.graph_steps > 0  # the copies replayed inside the graphs


def test_streamed_int4_layers_equal_the_whole_model():
    ps = prompts(vocab=1000)
    want = greedy(make_engine(random_quant_decoder("llama-tiny-int4", torch.bfloat16, torch.device(CUDA)),
                              kv="bf16"), ps)
    model = random_quant_decoder("llama-tiny-int4", torch.bfloat16, torch.device(CUDA))
    model.offload_last_layers(model.spec.num_layers)
    _check_offloaded(model, model.spec.num_layers)
    assert greedy(make_engine(model, kv="bf16"), ps) == want
