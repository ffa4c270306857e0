"""Supported architectures and the weight-name mapping between GGUF and Hugging Face.

The decoder consumes Hugging Face names only; every loader maps its format's names onto them
(`gguf_to_hf_name`) and checks the result against `expected_shapes(spec)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtier.config import ModelSpec


@dataclass(frozen=True)
class ArchInfo:
    """What distinguishes one supported architecture from another."""

    name: str
    attention_bias: bool  # q/k/v projections carry a bias (qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (qwen3)
    gguf_permuted_qk: bool  # llama.cpp's converter permuted q/k rows into its rotary layout
    hf_model_types: tuple[str, ...]  # config.json "model_type" values that map here


ARCHS: dict[str, ArchInfo] = {
    "llama": ArchInfo("llama", attention_bias=False, qk_norm=False, gguf_permuted_qk=True,
                      hf_model_types=("llama", "mistral")),
    "qwen2": ArchInfo("qwen2", attention_bias=True, qk_norm=False, gguf_permuted_qk=False,
                      hf_model_types=("qwen2",)),
    "qwen3": ArchInfo("qwen3", attention_bias=False, qk_norm=True, gguf_permuted_qk=False,
                      hf_model_types=("qwen3",)),
}
SUPPORTED_ARCHS: tuple[str, ...] = tuple(ARCHS)


def arch_info(arch: str) -> ArchInfo:
    """The ArchInfo of `arch`; ValueError naming the supported ones otherwise."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    return ARCHS[arch]


def arch_for_hf_model_type(model_type: str) -> str:
    """Map a config.json `model_type` to a supported architecture name."""
    for info in ARCHS.values():
        if model_type in info.hf_model_types:
            return info.name
    known = sorted(t for info in ARCHS.values() for t in info.hf_model_types)
    raise ValueError(f"unknown architecture {model_type!r} (supported model_type: {', '.join(known)})")


# GGUF tensor names (llama.cpp convention) -> Hugging Face names.
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# GGUF tensors that carry no HF weight (precomputed rotary frequencies of llama3 scaling).
GGUF_IGNORED_TENSORS = frozenset({"rope_freqs.weight"})


def gguf_to_hf_name(name: str) -> str | None:
    """HF name of a GGUF tensor, or None when the tensor has no HF counterpart we know."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _GGUF_BLOCK:
        return f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}"
    return None


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor a decoder of `spec` needs, with its shape ([out, in] for Linear)."""
    h, hd, ffn = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_out, kv_out = spec.num_heads * hd, spec.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (ffn, h),
            p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        })
        if spec.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                           p + "self_attn.v_proj.bias": (kv_out,)})
        if spec.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def optional_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF tensors a checkpoint may carry beyond `expected_shapes` (o_proj bias of some llamas)."""
    h = spec.hidden_size
    return {f"model.layers.{i}.self_attn.o_proj.bias": (h,) for i in range(spec.num_layers)}
