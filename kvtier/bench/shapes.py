"""Random-weight models of real shapes, for benchmarks on hardware without the real files.

The same random weights go to HF transformers and to kvtier, so the two are
compared on identical work (and their greedy tokens can be checked equal).
"""

from __future__ import annotations

import math

import torch

from kvtier.layers.qweight import INT4_LEVELS, SCALE_DTYPE, QuantWeight
from kvtier.models.shapes import QUANT_SHAPES, SHAPES

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


def random_quant_decoder(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                         offload_layers: int = 0):
    """A kvtier Decoder of a QUANT_SHAPES shape whose matrices are random QuantWeights made on `device`
    (codes uniform, scales giving weights of std ~INIT_STD); norms 1, biases 0. No HF model.
    Each tensor is made as the build asks for it (its own seed: the same weights whatever the
    order), so with offload_layers the device never holds the streamed layers all at once."""
    from kvtier.models.decoder import Decoder
    from kvtier.models.loading.base import LazyTensors
    from kvtier.models.loading.safetensors import spec_from_config
    from kvtier.models.registry import expected_shapes

    base, bits, group = QUANT_SHAPES[name]
    spec = spec_from_config(dict(SHAPES[base]), f"<shape {name}>")
    # uniform codes 0..15 have std ~4.6 levels: the step that gives weights of std INIT_STD
    step = INIT_STD / 4.6 if bits == 4 else INIT_STD / 73.0
    shapes = expected_shapes(spec)
    index = {n: i for i, n in enumerate(shapes)}

    def make(n: str) -> torch.Tensor | QuantWeight:
        shape = shapes[n]
        if len(shape) == 1:
            return (torch.ones if "norm" in n else torch.zeros)(shape, dtype=dtype, device=device)
        g = torch.Generator(device=device).manual_seed(seed * 100_003 + index[n])
        rows, cols = shape
        if bits == 4:
            q = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, device=device, generator=g)
            mins = torch.full((rows, cols // group), -step * INT4_LEVELS / 2, dtype=SCALE_DTYPE, device=device)
        else:
            q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, device=device, generator=g)
            mins = None
        scales = torch.full((rows, cols // group), step, dtype=SCALE_DTYPE, device=device)
        return QuantWeight(bits, group, q, scales, mins)

    nbytes = {n: math.prod(s) for n, s in shapes.items()}  # read-ahead bound: about a tensor or two ahead
    tensors = LazyTensors(dict(shapes), nbytes, make, threads=1)
    return Decoder.from_tensors(spec, tensors, dtype=dtype, device=device, consume=True,
                                offload_layers=offload_layers)


def random_model(name: str, dtype: torch.dtype, device: torch.device, offload_layers: int = 0):
    """(HF model or None, kvtier Decoder) of a named shape: QUANT_SHAPES as random QuantWeights
    (no HF reference; offload_layers streamed as they are built), the others from one random HF
    model (built whole: prepare_model streams their layers afterwards)."""
    if name in QUANT_SHAPES:
        return None, random_quant_decoder(name, dtype, device, offload_layers=offload_layers)
    hf = random_hf_model(name, dtype, device)
    return hf, kvtier_from_hf(hf, dtype, device)
