"""Decoder == Hugging Face transformers, through the paged KV cache.

Tiny random Llama / Qwen2 / Qwen3 models (tied and untied) are saved sharded,
loaded back with kvtier's loader, and run through a PagePool with pages
assigned by hand in a shuffled order. All positions' logits must match HF's
(fp32, max relative error <= 1e-3), whether the prompt is fed at once, in
uneven chunks over cached pages, or packed with other sequences; greedy
decoding through the cache must equal HF's `generate`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvtier.config import ModelSpec
from kvtier.kv.formats import PlainFormat
from kvtier.kv.pool import PagePool
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention
from kvtier.models.decoder import Decoder

transformers = pytest.importorskip("transformers")

# fp32 on both sides: only summation order differs.
REL_TOL = 1e-3
PAGE_SIZE = 4
# Initial weight std: larger than HF's 0.02 so attention is far from uniform and errors show.
INIT_STD = 0.2
SHARD_SIZE = "50KB"  # forces several safetensors shards even for a tiny model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a-b| / max|b| (b is the reference)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


class PagedHarness:
    """Runs sequences through a Decoder with a PagePool; pages handed out in shuffled order."""

    def __init__(self, model: Decoder, num_pages: int = 128, page_size: int = PAGE_SIZE,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
        layers, kv_heads, head_dim = model.kv_shape
        self.model, self.page_size, self.device = model, page_size, device
        self.pool = PagePool(PlainFormat(dtype), layers, num_pages, kv_heads, page_size, head_dim,
                             device, compute_dtype=dtype)
        self.backend = DensePagedAttention(self.pool, scale=head_dim ** -0.5)
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]], last_only: bool = False) -> list[torch.Tensor]:
        """chunks: (seq id, new token ids) per sequence -> per sequence logits [n, V] (n = 1 if last_only)."""
        ids, pos, slots, qsl, seq_lens, tables, want = [], [], [], [0], [], [], []
        for sid, toks in chunks:
            start = self.lens.get(sid, 0)
            table = self.pages.setdefault(sid, [])
            end = start + len(toks)
            while len(table) * self.page_size < end:
                table.append(self.free.pop())
            rows = range(qsl[-1], qsl[-1] + len(toks))
            want.extend(rows[-1:] if last_only else rows)
            ids += toks
            pos += range(start, end)
            slots += [table[p // self.page_size] * self.page_size + p % self.page_size for p in range(start, end)]
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            tables.append(list(table))
            self.lens[sid] = end
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, page_tables=tables,
                                 slot_mapping=as_long(slots), logits_indices=as_long(want))
        logits = self.model(as_long(ids), as_long(pos), meta, self.backend)
        counts = [1 if last_only else len(t) for _, t in chunks]
        return list(logits.split(counts))

    def greedy(self, sid: int, prompt: list[int], n: int) -> list[int]:
        """Prefill `prompt` at once, then decode n tokens one per step through the cache."""
        out: list[int] = []
        nxt = int(self.step([(sid, prompt)], last_only=True)[0][-1].argmax())
        for _ in range(n):
            out.append(nxt)
            if len(out) == n:
                break
            nxt = int(self.step([(sid, [nxt])], last_only=True)[0][-1].argmax())
        return out


def hf_spec_and_tensors(path: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """kvtier's loader when it exists; else read config.json + safetensors shards here."""
    try:
        from kvtier.models.loading import load_checkpoint
    except ImportError:
        return _read_hf_dir(path)
    ckpt = load_checkpoint(path)
    return ckpt.spec, ckpt.tensors


def _read_hf_dir(path: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    cfg = transformers.AutoConfig.from_pretrained(path)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    spec = ModelSpec(
        arch=cfg.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        rope_theta=rope.get("rope_theta", 10000.0), rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.model_type == "qwen2", qk_norm=cfg.model_type == "qwen3",
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return spec, tensors


MODEL_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_hf_model(arch: str, tied: bool, seed: int = 0, **overrides):
    """A tiny random HF causal LM: hidden 64, 3 layers, GQA 4q/2kv, vocab 320."""
    cfg_cls, model_cls = (getattr(transformers, n) for n in MODEL_CLASSES[arch])
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=64,
              tie_word_embeddings=tied, rms_norm_eps=1e-5, initializer_range=INIT_STD,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # HF inits norms to 1: perturb so they are tested
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return model


CASES = [(a, t) for a in ("llama", "qwen2", "qwen3") for t in (False, True)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES])
def pair(request, tmp_path_factory):
    arch, tied = request.param
    hf = make_hf_model(arch, tied, seed=len(arch) + tied)
    path = tmp_path_factory.mktemp(f"{arch}{int(tied)}")
    hf.save_pretrained(path, max_shard_size=SHARD_SIZE)
    assert len(list(path.glob("*.safetensors"))) > 1, "checkpoint should be sharded"
    spec, tensors = hf_spec_and_tensors(path)
    assert spec.tie_word_embeddings == tied and ("lm_head.weight" in tensors) == (not tied)
    return hf, Decoder.from_tensors(spec, tensors, torch.float32, "cpu")


def prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()  # [T, V]


def test_one_shot_prefill_matches_hf(pair):
    hf, model = pair
    ids = prompt(23, seed=1)
    got = PagedHarness(model).step([(0, ids)])[0]
    assert rel_err(got, hf_logits(hf, ids)) <= REL_TOL


def test_chunked_prefill_matches_one_shot(pair):
    hf, model = pair
    ids = prompt(26, seed=2)
    h = PagedHarness(model, seed=3)
    got = torch.cat([h.step([(0, ids[a:b])])[0] for a, b in ((0, 5), (5, 19), (19, 26))])
    one_shot = PagedHarness(model).step([(0, ids)])[0]
    assert rel_err(got, one_shot) <= REL_TOL
    assert rel_err(got, hf_logits(hf, ids)) <= REL_TOL


def test_packed_batch_matches_each_alone(pair):
    hf, model = pair
    seqs = [prompt(n, seed=10 + n) for n in (7, 1, 17)]
    h = PagedHarness(model, seed=4)
    packed = h.step(list(enumerate(seqs)))
    # a second packed step: one decode row per sequence and a 3-token chunk, over cached pages
    more = [[5], [6, 7, 8], [9]]
    packed2 = h.step(list(enumerate(more)))
    for i, s in enumerate(seqs):
        alone = PagedHarness(model).step([(0, s)])[0]
        assert rel_err(packed[i], alone) <= REL_TOL
        full = hf_logits(hf, s + more[i])
        assert rel_err(packed[i], full[:len(s)]) <= REL_TOL
        assert rel_err(packed2[i], full[len(s):]) <= REL_TOL


def test_greedy_decode_matches_hf_generate(pair):
    hf, model = pair
    ids = prompt(9, seed=5)
    n = 16
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)[0, len(ids):].tolist()
    assert PagedHarness(model).greedy(0, ids, n) == ref


