"""Random-weight models of real shapes, for benchmarks on hardware without the real files.

The same random weights go to HF transformers and to kvtier, so the two are
compared on identical work (and their greedy tokens can be checked equal).
"""

from __future__ import annotations

import torch

from kvtier.models.shapes import SHAPES

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
