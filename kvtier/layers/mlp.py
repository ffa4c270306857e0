"""SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), gate and up fused."""

from __future__ import annotations

import torch

from kvtier.kernels import fused
from kvtier.layers.qlinear import Scratch, make_linear
from kvtier.layers.qweight import QuantWeight


class GatedMLP(torch.nn.Module):
    def __init__(self, gate: torch.Tensor | QuantWeight, up: torch.Tensor | QuantWeight,
                 down: torch.Tensor | QuantWeight, dtype: torch.dtype = torch.bfloat16,
                 scratch: Scratch | None = None):
        """gate, up: [I, H]; down: [H, I]; dense tensors or QuantWeights (layers/qlinear.py)."""
        super().__init__()
        self.gate_up = make_linear([gate, up], None, dtype, scratch)  # [2I, H]
        self.down = make_linear([down], None, dtype, scratch)
        self.inter = int(gate.shape[0])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H] -> [T, H]; with `residual` [T, H], returns residual + mlp(x) (fused into the GEMM)."""
        gu = self.gate_up(x)  # [T, 2I]
        act = fused.apply_silu_mul(gu)  # silu(gate) * up, [T, I]: one kernel on CUDA or CPU
        return self.down(act) if residual is None else self.down.add_to(residual, act)
