from __future__ import annotations

import pytest
import torch

from kvtier.config import CacheConfig, EngineConfig


@pytest.fixture(scope="session")
def smol_parts(smollm2_path):
    """(Decoder, Tokenizer, spec) for the real SmolLM2 GGUF, loaded once."""
    from kvtier.models.decoder import Decoder
    from kvtier.models.loading import load_checkpoint
    from kvtier.models.tokenizer import Tokenizer

    ckpt = load_checkpoint(smollm2_path)
    model = Decoder.from_tensors(ckpt.spec, ckpt.tensors, dtype=torch.float32, device="cpu")
    return model, Tokenizer.from_checkpoint(ckpt)


@pytest.fixture
def make_engine(smol_parts):
    from kvtier.engine.engine import Engine

    model, tok = smol_parts

    def make(**cache_kw) -> Engine:
        eng_kw = {k: cache_kw.pop(k) for k in ("max_batch", "prefill_chunk", "overlap") if k in cache_kw}
        cfg = EngineConfig(device="cpu", dtype="fp32",
                           cache=CacheConfig(**{"num_pages": 256, "page_size": 16, **cache_kw}), **eng_kw)
        return Engine(model, tok, cfg, model_name="smollm2-135m")

    return make
