"""Dense linear layers; several projections that read the same input are fused into one matmul.

Decode on CPU is bound by reading the weights: one token reads every matrix
once. `Linear.enable_int8_gemv()` adds a weight-only int8 copy (one scale per
output row) that small batches (<= INT8_GEMV_MAX_ROWS rows) multiply with
torch's `_weight_int8pack_mm` (VNNI/AMX kernels, bf16 activations): half the
bytes of bf16 and measured 2.5x faster at one row. `enable_int4_gemv()` keeps
group-wise int4 instead (`_weight_int4pack_mm_for_cpu`, a quarter of the
bytes), used where the checkpoint's tensor is already 4-bit (GGUF Q4_*), so
nothing is lost that the file had; on AVX512-VNNI CPUs it is held in the layout of
kernels/cpu_ops.py's qv kernel (layers/qlinear.py VNNIWeight), else in torch's int4pack;
there the int8 copy is per group of 32 (fp16 scales, qv kernel) instead of per row. Larger batches (prefill)
keep the dense bf16 GEMM, which AMX makes far faster than the int8 kernel
there (see docs/benchmarks.md for the crossover).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier.layers.qlinear import VNNIWeight
from kvtier.layers.qweight import quantize_rtn

# Largest row count that takes the int8 weight-only kernel (measured crossover
# on a 2-core Sapphire Rapids: int8 wins at 1-4 rows, bf16 AMX GEMM from 8).
INT8_GEMV_MAX_ROWS = 4
INT8_MAX = 127
# int4 weights: groups of 32 input columns (the GGUF Q4 block size), torch's int4pack offset 8.
INT4_GROUP = 32
INT4_LEVELS = 15
INT4_OFFSET = 8
# GGUF quant types of 4 bits or fewer per weight: their tensors lose nothing more as int4 groups.
FOUR_BIT_SOURCES = frozenset({"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K"})


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: weight [out, in] ~= q [out, in] * scale [out, 1].

    Returns (q int8 [out, in], scale [out] in the weight's dtype). Rows of zeros
    get scale 1 so nothing divides by zero.
    """
    w = weight.float()
    amax = w.abs().amax(dim=1)  # [out]
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.to(weight.dtype)


