"""Random-weight models of real shapes, for benchmarks on hardware without the real files.

The same random weights go to HF transformers and to kvtier, so the two are
compared on identical work (and their greedy tokens can be checked equal).
"""

from __future__ import annotations

import torch

# HF config fields of real checkpoints (from their config.json).
SHAPES: dict[str, dict] = {
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
                     tie_word_embeddings=False),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                       tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                         tie_word_embeddings=True),
    "llama-tiny": dict(model_type="llama", vocab_size=1024, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=4096, tie_word_embeddings=False),
}
# Std of the random init: small enough that activations stay finite through 36 layers in bf16.
INIT_STD = 0.02


def hf_config(name: str):
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: choose from {', '.join(SHAPES)}")
    cfg = dict(SHAPES[name])
    return AutoConfig.for_model(cfg.pop("model_type"), initializer_range=INIT_STD, **cfg)


def random_hf_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """An HF CausalLM of the named shape with random weights, on `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(name)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def kvtier_from_hf(hf_model, dtype: torch.dtype, device: torch.device):
    """Build kvtier's Decoder from an HF model's weights (HF names are kvtier's names)."""
    from kvtier.models.decoder import Decoder
    from kvtier.models.loading.safetensors import spec_from_config

    cfg = hf_model.config.to_dict()
    spec = spec_from_config(cfg, "random:" + cfg.get("model_type", "?"))
    tensors = {k: v for k, v in hf_model.state_dict().items()}
    if spec.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return Decoder.from_tensors(spec, tensors, dtype=dtype, device=device)
