"""RMSNorm, numerically matching Hugging Face's LlamaRMSNorm / Qwen2RMSNorm."""

from __future__ import annotations

import torch

from kvtier.kernels import fused


class RMSNorm(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistics in fp32.

    Like HF, the normalised value is cast back to the input dtype before the
    weight multiply, so bf16 results round the same way as the reference.
    On CUDA one fused Triton kernel (kernels/fused.py) does it with the same
    roundings; on CPU, for the fp32 residual rows, a C++ kernel (kernels/cpu_ops.py);
    elsewhere the plain-PyTorch reference runs.
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)  # [D]
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: [..., D] -> [..., D], cast to out_dtype if given (the CPU kernel casts as it writes)."""
        return fused.apply_rms_norm(x, self.weight, self.eps, out_dtype)
