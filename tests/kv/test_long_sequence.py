"""A sequence longer than the GPU pool: its oldest pages are offloaded to the host tier
and streamed through attention in chunks; greedy output equals the all-in-pool run."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import CacheConfig, EngineConfig
from kvtier.engine.request import Request, SamplingParams
from kvtier.kv.formats import make_format
from kvtier.kv.pool import PagePool
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention

TEXT = ("The history of the printing press begins in the fifteenth century, when movable type made "
        "books cheaper and faster to produce than hand-copied manuscripts. ") * 6


@pytest.fixture(scope="module")
def smol(smollm2_path):
    from kvtier.models.decoder import Decoder
    from kvtier.models.loading import load_checkpoint
    from kvtier.models.tokenizer import Tokenizer

    ckpt = load_checkpoint(smollm2_path)
    model = Decoder.from_tensors(ckpt.spec, ckpt.tensors, dtype=torch.float32, device="cpu")
    return model, Tokenizer.from_checkpoint(ckpt)


def generate(smol, prompt: list[int], kv: str, **cache_kw):
    from kvtier.engine.engine import Engine

    model, tok = smol
    cfg = EngineConfig(device="cpu", dtype="fp32", prefill_chunk=512,
                       cache=CacheConfig(page_size=16, kv_dtype=kv, **cache_kw))
    eng = Engine(model, tok, cfg, model_name="smollm2-135m")
    req = Request("long", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    outs = eng.generate_sync([req])["long"]
    eng.manager.check_integrity()
    return [t for o in outs for t in o.token_ids], eng


@pytest.mark.parametrize("kv", ["fp32", "k8v4"])
def test_sequence_longer_than_gpu_pool_equals_all_in_pool(smol, kv: str) -> None:
    prompt = smol[1].encode(TEXT)
    assert len(prompt) > 150  # GPU pool below: 96 tokens
    want, _ = generate(smol, prompt, kv, num_pages=64)  # 1024 tokens: all in the pool
    got, eng = generate(smol, prompt, kv, num_pages=6, host_kv_mib=32)  # 96 tokens of GPU pool
    assert got == want
    st = eng.manager.stats()
    assert st["offloads"] >= (len(prompt) + 8) // 16 - 6  # most pages went through the host
    assert st["host_pages_used"] == 0 and st["sequences"] == 0  # held pages released at the end


def test_streamed_attention_equals_one_pool() -> None:
    """Backend level: the same context split host/GPU at every page boundary == one pool."""
    g = torch.Generator().manual_seed(0)
    L, H, S, D, hq, ctx, n_new = 1, 2, 4, 16, 4, 23, 5
    fmt = make_format("fp32")
    k = torch.randn(ctx, H, D, generator=g)
    v = torch.randn(ctx, H, D, generator=g)
    q = torch.randn(n_new, hq, D, generator=g)
    n_pages = -(-ctx // S)
    one = PagePool(fmt, L, n_pages, H, S, D, "cpu")
    one.write(0, torch.arange(ctx), k, v)
    meta = AttentionMetadata([0, n_new], [ctx], [list(range(n_pages))],
                             torch.arange(ctx - n_new, ctx), torch.arange(n_new))
    want = DensePagedAttention(one, D ** -0.5).forward(0, q, k[-n_new:], v[-n_new:], meta)
    for n_host in range(1, (ctx - n_new) // S + 1):
        gpu, host = PagePool(fmt, L, n_pages, H, S, D, "cpu"), PagePool(fmt, L, n_pages, H, S, D, "cpu")
        host.write(0, torch.arange(n_host * S), k[:n_host * S], v[:n_host * S])
        rest = torch.arange(n_host * S, ctx - n_new)
        gpu.write(0, rest, k[rest], v[rest])
        table = [-1 - i for i in range(n_host)] + list(range(n_host, n_pages))
        m = AttentionMetadata([0, n_new], [ctx], [table], torch.arange(ctx - n_new, ctx), torch.arange(n_new))
        got = DensePagedAttention(gpu, D ** -0.5, host_store=host, stream_pages=2).forward(
            0, q, k[-n_new:], v[-n_new:], m)
        assert torch.allclose(got, want, atol=1e-5), n_host
    with pytest.raises(RuntimeError, match="host tier"):
        DensePagedAttention(gpu, D ** -0.5).forward(0, q, k[-n_new:], v[-n_new:], m)
