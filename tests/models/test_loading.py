"""load_checkpoint: GGUF and safetensors tensors equal the Hugging Face reference, errors are clear."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from kvtier.models.loading import Checkpoint, ModelFileError, load_checkpoint
from kvtier.models.loading.gguf import unpermute_qk

from .gguf_factory import llamacpp_permute, random_tensors, tiny_hf_model, write_gguf

Q = GGMLQuantizationType


def _assert_same_tensors(ckpt: Checkpoint, ref: dict[str, torch.Tensor]) -> None:
    assert set(ckpt.tensors) == set(ref)
    for name, t in ref.items():
        assert ckpt.tensors[name].shape == t.shape, name
        assert torch.equal(ckpt.tensors[name], t.float()), name


def test_smollm2_matches_transformers(smollm2_path: Path) -> None:
    """Every tensor of the real Q4_1/Q8_0 SmolLM2 GGUF equals transformers' own GGUF loading."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ckpt = load_checkpoint(smollm2_path)
    config = AutoConfig.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    ref = load_gguf_checkpoint(str(smollm2_path), return_tensors=True, model_to_load=meta_model)["tensors"]
    _assert_same_tensors(ckpt, {k: torch.as_tensor(v) for k, v in ref.items()})
    s = ckpt.spec
    assert (s.arch, s.vocab_size, s.hidden_size, s.num_layers) == ("llama", config.vocab_size,
                                                                    config.hidden_size, config.num_hidden_layers)
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size) == (
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size)
    assert s.tie_word_embeddings and "lm_head.weight" not in ckpt.tensors
    assert s.rope_theta == pytest.approx(config.rope_parameters["rope_theta"])
    assert s.max_position_embeddings == config.max_position_embeddings == 8192
    assert ckpt.format == "gguf" and ckpt.metadata["tensor_types"]["model.embed_tokens.weight"] == "Q8_0"


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_gguf_roundtrip_from_hf(tmp_path: Path, arch: str, tied: bool) -> None:
    """HF weights written the way llama.cpp converts them (llama q/k permuted) load back unchanged."""
    model, cfg = tiny_hf_model(arch, tied=tied)
    ref = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", arch, cfg, ref))
    _assert_same_tensors(ckpt, ref)
    c = model.config
    s = ckpt.spec
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads) == (
        c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads)
    assert s.head_dim == getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    assert s.vocab_size == c.vocab_size and s.tie_word_embeddings == tied
    assert s.attention_bias == (arch == "qwen2") and s.qk_norm == (arch == "qwen3")


def test_unpermute_inverts_llamacpp_permute() -> None:
    w = torch.randn(4 * 16, 8)
    for heads in (4, 2):
        back = unpermute_qk(torch.from_numpy(llamacpp_permute(w.numpy(), heads, heads)), heads)
        assert torch.equal(back, w)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0])
def test_quantized_gguf_dequantizes(tmp_path: Path, qtype: Q) -> None:
    """Quantized weights load as gguf's reference dequantization and stay close to the originals."""
    model, cfg = tiny_hf_model("qwen2")
    sd = model.state_dict()
    ckpt = load_checkpoint(write_gguf(tmp_path / "q.gguf", "qwen2", cfg, sd, qtype=qtype))
    for name, t in sd.items():
        a = t.float().numpy()
        want = a if a.ndim == 1 else (
            a.astype(np.float16).astype(np.float32) if qtype == Q.F16
            else gguf_quants.dequantize(gguf_quants.quantize(a, qtype), qtype))
        np.testing.assert_array_equal(ckpt.tensors[name].numpy(), want, err_msg=name)
        # 4-bit quants keep ~1/16 of the range; this catches layout bugs, not rounding.
        assert float((ckpt.tensors[name] - t).abs().max()) <= 0.2 * float(t.abs().max()) + 1e-6, name


# Dims that are whole K-quant super-blocks (256 values per block).
K_CFG = dict(hidden=256, layers=1, heads=4, kv_heads=2, ffn=256, ctx=128, rope_theta=10000.0, eps=1e-5)
# Byte offsets of the f16 scale fields inside one block of each K-quant.
K_SCALE_OFFSETS = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def _random_k_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random K-quant bytes [rows, row_bytes] whose f16 scales are small and finite."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    for off in K_SCALE_OFFSETS[qtype]:
        raw[..., off] = rng.integers(0, 256, size=raw.shape[:2])
        raw[..., off + 1] = 0x20 + rng.integers(0, 16, size=raw.shape[:2])  # halves in [2^-7, 2^-4)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_dequantize(tmp_path: Path, qtype: Q) -> None:
    """K-quant weights load exactly as gguf.quants.dequantize decodes them, in HF [out, in] layout."""
    from kvtier.config import ModelSpec
    from kvtier.models.registry import expected_shapes

    spec = ModelSpec("qwen2", 96, 256, 256, 1, 4, 2, 64, attention_bias=True)
    tensors = random_tensors(expected_shapes(spec))
    raw = {"model.layers.0.mlp.up_proj.weight": (_random_k_blocks(qtype, 256, 256), qtype),
           "model.layers.0.self_attn.k_proj.weight": (_random_k_blocks(qtype, 128, 256, seed=1), qtype)}
    ckpt = load_checkpoint(write_gguf(tmp_path / "k.gguf", "qwen2", K_CFG, tensors, raw=raw))
    for name, (data, _) in raw.items():
        want = gguf_quants.dequantize(data, qtype)
        assert want.shape == tuple(tensors[name].shape) and np.isfinite(want).all()
        np.testing.assert_array_equal(ckpt.tensors[name].numpy(), want, err_msg=name)
    assert ckpt.metadata["tensor_types"]["model.layers.0.mlp.up_proj.weight"] == qtype.name


