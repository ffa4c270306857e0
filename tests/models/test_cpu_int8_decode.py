"""The CPU default (bf16 activations, int8 / int4 decode weights) stays close to the fp32 reference on SmolLM2.

Teacher-forced decode, one token per step so every matmul takes the int8 path:
next-token distributions against fp32 dense weights on the same real model.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.layers.linear import int8_gemv_supported
from tests.models.test_hf_equivalence import PagedHarness

pytestmark = pytest.mark.skipif(not int8_gemv_supported(torch.device("cpu"), torch.bfloat16),
                                reason="torch build has no CPU int8 weight-only kernel")

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, "
        "presses had spread to more than two hundred cities across Europe, and the price of books fell "
        "so far that ordinary merchants could afford them.")
STEPS = 48
# bf16 activations + per-row int8 weights against fp32 (the source GGUF is Q4_1): loose but real bounds.
MAX_MEAN_KL = 0.05
MIN_TOP1_AGREEMENT = 0.85


def teacher_forced_logprobs(model, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    h = PagedHarness(model, num_pages=32, page_size=16, dtype=dtype)
    out = [h.step([(0, ids[:8])], last_only=True)[0][-1]]
    for t in ids[8:8 + STEPS - 1]:
        out.append(h.step([(0, [t])], last_only=True)[0][-1])
    return torch.log_softmax(torch.stack(out).float(), dim=-1)  # [STEPS, V]


@pytest.fixture(scope="module")
def smol(smollm2_path):
    """(checkpoint, fp32 reference Decoder, token ids, reference log-probs), built once."""
    from kvtier.models.decoder import Decoder
    from kvtier.models.loading import load_checkpoint
    from kvtier.models.tokenizer import Tokenizer

    ckpt = load_checkpoint(smollm2_path)
    ref_model = Decoder.from_tensors(ckpt.spec, ckpt.tensors, torch.float32, "cpu")
    ids = Tokenizer.from_checkpoint(ckpt).encode(TEXT)
    assert len(ids) >= 8 + STEPS
    return ckpt, ref_model, ids, teacher_forced_logprobs(ref_model, ids, torch.float32)


@pytest.mark.parametrize("mode", ["int8", "int4-where-q4"])
def test_int8_decode_close_to_fp32(smol, mode):
    from kvtier.models.decoder import Decoder

    ckpt, ref_model, ids, ref = smol
    fast = Decoder.from_tensors(ckpt.spec, ckpt.tensors, torch.bfloat16, "cpu")
    # int4-where-q4: the checkpoint's Q4_1 matmuls decode as int4 groups (the engine's CPU default)
    fast.enable_int8_gemv(ckpt.metadata["tensor_types"] if mode != "int8" else None)
    ratio = 3 if mode == "int8" else 5
    assert fast.int8_gemv and fast.decode_weight_bytes() < ref_model.decode_weight_bytes() / ratio
    got = teacher_forced_logprobs(fast, ids, torch.bfloat16)
    kl = (ref.exp() * (ref - got)).sum(-1)  # KL(ref || fast) per position
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    print(f"{mode}: mean KL {float(kl.mean()):.4f}, top-1 agreement {float(agree):.3f}")
    assert float(kl.mean()) <= MAX_MEAN_KL, float(kl.mean())
    assert float(agree) >= MIN_TOP1_AGREEMENT, float(agree)
