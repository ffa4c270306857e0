"""`kvtier eval recall` arguments, torch-free: the CLI builds its parser without importing torch
(kvtier/eval/recall.py, which runs the evaluation, is imported only when the command runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.config import DEFAULT_PAGE_SIZE, DEFAULT_SINK, DEFAULT_WINDOW, SELECTORS

# both evals' --selectors: a method "<selector>/8" scores 8-bit page summaries (eval.summary_bits)
SELECTORS_HELP = "comma-separated; '<selector>/8' scores 8-bit page summaries (--kvmem-summary-bits 8)"


def _run(args: argparse.Namespace) -> int:
    from kvtier.eval import recall
    return recall.main(args)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`recall` under `kvtier eval`."""
    p = subparsers.add_parser("recall", help="passkey recall + fidelity: dense vs retrieval attention")
    p.add_argument("--model", "-m", default="smollm2-135m", help="model name (kvtier models list) or path")
    p.add_argument("--lengths", default="1024,2048", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths in [0, 1), comma-separated")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--needles", default="1", help="1, 3 or 1,3 (3: all must be found)")
    p.add_argument("--haystack", default="repeated", help="repeated, varied or repeated,varied")
    p.add_argument("--budget", type=int, default=512, help="kvmem budget in tokens per decode row")
    p.add_argument("--sink", type=int, default=DEFAULT_SINK)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--selectors", default=",".join(SELECTORS), help=SELECTORS_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                   help="as `kvtier serve --dtype` (auto: bf16 on CUDA and bf16-capable CPUs, else fp32)")
    p.add_argument("--weights", default="auto", choices=("auto", "bf16", "int8", "int4"),
                   help="as `kvtier serve --weights` (auto: a GGUF's own quantized format)")
    p.add_argument("--prompt-format", default="auto", choices=("auto", "raw", "chat"),
                   help="chat: haystack and question as a user turn in the model's chat template "
                        "(auto: when the model has one); raw: plain text")
    p.add_argument("--mass", action="store_true", help="also record the dense mass the selection covers")
    p.add_argument("--fidelity-tokens", type=int, default=0,
                   help="natural-text KL / mass: teacher-forced decode tokens past max(--lengths) (0: off)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    p.set_defaults(fn=_run)
    return p


def _run_planted(args: argparse.Namespace) -> int:
    from kvtier.eval import planted
    return planted.main(args)


def add_planted_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`planted` under `kvtier eval`: needles planted into random keys, no model (eval/planted.py)."""
    p = subparsers.add_parser("planted", help="does the page index find planted needles (random keys, any length)")
    p.add_argument("--lengths", default="4096,32768", help="context lengths in tokens, comma-separated")
    p.add_argument("--margins", default="1,3,6", help="needle logit over the strongest random key, nats")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--sink", type=int, default=16)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--selectors", default=",".join(SELECTORS), help=SELECTORS_HELP)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--gqa", type=int, default=4, help="query heads per kv head")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    p.add_argument("--kv-dtype", default="bf16", choices=("fp32", "bf16", "fp16", "fp8", "int8", "k8v4", "int4"))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    p.set_defaults(fn=_run_planted)
    return p
