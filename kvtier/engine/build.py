"""Build an Engine from a model name or path: resolve, load, place, size the KV pool."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kvtier.config import EngineConfig
from kvtier.engine.engine import Engine

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(config: EngineConfig) -> EngineConfig:
    """Resolve device/dtype "auto": CUDA when present; fp32 on CPU, bf16 on CUDA."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but this torch build sees no CUDA device")
    dtype = config.dtype
    if dtype == "auto":
        dtype = "fp32" if device == "cpu" else "bf16"
    return replace(config, device=device, dtype=dtype)


def build_engine(model: str, config: EngineConfig | None = None, show_progress: bool = True,
                 console: Console | None = None) -> Engine:
    """Resolve `model` (registry name or path), load weights and tokenizer, build the Engine."""
    from kvtier.models.decoder import Decoder
    from kvtier.models.hub import resolve_model
    from kvtier.models.loading import load_checkpoint
    from kvtier.models.tokenizer import Tokenizer

    config = resolve_device(config or EngineConfig())
    if config.threads:
        torch.set_num_threads(config.threads)
    path = resolve_model(model)
    console = console or Console(stderr=True)
    cols = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    t0 = time.monotonic()
    with Progress(*cols, console=console, transient=True, disable=not show_progress) as prog:
        task = prog.add_task(f"reading {Path(path).name}", total=3)
        ckpt = load_checkpoint(path, dtype=torch.float32)
        prog.update(task, advance=1, description="building model")
        dev = torch.device(config.device)
        net = Decoder.from_tensors(ckpt.spec, ckpt.tensors, dtype=DTYPES[config.dtype], device=dev)
        del ckpt.tensors
        prog.update(task, advance=1, description="loading tokenizer")
        tok = Tokenizer.from_checkpoint(ckpt)
        prog.update(task, advance=1)
    name = model if not Path(model).exists() else Path(model).stem
    engine = Engine(net, tok, config, model_name=name)
    if show_progress:
        spec = ckpt.spec
        console.print(f"[green]loaded[/] {name}: {spec.arch}, {spec.num_layers} layers, "
                      f"hidden {spec.hidden_size}, on {config.device} ({config.dtype}) "
                      f"in {time.monotonic() - t0:.1f}s; KV {engine.kv_format}, "
                      f"{engine.pool.num_pages} pages x {config.cache.page_size} tokens")
    return engine