def quantize_groups_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` input columns, in torch's int4pack convention:
    weight ~= (q - 8) * scale + zero, q in 0..15.

    A group that came from a GGUF Q4_0/Q4_1/Q4_K block spanning its full 0..15 range is
    reproduced exactly (up to the bf16 scale): min/max give back the block's own step.
    Returns (q int32 [out, in], scales_and_zeros [in / group, out, 2] in the weight's dtype).
    """
    out_f, in_f = weight.shape
    w = weight.float().reshape(out_f, in_f // group, group)
    lo, hi = w.amin(-1), w.amax(-1)  # [out, G]
    scale = torch.where(hi > lo, (hi - lo) / INT4_LEVELS, torch.ones_like(hi))
    scale = scale.to(weight.dtype).float()  # quantize against the scale the kernel will use
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, INT4_LEVELS)
    zero = lo + INT4_OFFSET * scale  # (q - 8) * scale + zero == q * scale + lo
    sz = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(weight.dtype)  # [G, out, 2]
    return q.reshape(out_f, in_f).to(torch.int32), sz


def int4_gemv_supported(device: torch.device, dtype: torch.dtype, in_features: int,
                        group: int = INT4_GROUP) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and in_features % group == 0
            and hasattr(torch, "_weight_int4pack_mm_for_cpu"))


def int8_gemv_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's weight-only int8 kernel: CPU with bf16 activations here."""
    return device.type == "cpu" and dtype == torch.bfloat16 and hasattr(torch, "_weight_int8pack_mm")


class Linear(torch.nn.Module):
    """y = x @ W^T + b with W: [out, in] (the HF / GGUF-dequantised layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)  # [out, in]
        self.bias = None if bias is None else torch.nn.Parameter(bias.contiguous(), requires_grad=False)
        self.register_buffer("qweight", None, persistent=False)  # int8 [out, in] (enable_int8_gemv)
        self.register_buffer("qscale", None, persistent=False)  # int8: [out]; int4: [in/group, out, 2]
        self.qgroup = 0  # int4 group size; 0 = the int8 copy (or none)
        self.qv: VNNIWeight | None = None  # the int4 / int8 copy in the VNNI kernel's layout

    def enable_int8_gemv(self) -> None:
        """Keep an int8 copy of the weight for small batches (see module doc)."""
        if not int8_gemv_supported(self.weight.device, self.weight.dtype):
            raise ValueError(f"int8 GEMV needs bf16 weights on CPU, not {self.weight.dtype} on "
                             f"{self.weight.device.type}")
        k = self.weight.shape[1]
        if VNNIWeight.supports(k, INT4_GROUP, 8):  # per group of 32, fp16 scales: finer than per row
            packed = VNNIWeight.from_qweight(quantize_rtn(self.weight.data.float(), 8, INT4_GROUP))
            if packed is not None:
                self.qv = packed
                return
        q, s = quantize_rows_int8(self.weight.data)
        self.qweight, self.qscale, self.qgroup = q, s, 0

    def enable_int4_gemv(self, group: int = INT4_GROUP) -> None:
        """Keep a group-wise int4 copy instead (for weights whose source is already 4-bit)."""
        if not int4_gemv_supported(self.weight.device, self.weight.dtype, self.weight.shape[1], group):
            raise ValueError(f"int4 GEMV needs bf16 weights on CPU with in_features % {group} == 0")
        q, sz = quantize_groups_int4(self.weight.data, group)
        if VNNIWeight.supports(q.shape[1], group, 4):  # the same codes and scales, multiplied by the VNNI kernel
            scale = sz[..., 0].t().float()
            minv = sz[..., 1].t().float() - INT4_OFFSET * scale
            packed = VNNIWeight.build(tuple(q.shape), group, 4, lambda r0, r1: (q[r0:r1], scale[r0:r1], minv[r0:r1]))
            if packed is not None:
                self.qv = packed
                return
        self.qweight = torch._convert_weight_to_int4pack_for_cpu(q, 1)  # uint8 [out, in / 2]
        self.qscale, self.qgroup = sz, group

    def _uses_quantized(self, x: torch.Tensor) -> bool:
        return (self.qv is not None or self.qweight is not None) and x.shape[0] <= INT8_GEMV_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]"""
        if self._uses_quantized(x):
            if self.qv is not None:
                y = self.qv.gemv(x)
            elif self.qgroup:
                y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.qweight, self.qgroup, self.qscale)
            else:
                y = torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.qscale)
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ W^T (+ b) in one GEMM call. residual: [T, out], x: [T, in] -> [T, out]

        On CUDA the sum is written into `residual` (the decoder's residual stream is not read
        again after this add). A residual of another dtype (the CPU fp32 stream, models/decoder.py)
        gets the product in its own dtype."""
        if self.qv is not None and self.bias is None and self._uses_quantized(x):
            return self.qv.gemv(x, residual)  # the add inside the kernel's call, in residual's dtype
        if residual.dtype != x.dtype:
            return residual + self.forward(x)
        if self._uses_quantized(x):
            return self.forward(x).add_(residual)
        if residual.is_cuda:  # in place: torch.addmm would first copy the residual (one more kernel)
            out = residual.addmm_(x, self.weight.t())
            return out if self.bias is None else out.add_(self.bias)
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)

    def decode_bytes(self) -> int:
        """Bytes one small-batch step reads from this layer's weights."""
        if self.qv is not None:
            parts = list(self.qv.buffers())
        else:
            parts = [self.qweight, self.qscale] if self.qweight is not None else [self.weight]
        if self.bias is not None:
            parts.append(self.bias)
        return sum(t.numel() * t.element_size() for t in parts)


class FusedLinear(Linear):
    """Several projections of one input in one matmul; `forward` returns the concatenated output.

    `split_sizes` are the output widths of the parts, in the order they were stacked.
    """

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None):
        bias = None if biases is None else torch.cat(biases, dim=0)
        super().__init__(torch.cat(weights, dim=0), bias)
        self.split_sizes = [int(w.shape[0]) for w in weights]
