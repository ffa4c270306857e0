"""KV storage formats: how one page of K and V is laid out in memory.

A format owns dtype, scales and bytes per page; the pool allocates what the
format asks for and calls pack/unpack. Page storage is
`[num_pages, kv_heads, page_size, head_dim]` per layer for K and for V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVFormat:
    """Base: uncompressed storage in `dtype`."""

    name = "base"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> float:
        """Bytes of K+V for one token of one layer."""
        return 2 * kv_heads * head_dim * torch.finfo(self.dtype).bits / 8

    def allocate(self, num_pages: int, kv_heads: int, page_size: int, head_dim: int,
                 device: torch.device, pin: bool = False) -> dict[str, torch.Tensor]:
        shape = (num_pages, kv_heads, page_size, head_dim)
        return {
            "k": torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin),
            "v": torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin),
        }

    def store(self, st: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """slots: [T] int64 flat slot ids; k, v: [T, H, D]."""
        p, h, s, d = st["k"].shape
        pages, offs = slots // s, slots % s
        st["k"][pages, :, offs] = k.to(self.dtype)
        st["v"][pages, :, offs] = v.to(self.dtype)

    def load(self, st: dict[str, torch.Tensor], page_ids: torch.Tensor,
             out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """page_ids: [P] -> k, v: [P, H, S, D] in out_dtype."""
        return st["k"][page_ids].to(out_dtype), st["v"][page_ids].to(out_dtype)


class PlainFormat(KVFormat):
    """fp32 / bf16 / fp16 storage, no quantization."""

    def __init__(self, dtype: torch.dtype):
        super().__init__(dtype)
        self.name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def make_format(name: str) -> KVFormat:
    plain = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name in plain:
        return PlainFormat(plain[name])
    raise ValueError(f"unknown KV format {name!r}")
