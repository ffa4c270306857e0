"""HF config fields of real model shapes, by name: what `kvtier plan` and `kvtier bench --shape`
size and build without the real files (kvtier/bench/shapes.py builds random-weight models of them).

A name in QUANT_SHAPES is built with 4-bit or 8-bit QuantWeight matrices directly (no dense copy,
no HF model): the memory and bandwidth of serving a checkpoint of that shape at that width."""

from __future__ import annotations

# HF config fields of real checkpoints (from their config.json).
SHAPES: dict[str, dict] = {
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
                     tie_word_embeddings=False),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                       tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                         tie_word_embeddings=True),
    "qwen3-32b": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                      tie_word_embeddings=False),
    "llama-tiny": dict(model_type="llama", vocab_size=1024, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=4096, tie_word_embeddings=False),
}

# Shapes built as random weight-only quantized models: name -> (dense shape, bits, group).
QUANT_SHAPES: dict[str, tuple[str, int, int]] = {
    "qwen3-8b-int4": ("qwen3-8b", 4, 32),
    "qwen3-32b-int4": ("qwen3-32b", 4, 32),
    "llama-tiny-int4": ("llama-tiny", 4, 32),
    "qwen3-8b-int8": ("qwen3-8b", 8, 32),
    "llama-tiny-int8": ("llama-tiny", 8, 32),
}
SHAPES.update({name: SHAPES[base] for name, (base, _, _) in QUANT_SHAPES.items()})
