"""CPU bf16 decode stays close to the fp32 reference on real GGUFs (issue 11: mean KL <= 1e-3).

Teacher-forced decode, one token per step so every matmul takes the small-batch kernels:
next-token distributions against fp32 dense weights (the same GGUF, dequantized) on the same
real model. Modes:
- "stored": the GGUF's own blocks in their CPU packings (layers/qlinear.py pack_for), the
  engine's CPU default for files over CPU_DENSE_AUTO_MAX_FILE;
- "default": what `--weights auto` builds on CPU for this file (engine/build.py): SmolLM2 is
  small enough to run dense bf16 with int4 / int8 decode copies;
- "int8": the dense bf16 model with per-row int8 decode copies everywhere (what a safetensors
  checkpoint gets).
All run with the CPU decoder's fp32 residual stream and its fp32 top-logit refinement
(models/decoder.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.layers.linear import int8_gemv_supported
from kvtier.layers.qlinear import QuantLinear
from tests.models.test_hf_equivalence import PagedHarness

pytestmark = pytest.mark.skipif(not int8_gemv_supported(torch.device("cpu"), torch.bfloat16),
                                reason="torch build has no CPU int8 weight-only kernel")

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, "
        "presses had spread to more than two hundred cities across Europe, and the price of books fell "
        "so far that ordinary merchants could afford them.")
STEPS = 48
# Measured (2026-12-04): SmolLM2 stored 4.7e-4, default 8.3e-4, int8 ~2e-3. The bounds leave ~20%
# for other machines' kernels; int8 re-rounds every matrix per row, its bound only catches breakage.
MAX_MEAN_KL = {"stored": 1e-3, "default": 1e-3, "int8": 0.05}
MIN_TOP1_AGREEMENT = {"stored": 0.95, "default": 0.95, "int8": 0.85}
# The stored weights are the file's 4.5-bit blocks (and the 8.5-bit head split in two 4-bit halves).
MAX_BYTES_RATIO = {"stored": 1 / 5, "int8": 1 / 3}
# Qwen2.5-Coder-0.5B: issue 11's 1e-3. Measured 4.3e-4 with every code exact (VNNIWeight: Q5_0 as
# 5-bit, Q8_0 / Q6_K as 8-bit); 1.0e-3 on CPUs without AVX512-VNNI (Q5_0 re-rounded per row).
MAX_MEAN_KL_QWEN = 1e-3
MAX_PROMPT = 8


def teacher_forced_logprobs(model, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    h = PagedHarness(model, num_pages=32, page_size=16, dtype=dtype)
    out = [h.step([(0, ids[:MAX_PROMPT])], last_only=True)[0][-1]]
    for t in ids[MAX_PROMPT:MAX_PROMPT + STEPS - 1]:
        out.append(h.step([(0, [t])], last_only=True)[0][-1])
    return torch.log_softmax(torch.stack(out).float(), dim=-1)  # [STEPS, V]


def mean_kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean over positions of KL(ref || got); both [S, V] log-probabilities."""
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def reference(path: Path):
    """(fp32 reference Decoder, token ids of TEXT, reference log-probs)."""
    from kvtier.models.decoder import Decoder
    from kvtier.models.loading import load_checkpoint
    from kvtier.models.tokenizer import Tokenizer

    ckpt = load_checkpoint(path)
    ids = Tokenizer.from_checkpoint(ckpt).encode(TEXT)
    ref_model = Decoder.from_tensors(ckpt.spec, ckpt.tensors, torch.float32, "cpu", consume=True)
    assert len(ids) >= MAX_PROMPT + STEPS
    return ref_model, ids, teacher_forced_logprobs(ref_model, ids, torch.float32)


def cpu_model(path: Path, mode: str):
    """The bf16 CPU Decoder of `mode` (module doc)."""
    from kvtier.config import EngineConfig
    from kvtier.engine.build import load_mode, prepare_model, resolve_device
    from kvtier.models.decoder import Decoder
    from kvtier.models.loading import load_checkpoint

    config = resolve_device(EngineConfig(device="cpu", dtype="bf16"))
    weights = {"stored": "stored", "int8": "dense", "default": load_mode(config, path)}[mode]
    ckpt = load_checkpoint(path, torch.bfloat16, weights=weights)
    net = Decoder.from_tensors(ckpt.spec, ckpt.tensors, torch.bfloat16, "cpu", consume=True)
    if mode == "int8":
        net.enable_int8_gemv()
    elif mode == "default":
        prepare_model(net, config, ckpt.metadata.get("tensor_types"))
    return net


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return reference(smollm2_path)


@pytest.mark.parametrize("mode", ["stored", "default", "int8"])
def test_cpu_decode_close_to_fp32(smol, smollm2_path, mode):
    ref_model, ids, ref = smol
    fast = cpu_model(smollm2_path, mode)
    if mode == "stored":
        assert any(isinstance(m, QuantLinear) for m in fast.modules())
    if mode in MAX_BYTES_RATIO:
        ratio = fast.decode_weight_bytes() / ref_model.decode_weight_bytes()
        assert ratio < MAX_BYTES_RATIO[mode], ratio
    got = teacher_forced_logprobs(fast, ids, torch.bfloat16)
    kl = mean_kl(ref, got)
    agree = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    print(f"{mode}: mean KL {kl:.2e}, top-1 agreement {agree:.3f}")
    assert kl <= MAX_MEAN_KL[mode], kl
    assert agree >= MIN_TOP1_AGREEMENT[mode], agree


@pytest.mark.slow
def test_qwen25_coder_cpu_decode_close_to_fp32(qwen_coder_05b_path):
    """The 0.5B GGUF (Q5_0 / Q8_0 / Q6_K / Q4_K) in its CPU packings, the engine's default for it."""
    ref_model, ids, ref = reference(qwen_coder_05b_path)
    del ref_model
    got = teacher_forced_logprobs(cpu_model(qwen_coder_05b_path, "default"), ids, torch.bfloat16)
    kl = mean_kl(ref, got)
    print(f"qwen2.5-coder-0.5b default: mean KL {kl:.2e}")
    assert kl <= MAX_MEAN_KL_QWEN, kl
    assert float((ref.argmax(-1) == got.argmax(-1)).float().mean()) >= 0.95
