"""Dense linear layers; several projections that read the same input are fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear(torch.nn.Module):
    """y = x @ W^T + b with W: [out, in] (the HF / GGUF-dequantised layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)  # [out, in]
        self.bias = None if bias is None else torch.nn.Parameter(bias.contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]"""
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ W^T (+ b) in one GEMM call. residual: [T, out], x: [T, in] -> [T, out]"""
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)


class FusedLinear(Linear):
    """Several projections of one input in one matmul; `forward` returns the concatenated output.

    `split_sizes` are the output widths of the parts, in the order they were stacked.
    """

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None):
        bias = None if biases is None else torch.cat(biases, dim=0)
        super().__init__(torch.cat(weights, dim=0), bias)
        self.split_sizes = [int(w.shape[0]) for w in weights]
