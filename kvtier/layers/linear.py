"""Dense linear layers; several projections that read the same input are fused into one matmul.

Decode on CPU is bound by reading the weights: one token reads every matrix
once. `Linear.enable_int8_gemv()` adds a weight-only int8 copy (one scale per
output row) that small batches (<= INT8_GEMV_MAX_ROWS rows) multiply with
torch's `_weight_int8pack_mm` (VNNI/AMX kernels, bf16 activations): half the
bytes of bf16 and measured 2.5x faster at one row. Larger batches (prefill)
keep the dense bf16 GEMM, which AMX makes far faster than the int8 kernel
there (see docs/benchmarks.md for the crossover).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Largest row count that takes the int8 weight-only kernel (measured crossover
# on a 2-core Sapphire Rapids: int8 wins at 1-4 rows, bf16 AMX GEMM from 8).
INT8_GEMV_MAX_ROWS = 4
INT8_MAX = 127


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
        self.register_buffer("qscale", None, persistent=False)  # [out]

    def enable_int8_gemv(self) -> None:
        """Keep an int8 copy of the weight for small batches (see module doc)."""
        if not int8_gemv_supported(self.weight.device, self.weight.dtype):
            raise ValueError(f"int8 GEMV needs bf16 weights on CPU, not {self.weight.dtype} on "
                             f"{self.weight.device.type}")
        q, s = quantize_rows_int8(self.weight.data)
        self.qweight, self.qscale = q, s

    def _uses_int8(self, x: torch.Tensor) -> bool:
        return self.qweight is not None and x.shape[0] <= INT8_GEMV_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]"""
        if self._uses_int8(x):
            y = torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.qscale)
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ W^T (+ b) in one GEMM call. residual: [T, out], x: [T, in] -> [T, out]"""
        if self._uses_int8(x):
            return self.forward(x).add_(residual)
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)

    def decode_bytes(self) -> int:
        """Bytes one small-batch step reads from this layer's weights."""
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
