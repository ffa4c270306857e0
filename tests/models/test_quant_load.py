"""Models loaded with quantized weights (GGUF as stored, safetensors re-rounded) against their dense twins.

The strongest check: a GGUF loaded as stored (QuantWeight, one copy) and run in fp32 (QuantRef:
dequantize on use) gives the same logits as the same file dequantized to dense fp32, for every
layout the loader repacks, llama's q/k row permutation included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvtier.layers.qlinear import FusedParts, Int4PackCPU, Int8RowsCPU, Int8SplitCPU, QuantLinear, QuantRef, VNNIWeight
from kvtier.layers.qweight import QuantWeight, quantize_rtn
from kvtier.models.decoder import Decoder
from kvtier.models.loading import load_checkpoint

from .gguf_factory import tiny_hf_model, write_gguf

IDS = torch.tensor([3, 17, 42, 5, 77, 1, 9, 60])


def logits(model: Decoder) -> torch.Tensor:
    """Logits of every position of IDS in one prefill (the dense attention reference)."""
    from tests.models.test_hf_equivalence import PagedHarness

    h = PagedHarness(model, num_pages=8, page_size=16, dtype=model.dtype)
    return h.step([(0, IDS.tolist())])[0].float()


@pytest.mark.parametrize("arch,qtype", [("llama", Q.Q4_0), ("llama", Q.Q8_0), ("qwen2", Q.Q4_1),
                                        ("qwen2", Q.Q5_0), ("qwen3", Q.Q5_1)])
def test_stored_gguf_equals_dense(tmp_path: Path, arch: str, qtype: Q) -> None:
    model, cfg = tiny_hf_model(arch, tied=arch == "qwen2")
    path = write_gguf(tmp_path / "m.gguf", arch, cfg, model.state_dict(), qtype=qtype)
    dense = load_checkpoint(path)
    stored = load_checkpoint(path, weights="stored")
    quant = [n for n, t in stored.tensors.items() if isinstance(t, QuantWeight)]
    assert "model.layers.0.self_attn.q_proj.weight" in quant and "model.embed_tokens.weight" in quant
    for n in quant:  # each QuantWeight is exactly the dequantized tensor (q/k rows un-permuted)
        assert torch.equal(stored.tensors[n].dequantize(), dense.tensors[n]), n
    ref = Decoder.from_tensors(dense.spec, dense.tensors, torch.float32, "cpu")
    net = Decoder.from_tensors(stored.spec, stored.tensors, torch.float32, "cpu", consume=True)
    assert not stored.tensors  # consumed
    assert all(isinstance(m.weight, QuantRef) for m in net.modules() if isinstance(m, QuantLinear))
    torch.testing.assert_close(logits(net), logits(ref), rtol=1e-4, atol=1e-4)


# CPU packings: every 4- and 8-bit matrix in the VNNI kernel's layout where this CPU runs it;
# elsewhere torch's int4pack, 8-bit codes split in two int4pack halves, 5-bit codes per-row int8
VNNI = VNNIWeight.supports(64, 32)
FOUR_BIT = VNNIWeight if VNNI else Int4PackCPU
EIGHT_BIT = VNNIWeight if VNNI else Int8SplitCPU
FIVE_BIT = VNNIWeight if VNNI else Int8RowsCPU


def test_stored_gguf_bf16_cpu_packings(tmp_path: Path) -> None:
    """bf16 on CPU: 4-bit matmuls as FOUR_BIT, 8-bit codes as EIGHT_BIT, 5-bit codes (Q5_0) as
    FIVE_BIT; one copy."""
    model, cfg = tiny_hf_model("qwen2")
    sd = model.state_dict()
    path = write_gguf(tmp_path / "m.gguf", "qwen2", cfg, sd, qtype=Q.Q4_1)
    stored = load_checkpoint(path, torch.bfloat16, weights="stored")
    stored.tensors["lm_head.weight"] = quantize_rtn(sd["lm_head.weight"], 8)
    stored.tensors["model.layers.0.self_attn.v_proj.weight"] = quantize_rtn(
        sd["model.layers.0.self_attn.v_proj.weight"], 8)
    stored.tensors["model.layers.1.mlp.down_proj.weight"] = five_bit(sd["model.layers.1.mlp.down_proj.weight"])
    dense = {n: (t.dequantize() if isinstance(t, QuantWeight) else t) for n, t in stored.tensors.items()}
    net = Decoder.from_tensors(stored.spec, stored.tensors, torch.bfloat16, "cpu", consume=True)
    assert isinstance(net.layers[1].qkv.weight, FOUR_BIT)
    assert isinstance(net.layers[0].qkv, FusedParts)  # q, k 4-bit fused; v 8-bit on its own
    assert [type(p.weight) for p in net.layers[0].qkv.parts] == [FOUR_BIT, EIGHT_BIT]
    assert isinstance(net.layers[1].mlp.down.weight, FIVE_BIT)
    assert isinstance(net.head.weight, EIGHT_BIT)
    ref = Decoder.from_tensors(stored.spec, dense, torch.float32, "cpu")
    got, want = logits(net), logits(ref)
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def five_bit(w: torch.Tensor, group: int = 32) -> QuantWeight:
    """w [N, K] as 8-bit codes of -16..15 with fp16 group scales (a GGUF Q5_0 tensor's QuantWeight)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    scale = (g.abs().amax(-1) / 16).clamp_min(1e-8).half()
    q = torch.round(g / scale.float()[..., None]).clamp_(-16, 15)
    return QuantWeight(8, group, q.reshape(n, k).to(torch.int8), scale, None)


@pytest.mark.parametrize("weights,bits", [("int8", 8), ("int4", 4)])
def test_safetensors_quantized_at_load(tmp_path: Path, weights: str, bits: int) -> None:
    model, _ = tiny_hf_model("qwen3")
    model.save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path, weights=weights)
    q = ckpt.tensors["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(q, QuantWeight) and q.bits == bits
    assert not isinstance(ckpt.tensors["model.layers.1.input_layernorm.weight"], QuantWeight)
    ref_w = model.state_dict()["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(q.dequantize(), quantize_rtn(ref_w, bits).dequantize())
    net = Decoder.from_tensors(ckpt.spec, ckpt.tensors, torch.float32, "cpu")
    dense = load_checkpoint(tmp_path)
    ref = Decoder.from_tensors(dense.spec, dense.tensors, torch.float32, "cpu")
    got, want = logits(net), logits(ref)
    tol = 0.02 if bits == 8 else 0.3
    assert float((got - want).abs().max()) < tol * float(want.abs().max())


def test_int4pack_rows_match_torch_packer() -> None:
    from kvtier.layers.qlinear import int4pack_rows
    from kvtier.layers.qweight import pack_int4

    g = torch.Generator().manual_seed(0)
    for n, k in ((128, 64), (96, 64), (200, 256)):
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        padded = torch.zeros(-(-n // 64) * 64, k, dtype=torch.int32)
        padded[:n] = q
        assert torch.equal(int4pack_rows(pack_int4(q)), torch._convert_weight_to_int4pack_for_cpu(padded, 1))


QUANT_CASES = {  # name -> (QuantWeight of w [200, 160], packing it gets on CPU bf16)
    "int4": (lambda w: quantize_rtn(w, 4, 32), FOUR_BIT),
    "int8": (lambda w: quantize_rtn(w, 8, 32), EIGHT_BIT),
    "int8-group16": (lambda w: quantize_rtn(w, 8, 16), EIGHT_BIT),
    "5-bit": (five_bit, FIVE_BIT),
    # the packings of CPUs without AVX512-VNNI (VNNIWeight.supports patched off)
    "int4pack": (lambda w: quantize_rtn(w, 4, 32), Int4PackCPU),
    "int8-split": (lambda w: quantize_rtn(w, 8, 32), Int8SplitCPU),
    "5-bit-rows": (five_bit, Int8RowsCPU),
}


@pytest.mark.parametrize("rows", [1, 3, 9, 2000])
@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_quant_linear_cpu_matches_dequantized(rows: int, case: str, monkeypatch) -> None:
    """forward / add_to / rows of each CPU packing against x @ dequant(W)^T; 2000 rows take the
    dequantize + GEMM path (chunked over N through a small scratch)."""
    import kvtier.layers.qlinear as ql

    monkeypatch.setattr(ql, "CPU_SCRATCH_ELEMS", 64 * 160)  # several chunks of 64 rows
    g = torch.Generator().manual_seed(rows * 10 + len(case))
    w = torch.randn(200, 160, generator=g) * 0.05
    w[:, 7] *= 30  # an outlier input column, as Qwen's
    make, packing = QUANT_CASES[case]
    if packing is not VNNIWeight:
        monkeypatch.setattr(ql.VNNIWeight, "supports", staticmethod(lambda k, group, bits=4: False))
    qw = make(w)
    bias = torch.randn(200, generator=g)
    lin = QuantLinear(qw, bias, torch.bfloat16)
    assert isinstance(lin.weight, packing)
    x = torch.randn(rows, 160, generator=g).bfloat16()
    res = torch.randn(rows, 200, generator=g).bfloat16()
    ref = x.float() @ qw.dequantize().t() + bias.float()
    # exact packings (int4pack, split): bf16 scale rounding only (the group-16 split re-rounds to
    # 32 wide groups, the 5-bit per-row int8 to 127 levels a row: both within a small share)
    tol = 2e-2
    assert float((lin(x).float() - ref).abs().max()) <= tol * float(ref.abs().max())
    assert float((lin.add_to(res, x).float() - ref - res.float()).abs().max()) <= tol * float(ref.abs().max()) + 0.05
    idx = torch.tensor([0, 63, 64, 199])
    assert float((lin.rows(idx).float() - qw.dequantize()[idx]).abs().max()) <= 2e-2 * float(w.abs().max())


def test_split_is_exact_in_the_codes() -> None:
    """Int8SplitCPU holds an 8-bit QuantWeight as q * bf16(s) + bf16(m): the codes untouched, only
    the group scale and min rounded to bf16 (what the two int4pack halves sum to)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(130, 96, generator=g)
    qw = quantize_rtn(w, 8, 32)
    qw.mins = (torch.randn(130, 3, generator=g) * 0.1).half()
    split = Int8SplitCPU(qw)
    want = (qw.codes().float().view(130, 3, 32) * qw.scales.bfloat16().float()[..., None]
            + qw.mins.bfloat16().float()[..., None]).view(130, 96)
    got = split.rows(torch.arange(130), torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    out = torch.empty(130, 96)
    split.dequantize_into(0, 130, out)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
