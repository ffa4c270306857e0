"""Rotary position embedding (HF rotate-half convention) with a lazily grown cos/sin cache."""

from __future__ import annotations

import math

import torch

# Rope types whose frequencies we know how to compute ("default" = plain RoPE).
# "freq_factors": per-frequency divisors as GGUF files store them (llama.cpp's rope_freqs tensor;
# what convert_hf_to_gguf.py writes for Llama 3.1+ instead of the llama3 parameters).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with HF's rope_scaling applied."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return inv
    assert scaling is not None
    if rope_type == "freq_factors":
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)
        if factors.shape != inv.shape:
            raise ValueError(f"rope freq_factors has {factors.numel()} entries, expected {inv.numel()}")
        return inv / factors
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv / factor
    return _llama3_inv_freq(inv, factor, scaling)


def _rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "freq_factors" and "freq_factors" not in scaling:
        raise ValueError("rope_scaling of type 'freq_factors' needs 'freq_factors'")
    if rope_type not in ("default", "freq_factors") and "factor" not in scaling:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs a 'factor'")
    return rope_type


def _llama3_inv_freq(inv: torch.Tensor, factor: float, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency smoothing, as in HF's _compute_llama3_parameters."""
    try:
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"llama3 rope_scaling is missing {e.args[0]!r}") from None
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin tables [max_pos, head_dim]; grows them when a larger position shows up.

    The sin table is stored sign-folded (first half negated) so that rotation is
    x*cos + roll(x, D/2)*sin_signed, i.e. HF's x*cos + rotate_half(x)*sin in fewer ops.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: dict | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.head_dim = head_dim
        self.dtype = dtype
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling).to(device), persistent=False)
        self.cos = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.sin_signed = torch.empty(0, head_dim, dtype=dtype, device=device)
        self._grow(max_positions)

    def _grow(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq)  # [n, D/2]
        self.cos = torch.cat((freqs, freqs), dim=-1).cos().to(self.dtype)  # [n, D]
        self.sin_signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(self.dtype)

    def reserve(self, n: int) -> None:
        """Grow the tables to hold positions < n now (a captured CUDA graph must never see
        them replaced)."""
        if n > self.cos.shape[0]:
            self._grow(n)

    def forward(self, positions: torch.Tensor, max_pos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> cos, sin_signed: [T, 1, D] (broadcast over heads).

        max_pos, if the caller knows it, saves a device sync when checking the cache size.
        """
        need = int(positions.max()) + 1 if max_pos is None else max_pos + 1
        if need > self.cos.shape[0]:
            self._grow(max(need, 2 * self.cos.shape[0]))
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin_signed: [T, 1, D] from RotaryEmbedding -> [T, H, D].

    Equals HF's x*cos + rotate_half(x)*sin, since rotate_half(x) = cat(-x2, x1)
    = roll(x, D/2) with the first half negated (folded into sin_signed).
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