def test_llama3_rope_scaling_matches_hf(tmp_path):
    """Llama 3.1 frequency smoothing, at positions past the original context."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    hf = make_hf_model("llama", tied=False, seed=7, rope_parameters=scaling, max_position_embeddings=128)
    hf.save_pretrained(tmp_path, max_shard_size=SHARD_SIZE)
    spec, tensors = hf_spec_and_tensors(tmp_path)
    assert spec.rope_scaling and spec.rope_scaling.get("rope_type", spec.rope_scaling.get("type")) == "llama3"
    model = Decoder.from_tensors(spec, tensors, torch.float32, "cpu")
    ids = prompt(60, seed=8)
    assert rel_err(PagedHarness(model).step([(0, ids)])[0], hf_logits(hf, ids)) <= REL_TOL


# --- real GGUF checkpoints vs HF's own GGUF dequantisation ------------------------------------

GGUF_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a short list of three fruits: apple,",
)
GREEDY_TOKENS = 32


def hf_from_gguf(path: Path):
    """HF model + tokenizer from a GGUF file, dequantised by transformers itself (fp32).

    This is what `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` does, minus its
    hard requirement on `accelerate` (not a kvtier dependency): config and tensors come from
    transformers' GGUF reader, independent of kvtier's loader.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    cfg = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    assert set(result.missing_keys) <= tied and not result.unexpected_keys, result
    model.tie_weights()
    model.generation_config.eos_token_id = None  # compare all greedy tokens, EOS included
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tok


def check_gguf_against_hf(path: Path) -> None:
    from kvtier.models.loading import load_checkpoint
    ckpt = load_checkpoint(path)
    model = Decoder.from_tensors(ckpt.spec, ckpt.tensors, torch.float32, "cpu")
    del ckpt
    hf, tok = hf_from_gguf(path)
    harness = PagedHarness(model, num_pages=256, page_size=16)
    for sid, text in enumerate(GGUF_PROMPTS):
        ids = tok.encode(text, add_special_tokens=False)
        ref = hf_logits(hf, ids)
        got = PagedHarness(model, num_pages=64, page_size=16).step([(0, ids)])[0]
        assert rel_err(got, ref) <= REL_TOL, text
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist()
        assert len(want) == GREEDY_TOKENS
        assert harness.greedy(sid, ids, GREEDY_TOKENS) == want, text


def test_smollm2_gguf_matches_hf():
    from kvtier.models import hub
    check_gguf_against_hf(hub.fetch("smollm2-135m", progress=False))


@pytest.mark.slow
def test_qwen25_coder_gguf_matches_hf():
    hub = pytest.importorskip("kvtier.models.hub")
    check_gguf_against_hf(hub.fetch("qwen2.5-coder-0.5b", progress=False))


def test_gguf_rope_freqs_matches_hf_llama3(tmp_path):
    """A Llama 3.1-style GGUF carries rope scaling as a rope_freqs tensor (llama.cpp's convention):
    loaded from GGUF, logits past the original context equal HF's llama3 rope."""
    import numpy as np

    from kvtier.layers.rotary import rope_inv_freq
    from kvtier.models.loading import load_checkpoint
    from tests.models.gguf_factory import write_gguf

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    hf = make_hf_model("llama", tied=False, seed=9, rope_parameters=scaling, max_position_embeddings=128)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    # what convert_hf_to_gguf.py stores: the divisor of each frequency, from HF's own rope init
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    factors = (plain / hf_inv).numpy().astype(np.float32)
    assert not np.allclose(factors, 1.0)
    cfg = dict(hidden=64, layers=3, heads=4, kv_heads=2, ffn=96, ctx=128, rope_theta=500000.0, eps=1e-5,
               head_dim=16)
    path = tmp_path / "llama31.gguf"
    from gguf import GGUFWriter  # noqa: F401  (write_gguf uses it)
    write_gguf(path, "llama", cfg, dict(hf.state_dict()), extra_tensors={"rope_freqs.weight": factors})
    ckpt = load_checkpoint(path)
    assert ckpt.spec.rope_scaling["rope_type"] == "freq_factors"
    assert torch.allclose(rope_inv_freq(16, 500000.0, ckpt.spec.rope_scaling), hf_inv.float(), rtol=1e-6)
    model = Decoder.from_tensors(ckpt.spec, ckpt.tensors, torch.float32, "cpu")
    ids = prompt(60, seed=8)
    assert rel_err(PagedHarness(model).step([(0, ids)])[0], hf_logits(hf, ids)) <= REL_TOL
