"""Unit tests of the decoder and its layers: loading checks, rotary, norms, logits selection."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.config import ModelSpec
from kvtier.kv.formats import PlainFormat
from kvtier.kv.pool import PagePool
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention
from kvtier.layers.mlp import GatedMLP
from kvtier.layers.norm import RMSNorm
from kvtier.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq
from kvtier.models.decoder import Decoder
from kvtier.models.registry import expected_shapes

SPEC = ModelSpec(arch="qwen3", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, max_position_embeddings=16)


def random_tensors(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 0.3 for n, s in expected_shapes(spec).items()}


def run(model: Decoder, ids: list[int], want: list[int], page_size: int = 4) -> torch.Tensor:
    """One sequence, one step, pages 0..P-1 in order; logits of rows `want`."""
    layers, kv_heads, head_dim = model.kv_shape
    n_pages = (len(ids) + page_size - 1) // page_size
    pool = PagePool(PlainFormat(torch.float32), layers, n_pages, kv_heads, page_size, head_dim, "cpu")
    meta = AttentionMetadata(query_start_loc=[0, len(ids)], seq_lens=[len(ids)],
                             page_tables=[list(range(n_pages))], slot_mapping=torch.arange(len(ids)),
                             logits_indices=torch.tensor(want))
    backend = DensePagedAttention(pool, scale=head_dim ** -0.5)
    return model(torch.tensor(ids), torch.arange(len(ids)), meta, backend)


def test_kv_shape_and_dtype():
    model = Decoder.from_tensors(SPEC, random_tensors(SPEC), torch.float32, "cpu")
    assert model.kv_shape == (2, 2, 8)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="dtype"):
        Decoder.from_tensors(SPEC, random_tensors(SPEC), torch.int8, "cpu")


def test_missing_tensor_is_named():
    t = random_tensors(SPEC)
    del t["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_norm\.weight"):
        Decoder.from_tensors(SPEC, t, torch.float32, "cpu")


def test_extra_tensor_is_named():
    t = random_tensors(SPEC)
    t["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra\.weight"):
        Decoder.from_tensors(SPEC, t, torch.float32, "cpu")


def test_lm_head_of_tied_model_is_unexpected():
    tied = dataclasses.replace(SPEC, tie_word_embeddings=True)
    t = random_tensors(SPEC)  # untied: carries lm_head.weight
    with pytest.raises(ValueError, match=r"unexpected tensors: lm_head\.weight"):
        Decoder.from_tensors(tied, t, torch.float32, "cpu")


def test_misshaped_tensor_is_named():
    t = random_tensors(SPEC)
    t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(31, 32)
    with pytest.raises(ValueError, match=r"q_proj\.weight has shape \(31, 32\), expected \(32, 32\)"):
        Decoder.from_tensors(SPEC, t, torch.float32, "cpu")


def test_integer_tensor_is_refused():
    t = random_tensors(SPEC)
    t["model.norm.weight"] = torch.ones(32, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"model\.norm\.weight is torch\.int32"):
        Decoder.from_tensors(SPEC, t, torch.float32, "cpu")


def test_tied_head_shares_embedding():
    tied = dataclasses.replace(SPEC, tie_word_embeddings=True)
    t = random_tensors(tied)
    model = Decoder.from_tensors(tied, t, torch.float32, "cpu")
    assert model.head.weight.data_ptr() == model.embedding.weight.data_ptr()
    h = torch.randn(3, 32)
    assert torch.equal(model.head(h), h @ t["model.embed_tokens.weight"].T)
    assert sum(model.weight_bytes().values()) < sum(x.numel() * 4 for x in random_tensors(tied).values()) + 1024


def test_logits_only_for_selected_rows():
    model = Decoder.from_tensors(SPEC, random_tensors(SPEC), torch.float32, "cpu")
    ids = [3, 1, 4, 1, 5, 9, 2]
    full = run(model, ids, list(range(7)))
    assert full.shape == (7, 50) and full.dtype == torch.float32
    picked = run(model, ids, [6, 2])
    torch.testing.assert_close(picked, full[[6, 2]], rtol=1e-5, atol=1e-5)


def test_positions_past_max_position_embeddings_grow_the_cache():
    """max_position_embeddings is 16; 40 tokens must work and match a model built with room."""
    model = Decoder.from_tensors(SPEC, random_tensors(SPEC), torch.float32, "cpu")
    roomy = Decoder.from_tensors(dataclasses.replace(SPEC, max_position_embeddings=64), random_tensors(SPEC),
                                 torch.float32, "cpu")
    ids = list(range(40))
    torch.testing.assert_close(run(model, ids, [39]), run(roomy, ids, [39]), rtol=1e-5, atol=1e-5)
    assert model.rotary.cos.shape[0] >= 40


def test_rotary_matches_hf():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    d = 16
    rope = RotaryEmbedding(d, theta=10000.0, max_positions=8)
    pos = torch.tensor([0, 5, 11, 30])
    cos, sin_signed = rope(pos)  # grows the tables to hold position 30
    angle = pos[:, None].float() * rope_inv_freq(d, 10000.0, None)[None]  # [T, D/2]
    emb = torch.cat((angle, angle), dim=-1)[None]  # HF layout: [B, T, D]
    q, k = torch.randn(4, 3, d), torch.randn(4, 2, d)
    # HF works on [B, H, T, D]
    q_ref, k_ref = llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              emb.cos(), emb.sin())
    torch.testing.assert_close(apply_rotary(q, cos, sin_signed), q_ref[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin_signed), k_ref[0].transpose(0, 1))
    assert rope.cos.shape[0] >= 31


def test_llama3_inv_freq_matches_hf():
    utils = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    cfg = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=16, head_dim=128,
                                   rope_parameters=scaling, max_position_embeddings=131072)
    ref, attn_scale = utils.ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert attn_scale == 1.0
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, scaling), ref.float())


def test_bad_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        rope_inv_freq(8, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="missing 'low_freq_factor'"):
        rope_inv_freq(8, 10000.0, {"rope_type": "llama3", "factor": 4.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    w = 1 + 0.3 * torch.randn(24)
    ref = llama.LlamaRMSNorm(24, eps=1e-5)
    ref.weight.data.copy_(w)
    ref = ref.to(dtype)
    x = torch.randn(5, 24, dtype=dtype) * 3
    got = RMSNorm(w.to(dtype), 1e-5)(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref(x))


def test_gated_mlp_matches_reference():
    g, u, dn = torch.randn(40, 24), torch.randn(40, 24), torch.randn(24, 40)
    x = torch.randn(3, 24)
    want = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ dn.T
    torch.testing.assert_close(GatedMLP(g, u, dn)(x), want, rtol=1e-5, atol=1e-4)
