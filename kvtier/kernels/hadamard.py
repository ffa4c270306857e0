"""The quantized KV formats' rotation R = H / sqrt(D) (formats.hadamard, one Sylvester block) in
registers, for the Triton kernels that rotate a few rows (kv_transform's stores and q / output
transforms, paged_attention's folded q and merged output).

    fwht(x)    x [ROWS, D] fp32 -> x H, H[i, j] = (-1)^popcount(i & j) (unscaled)

The fast Walsh-Hadamard transform: log2(D) butterfly stages, stage s pairing columns j and
j + 2^s (bit s of j clear) into (a + b, a - b). It reads no matrix: the rotation used to be a
multiply-sum over R's rows from L2 (a decode row) or dots over its signs (the split kernel's q),
a chain of dependent loads each program paid (H200, a Qwen3-8B layer at 32K, int8 KV: the store
took 11.9 us against bf16's 2.0 us, the merge 12.2 against 6.4). D log2(D) adds instead of D^2
multiply-adds; every stage rounds in fp32, so a result can differ from x @ R in the last bits.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


def fwht_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a power of two) -> x H in fp32, by the same butterflies in PyTorch."""
    d = x.shape[-1]
    y = x.float()
    h = 1
    while h < d:
        y = y.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(x.shape)


if HAVE_TRITON:
    # Stages unrolled at most (head dims up to 2^MAX_LOG2_D).
    MAX_LOG2_D = tl.constexpr(12)

    @triton.jit
    def _butterflies(x, ROWS: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
        """One stage: columns j and j + H (bit log2(H) of j clear) -> (a + b, a - b)."""
        y = tl.permute(tl.reshape(x, [ROWS, D // (2 * H), 2, H]), [0, 1, 3, 2])  # that bit last
        a, b = tl.split(y)
        return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [ROWS, D])

    @triton.jit
    def fwht(x, ROWS: tl.constexpr, D: tl.constexpr):
        """x [ROWS, D] fp32 (D a power of two) -> x H (module docstring)."""
        for s in tl.static_range(MAX_LOG2_D):
            if (1 << s) < D:
                x = _butterflies(x, ROWS, D, 1 << s)
        return x