def test_dtype_conversion(tmp_path: Path) -> None:
    model, cfg = tiny_hf_model("qwen3")
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", "qwen3", cfg, model.state_dict()), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ckpt.tensors.values())


# ---- safetensors directories ----

@pytest.mark.parametrize("arch,tied,shard", [("llama", False, "20KB"), ("qwen2", True, None), ("qwen3", False, "30KB")])
def test_safetensors_dir_matches_hf(tmp_path: Path, arch: str, tied: bool, shard: str | None) -> None:
    model, _ = tiny_hf_model(arch, tied=tied)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kw)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    ckpt = load_checkpoint(tmp_path)
    ref = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    _assert_same_tensors(ckpt, ref)
    assert ckpt.format == "safetensors" and ckpt.spec.arch == arch and ckpt.spec.tie_word_embeddings == tied
    assert ckpt.spec.rope_theta == pytest.approx(model.config.rope_parameters["rope_theta"])
    assert ckpt.spec.head_dim == getattr(model.config, "head_dim", 16)


def _one_line_naming(err: pytest.ExceptionInfo, path: Path, *words: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, msg


def test_safetensors_config_errors(tmp_path: Path) -> None:
    model, _ = tiny_hf_model("llama")
    model.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text("{not json")
    with pytest.raises(ModelFileError) as e:
        load_checkpoint(tmp_path)
    _one_line_naming(e, cfg_path, "not valid JSON")
    cfg_path.write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(ModelFileError) as e:
        load_checkpoint(tmp_path)
    _one_line_naming(e, cfg_path, "unknown architecture", "gpt_neox", "llama")
    cfg_path.write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    with pytest.raises(ModelFileError) as e:
        load_checkpoint(tmp_path)
    _one_line_naming(e, cfg_path, "hidden_size")
    cfg_path.write_text(json.dumps({**cfg, "intermediate_size": 100}))
    with pytest.raises(ModelFileError) as e:
        load_checkpoint(tmp_path)
    _one_line_naming(e, tmp_path, "shape mismatch", "mlp")
    cfg_path.unlink()
    with pytest.raises(ModelFileError) as e:
        load_checkpoint(tmp_path)
    _one_line_naming(e, cfg_path, "config.json missing")


def test_safetensors_truncated(tmp_path: Path) -> None:
    model, _ = tiny_hf_model("qwen2")
    model.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ModelFileError) as e:
        load_checkpoint(tmp_path)
    _one_line_naming(e, f, "truncated")


# ---- GGUF content errors (header damage is covered in test_inspect.py) ----

def test_gguf_missing_tensor_and_shape_mismatch(tmp_path: Path) -> None:
    model, cfg = tiny_hf_model("llama")
    sd = dict(model.state_dict())
    sd.pop("model.layers.1.mlp.up_proj.weight")
    p = write_gguf(tmp_path / "missing.gguf", "llama", cfg, sd)
    with pytest.raises(ModelFileError) as e:
        load_checkpoint(p)
    _one_line_naming(e, p, "missing tensor", "model.layers.1.mlp.up_proj.weight")
    p = write_gguf(tmp_path / "shape.gguf", "llama", {**cfg, "ffn": 128}, model.state_dict())
    with pytest.raises(ModelFileError) as e:
        load_checkpoint(p)
    _one_line_naming(e, p, "shape mismatch", "mlp")


def test_gguf_unsupported_quant_type(tmp_path: Path) -> None:
    """A type gguf knows but we do not dequantize (IQ2_XXS) is refused by name at load."""
    from kvtier.config import ModelSpec
    from kvtier.models.registry import expected_shapes

    spec = ModelSpec("qwen2", 96, 256, 256, 1, 4, 2, 64, attention_bias=True)
    _, type_size = GGML_QUANT_SIZES[Q.IQ2_XXS]
    name = "model.layers.0.mlp.gate_proj.weight"
    raw = {name: (np.zeros((256, type_size), dtype=np.uint8), Q.IQ2_XXS)}  # one 256-value block per row
    p = write_gguf(tmp_path / "iq.gguf", "qwen2", K_CFG, random_tensors(expected_shapes(spec)), raw=raw)
    with pytest.raises(ModelFileError) as e:
        load_checkpoint(p)
    _one_line_naming(e, p, "unsupported quant type IQ2_XXS", "blk.0.ffn_gate.weight")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError) as e:
        load_checkpoint(tmp_path / "nope.gguf")
    _one_line_naming(e, tmp_path / "nope.gguf", "not found")
