"""Build small GGUF files for tests, the way llama.cpp's convert_hf_to_gguf.py lays them out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

HF_TO_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
HF_TO_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}


def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim logic of LlamaModel.permute in llama.cpp's convert_hf_to_gguf.py."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_to_gguf_name(name: str) -> str:
    if name in HF_TO_GGUF_GLOBAL:
        return HF_TO_GGUF_GLOBAL[name]
    _, _, i, rest = name.split(".", 3)
    return f"blk.{i}.{HF_TO_GGUF_BLOCK[rest]}"


def write_gguf(path: Path, arch: str, cfg: dict, tensors: dict[str, torch.Tensor],
               qtype: GGMLQuantizationType = GGMLQuantizationType.F32, extra_kv: dict | None = None,
               tokens: list[str] | None = None,
               raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write HF-named `tensors` as a GGUF of `arch`; 2-D weights in `qtype`, norms/biases in F32.

    `raw` overrides tensors by name with already-quantized bytes ([rows, row_bytes] uint8).

    cfg keys: hidden, layers, heads, kv_heads, ffn, ctx, rope_theta, eps, head_dim (optional).
    """
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.embedding_length", cfg["hidden"])
    w.add_uint32(f"{arch}.block_count", cfg["layers"])
    w.add_uint32(f"{arch}.attention.head_count", cfg["heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg["kv_heads"])
    w.add_uint32(f"{arch}.feed_forward_length", cfg["ffn"])
    w.add_uint32(f"{arch}.context_length", cfg["ctx"])
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["eps"])
    if "head_dim" in cfg:
        w.add_uint32(f"{arch}.attention.key_length", cfg["head_dim"])
        w.add_uint32(f"{arch}.attention.value_length", cfg["head_dim"])
    if tokens is not None:
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_array("tokenizer.ggml.tokens", tokens)
    for k, v in (extra_kv or {}).items():
        w.add_string(k, v) if isinstance(v, str) else w.add_uint32(k, v)
    for gname, a in (extra_tensors or {}).items():  # GGUF-named F32 tensors (e.g. rope_freqs.weight)
        w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    for name, (data, raw_type) in (raw or {}).items():
        w.add_tensor(hf_to_gguf_name(name), data, raw_dtype=raw_type)
    for name, t in tensors.items():
        if name in (raw or {}):
            continue
        a = t.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            a = llamacpp_permute(a, cfg["heads"], cfg["heads"])
        elif arch == "llama" and ".k_proj." in name:
            a = llamacpp_permute(a, cfg["heads"], cfg["kv_heads"])
        gname = hf_to_gguf_name(name)
        if a.ndim == 2 and qtype != GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf_quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g) * 0.2 for k, s in shapes.items()}


def tiny_hf_model(arch: str, tied: bool = False, seed: int = 0):
    """A tiny random transformers model of `arch` and the matching write_gguf cfg."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=tied)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    extra = {"head_dim": 32} if arch == "qwen3" else {}  # qwen3: head_dim != hidden / heads
    config = cls[0](**common, **extra)
    model = cls[1](config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    cfg = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, ctx=256,
               rope_theta=float(config.rope_parameters["rope_theta"]) if hasattr(config, "rope_parameters")
               else float(config.rope_theta), eps=1e-5, **extra)
    return model, cfg
