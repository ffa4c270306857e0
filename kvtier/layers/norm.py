"""RMSNorm, numerically matching Hugging Face's LlamaRMSNorm / Qwen2RMSNorm."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistics in fp32.

    Like HF, the normalised value is cast back to the input dtype before the
    weight multiply, so bf16 results round the same way as the reference.
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)  # [D]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> [..., D]"""
        if x.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
