"""CPU bf16 engine (fp32 residual stream, exact top logits): prompts longer than the prefill chunk
run in several steps, of which only the last samples a row."""

from __future__ import annotations

import torch

from kvtier.config import CacheConfig, EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import Request, SamplingParams
from kvtier.models.decoder import Decoder
from kvtier.models.registry import expected_shapes
from tests.engine.test_retrieval_engine import SPEC


def test_multi_chunk_prefill_in_bf16_matches_one_chunk():
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g) * 0.3 for n, s in expected_shapes(SPEC).items()}
    model = Decoder.from_tensors(SPEC, tensors, torch.bfloat16, "cpu")
    prompt = torch.randint(0, SPEC.vocab_size, (45,), generator=g).tolist()
    outs = []
    for chunk in (8, 64):
        eng = Engine(model, None, EngineConfig(device="cpu", dtype="bf16", prefill_chunk=chunk,
                                               cache=CacheConfig(num_pages=64, page_size=4)), max_model_len=256)
        res = eng.generate_sync([Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                                     ignore_eos=True))])["r"]
        outs.append([t for o in res for t in o.token_ids])
        assert eng.steps > 6 or chunk == 64
    assert len(outs[0]) == 6 and outs[0] == outs[1]
