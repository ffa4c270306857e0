"""CPU checks of the weight-only quantized matmul's reference (kvtier/kernels/wq_matmul.py) and of
the QuantWeight layout it reads (kvtier/layers/qweight.py): the reference against a dense float64
computation written from the layout's definition, quantize_rtn's round trip, and wq_linear on
CPU taking the reference path. The kernels are checked in test_wq_matmul_interp.py and tests/gpu.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kvtier.kernels import wq_matmul as wq
from kvtier.layers.qweight import QuantWeight, pack_int4, quantize_rtn
from tests.layers import wq_matmul_cases as cases

# float64 sums vs the reference's fp32 ones: fp32 rounding of K = 256 products.
FP32_REL = 1e-5
LAYOUTS = [(4, 32, True), (4, 32, False), (8, 32, False), (8, 16, True), (4, 128, True)]


def dense_from_definition(w: QuantWeight) -> torch.Tensor:
    """W [N, K] float64 element by element from the layout's docstring, without QuantWeight.codes()."""
    n, k = w.shape
    q = w.qweight.to(torch.int64)
    if w.bits == 4:
        codes = torch.empty(n, k, dtype=torch.int64)
        codes[:, 0::2] = q & 0xF  # low nibble: the even column
        codes[:, 1::2] = q >> 4
    else:
        codes = q
    group = torch.arange(k) // w.group
    dense = codes.double() * w.scales.double()[:, group]
    if w.mins is not None:
        dense += w.mins.double()[:, group]
    return dense


@pytest.mark.parametrize("bits,group,mins", LAYOUTS)
@pytest.mark.parametrize("dtype", cases.DTYPES, ids=str)
def test_reference_matches_dense_float64(bits: int, group: int, mins: bool, dtype: torch.dtype) -> None:
    m, n, k = 5, 24, 256
    g = cases.gen("dense", bits, group, mins, dtype)
    w = cases.make_weight(n, k, bits, group, mins, "cpu", g)
    x, b, r = cases.make_inputs(m, n, k, dtype, True, True, True, "cpu", g)
    dense = dense_from_definition(w)
    assert torch.equal(w.dequantize(torch.float64), dense)
    want = (x.double() @ dense.t() + b.double() + r.double()).to(dtype)
    got = wq.wq_linear_reference(x, w, b, r)
    assert got.dtype == dtype and got.shape == (m, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=FP32_REL, atol=FP32_REL * float(want.abs().max()))
    else:  # both round once to dtype from sums that differ in fp32's last bits
        cases.assert_close(got, want, f"reference {dtype}")


def test_reference_without_bias_and_residual() -> None:
    g = cases.gen("plain")
    w = cases.make_weight(16, 64, 4, 32, True, "cpu", g)
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(wq.wq_linear_reference(x, w), x @ w.dequantize().t())


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 16), (8, 32), (8, 16)])
def test_quantize_rtn_round_trip(bits: int, group: int) -> None:
    n, k = 32, 256
    dense = cases.WEIGHT_STD * torch.randn(n, k, generator=cases.gen("rtn", bits, group))
    w = quantize_rtn(dense, bits, group)
    assert w.shape == (n, k) and w.bits == bits and w.group == group
    codes = w.codes()
    if bits == 4:
        assert w.qweight.shape == (n, k // 2) and w.mins is not None
        assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    else:
        assert w.qweight.shape == (n, k) and w.mins is None
        assert int(codes.abs().max()) <= 127
    # every weight within half a step (plus the fp16 rounding of the min) of its original
    step = w.scales.float().repeat_interleave(group, dim=1)
    err = (w.dequantize() - dense).abs()
    assert bool((err <= 0.5 * step * (1 + 1e-3) + 1e-4 * cases.WEIGHT_STD).all()), float((err / step).max())
    # re-quantizing the dequantized weight changes nothing
    again = quantize_rtn(w.dequantize(), bits, group)
    assert torch.equal(again.dequantize(), w.dequantize())


def test_pack_int4_nibble_order() -> None:
    codes = torch.tensor([[1, 2, 15, 0]])
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    w = QuantWeight(4, 4, packed, torch.ones(1, 1, dtype=torch.float16), None)
    assert w.codes().tolist() == codes.tolist()


def test_cpu_wq_linear_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a kernel ran on CPU")

    for name in ("wq_gemv", "wq_skinny", "wq_gemm", "wq_dequant_matmul"):
        monkeypatch.setattr(wq, name, no_kernel)
    g = cases.gen("cpu")
    w = cases.make_weight(24, 64, 4, 32, True, "cpu", g)
    for m in (1, 7, 40, 2048):
        x, b, r = cases.make_inputs(m, 24, 64, torch.bfloat16, True, True, False, "cpu", g)
        assert torch.equal(wq.wq_linear(x, w, b, r), wq.wq_linear_reference(x, w, b, r))


def test_shape_errors() -> None:
    w = cases.make_weight(24, 64, 8, 32, False, "cpu", cases.gen("err"))
    with pytest.raises(ValueError, match="x must be"):
        wq.wq_linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="bias"):
        wq.wq_linear(torch.randn(2, 64), w, bias=torch.randn(23))
    with pytest.raises(ValueError, match="residual"):
        wq.wq_linear(torch.randn(2, 64), w, residual=torch.randn(3, 24))


