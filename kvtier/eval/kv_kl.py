"""KV-format quality: KL divergence of next-token distributions vs a reference KV format.

Runs one long text through the model once per KV format, in lockstep chunks
(chunked prefill: every chunk attends to the earlier chunks' *stored*, i.e.
quantized, K/V), and reports per format the mean KL(p_ref || p_fmt) over all
positions, its 99th percentile and the top-1 agreement with the reference.

    python -m kvtier.eval.kv_kl --model path.gguf --tokens 2048 [--text-file f.txt]

Without --text-file the text is English prose from the Python Language
Reference that ships with every CPython (`pydoc_data.topics`, code and
grammar blocks dropped): natural text, always present, deterministic. The
pools' K smoothing is calibrated first as the engine's is (engine/calibrate.py, on
the first CALIBRATION_TOKENS tokens of that prose); the measured tokens are the
ones after them.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.engine.calibrate import CALIBRATION_TOKENS, calibrate_pool, calibration_tokens, prose_text
from kvtier.kv.formats import FORMAT_NAMES, make_format
from kvtier.kv.pool import PagePool
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention
from kvtier.models.decoder import compute_dtype

# Prefill chunk: each later chunk reads the earlier ones back from the quantized pool.
DEFAULT_CHUNK = 256
DEFAULT_PAGE_SIZE = 16
# Reference format: the brief compares every format against bf16 KV.
REFERENCE = "bf16"


@dataclass
class KLResult:
    fmt: str
    mean_kl: float
    p99_kl: float
    top1_agree: float
    bytes_per_token: float  # K+V of all layers


def _meta(start: int, n: int, page_size: int, device: torch.device) -> AttentionMetadata:
    """One sequence, pages 0..k in order; rows start..start+n-1 are new."""
    ctx = start + n
    n_pages = -(-ctx // page_size)
    return AttentionMetadata(
        query_start_loc=[0, n], seq_lens=[ctx], page_tables=[list(range(n_pages))],
        slot_mapping=torch.arange(start, ctx, dtype=torch.long, device=device),
        logits_indices=torch.arange(n, dtype=torch.long, device=device))


@torch.inference_mode()
def kv_kl(model: torch.nn.Module, tokens: list[int], formats: list[str], chunk: int = DEFAULT_CHUNK,
          page_size: int = DEFAULT_PAGE_SIZE, reference: str = REFERENCE,
          calibration: list[int] | None = None) -> list[KLResult]:
    """KL of each format's next-token distributions vs `reference`, over every position of `tokens`.

    calibration: token ids the pools' K smoothing is fixed from first, as the engine does
    (engine/calibrate.py); None: each layer's first write.
    """
    layers, kv_heads, head_dim = model.kv_shape
    device = next(model.parameters()).device
    dtype = compute_dtype(model)
    names = [reference] + [f for f in formats if f != reference]
    pages = -(-len(tokens) // page_size)
    pools = {f: PagePool(make_format(f), layers, pages, kv_heads, page_size, head_dim, device,
                         compute_dtype=dtype) for f in names}
    if calibration:
        for p in pools.values():
            calibrate_pool(model, p, calibration)
    backends = {f: DensePagedAttention(p, scale=head_dim ** -0.5) for f, p in pools.items()}
    kls: dict[str, list[torch.Tensor]] = {f: [] for f in names}
    agree = dict.fromkeys(names, 0)
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    for start in range(0, len(tokens), chunk):
        n = min(chunk, len(tokens) - start)
        meta = _meta(start, n, page_size, device)
        pos = torch.arange(start, start + n, device=device)
        ref = torch.log_softmax(model(ids[start:start + n], pos, meta, backends[reference]), dim=-1)
        for f in names:
            lp = ref if f == reference else torch.log_softmax(
                model(ids[start:start + n], pos, meta, backends[f]), dim=-1)
            kls[f].append((ref.exp() * (ref - lp)).sum(-1).clamp_min(0).cpu())  # [n]
            agree[f] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
    out = []
    for f in names:
        k = torch.cat(kls[f]).double()
        out.append(KLResult(f, float(k.mean()), float(torch.quantile(k, 0.99)), agree[f] / len(tokens),
                            pools[f].fmt.bytes_per_token(kv_heads, head_dim) * layers))
    return out


def format_table(results: list[KLResult], reference: str = REFERENCE) -> str:
    lines = [f"| KV format | bytes/token | mean KL vs {reference} (nats) | p99 KL | top-1 agree |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r.fmt} | {r.bytes_per_token:.0f} | {r.mean_kl:.2e} | {r.p99_kl:.2e} | "
                     f"{100 * r.top1_agree:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="GGUF file or HF safetensors directory")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text-file", type=Path)
    ap.add_argument("--formats", default=",".join(FORMAT_NAMES))
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="fp32|bf16 (default: fp32 on CPU, bf16 on CUDA)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    from kvtier.models.decoder import Decoder
    from kvtier.models.loading import load_checkpoint
    from kvtier.models.tokenizer import Tokenizer

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[args.dtype] or (
        torch.bfloat16 if args.device == "cuda" else torch.float32)
    ckpt = load_checkpoint(args.model, dtype=torch.float32)
    model = Decoder.from_tensors(ckpt.spec, ckpt.tensors, dtype=dtype, device=args.device)
    tok = Tokenizer.from_checkpoint(ckpt)
    calib = calibration_tokens(tok, ckpt.spec.vocab_size)
    if args.text_file:
        tokens = tok.encode(args.text_file.read_text())[:args.tokens]
    else:  # held out: the prose after the engine's calibration tokens
        tokens = tok.encode(prose_text())[CALIBRATION_TOKENS:CALIBRATION_TOKENS + args.tokens]
    if len(tokens) < args.tokens:
        raise ValueError(f"text has only {len(tokens)} tokens, {args.tokens} asked for")
    results = kv_kl(model, tokens, args.formats.split(","), chunk=args.chunk, calibration=calib)
    print(f"{ckpt.spec.name or args.model}: {len(tokens)} tokens, chunk {args.chunk}, "
          f"{args.device} {str(dtype).removeprefix('torch.')}, {math.ceil(len(tokens) / args.chunk)} chunks")
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=1))


if __name__ == "__main__":
    main()
