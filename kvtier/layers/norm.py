"""RMSNorm, numerically matching Hugging Face's LlamaRMSNorm / Qwen2RMSNorm."""

from __future__ import annotations

import torch

from kvtier.kernels import fused


class RMSNorm(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistics in fp32.

    Like HF, the normalised value is cast back to the input dtype before the
    weight multiply, so bf16 results round the same way as the reference.
    On CUDA one fused Triton kernel (kernels/fused.py) does it with the same
    roundings; elsewhere the plain-PyTorch reference runs.
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)  # [D]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> [..., D]"""
        if fused.use_kernels(x, self.weight):
            return fused.rms_norm(x, self.weight, self.eps)
        return fused.rms_norm_reference(x, self.weight, self.eps)