def test_split_k_heuristic() -> None:
    sms = 132
    # decode o_proj, 4-bit: 128 row blocks of 32 -> split to fill ~4 programs per SM
    s = wq.choose_split_k(1, 4096, 4096, 4, 32, 1, 256, sms)
    assert s > 1 and 4096 % (s * 256) == 0 and 4096 // s >= wq.MIN_SPLIT_K
    # lm_head already has thousands of row blocks; batch-32 partials would cost too much
    assert wq.choose_split_k(1, 151936, 4096, 4, 32, 1, 256, sms) == 1
    assert wq.choose_split_k(32, 4096, 4096, 4, 64, 32, 256, sms) == 1
    assert wq.fit_block_k(256, 4096, 32) == 256
    assert wq.fit_block_k(256, 96, 32) == 32 and wq.fit_block_k(64, 4096, 128) == 128


class _Capture:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kw)` records the launch instead of running it."""

    def __init__(self, kernel: object, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: tuple):  # noqa: ANN204
        return lambda *args, **kw: self.launches.append((self.kernel, args, kw))


# torch dtype -> Triton signature type of a pointer argument
_SIG = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int8: "*i8",
        torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}


def _compile_for_h200(kernel: object, args: tuple, kw: dict) -> object:
    """Compile one recorded launch for sm_90 as the JIT would specialise it (16-aligned pointers and ints)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    opts = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
    names = kernel.arg_names
    sig, attrs = {}, {}
    for i, (name, a) in enumerate(zip(names, args)):
        if isinstance(a, torch.Tensor):
            sig[name], attrs[(i,)] = _SIG[a.dtype], [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if a % 16 == 0 and name not in kernel.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for p in kernel.params[len(args):]:  # constexprs left at their defaults
        if p.is_constexpr and p.name not in kw:
            kw[p.name] = p.default
    sig.update({name: "constexpr" for name in kw})
    return triton.compile(ASTSource(kernel, sig, constexprs=kw, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=opts)


@pytest.mark.parametrize("bits,group,mins", [(4, 32, True), (8, 32, False)])
def test_default_kernels_compile_for_h200(bits: int, group: int, mins: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every default path (decode M = 1 and 32 with split-K, the GEMM, the dequantize kernel) builds
    for sm_90 on this CPU box (Triton's bundled ptxas): GPU-only compile errors show up here."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode: kernels are Python functions")
    pytest.importorskip("triton")
    launches: list = []
    for name in ("_skinny_kernel", "_reduce_kernel", "_gemm_kernel", "_dequant_kernel", "_gemv_kernel"):
        monkeypatch.setattr(wq, name, _Capture(getattr(wq, name), launches))
    w = cases.make_weight(512, 4096, bits, group, mins, "cpu", cases.gen("h200", bits))
    split = dataclasses.replace(wq.FMA_CONFIG, split_k=4)
    dot = wq.DOT_CONFIG
    monkeypatch.setattr(wq, "INTERPRETED", False)  # the inline-PTX build of wq_gemv
    for m, call in ((1, wq.wq_gemv), (1, lambda x, w: wq.wq_gemv(x, w, cfg=wq.GemvConfig(chunks=1))),
                    (1, lambda x, w: wq.wq_skinny(x, w, cfg=split)), (32, lambda x, w: wq.wq_skinny(x, w, cfg=dot)),
                    (300, wq.wq_gemm), (300, wq.wq_dequant_matmul)):
        call(torch.randn(m, 4096).to(torch.bfloat16), w)
    assert {k.fn.__name__ for k, _, _ in launches} == {"_skinny_kernel", "_reduce_kernel", "_gemm_kernel",
                                                       "_dequant_kernel", "_gemv_kernel"}
    for kernel, args, kw in launches:
        try:
            ptx = _compile_for_h200(kernel, args, dict(kw)).asm["ptx"]
        except FileNotFoundError as e:  # a Triton build without its bundled ptxas
            pytest.skip(f"no ptxas: {e}")
        if kernel.fn.__name__ in ("_gemm_kernel",) or kw.get("USE_DOT"):
            assert "wgmma" in ptx or "mma.sync" in ptx
        if kernel.fn.__name__ == "_gemv_kernel":
            assert "fma.rn.f16x2" in ptx and "ld.global.v4" in ptx
