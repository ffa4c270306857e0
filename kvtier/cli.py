"""kvtier command line: serve | generate | chat | inspect | models | plan | bench | eval."""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

from rich.console import Console

from kvtier.config import (CUDA_PREFILL_CHUNK, DEFAULT_PAGE_SIZE, DEFAULT_PREFILL_CHUNK, DEFAULT_SINK, DEFAULT_WINDOW,
                           SELECTORS, SUM_SELECTORS, CacheConfig, EngineConfig, RetrievalConfig, ServerConfig)

DEFAULT_MODEL = "smollm2-135m"
EXIT_BAD_INPUT = 2  # bad model file / bad arguments
EXIT_BROKEN_PIPE = 141  # what a shell reports for a writer killed by SIGPIPE (128 + 13)

console = Console(stderr=True)


def _summary_bits(value: str) -> int:
    """`--kvmem-summary-bits`: auto (0), 8 or 16."""
    if value == "auto":
        return 0
    if value not in ("8", "16"):
        raise argparse.ArgumentTypeError(f"expected auto, 8 or 16, got {value!r}")
    return int(value)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help="model name (kvtier models list) or path")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                   help="weights/activations (auto: bf16 on CUDA and bf16-capable CPUs, else fp32)")
    p.add_argument("--decode-weights", default="auto", choices=("auto", "dense", "int8"),
                   help="small-batch matmuls: int8 weight copy (auto: on CPU with bf16)")
    p.add_argument("--weights", default="auto", choices=("auto", "bf16", "int8", "int4"),
                   help="matmul weights as loaded (auto: a GGUF's own quantized format, one copy; dense "
                        "on CPU for GGUFs up to 256 MiB, where it is faster; safetensors dense; int8/int4: "
                        "round-to-nearest at load)")
    p.add_argument("--offload-layers", type=int, default=None,
                   help="keep the last N decoder layers' weights in host RAM, copied to the GPU as each runs "
                        "(default: as many as --gpu-memory-limit needs, see `kvtier plan`; 0 without one)")
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "dense", "triton"),
                   help="attention kernels (auto: triton on CUDA, else the dense reference)")
    p.add_argument("--kvmem-budget", type=int, default=0,
                   help="retrieval attention: past this many tokens a decode step attends to sink + window + "
                        "top-k pages per KV head (0: dense)")
    p.add_argument("--kvmem-sink", type=int, default=DEFAULT_SINK, help="first tokens always attended")
    p.add_argument("--kvmem-window", type=int, default=DEFAULT_WINDOW, help="last tokens always attended")
    p.add_argument("--kvmem-selector", default=RetrievalConfig.selector, choices=SELECTORS,
                   help="page scores: hybrid (default: half quest, half centroid) | quest (per-channel min/max "
                        "bound) | quest-max | meankey (baseline) | centroid (per kv head mean key) | midrange "
                        "(per kv head (min + max) / 2) | hybrid-mid (half quest, half midrange: no key sums kept, "
                        "half the summary memory)")
    p.add_argument("--kvmem-summary-bits", type=_summary_bits, default=RetrievalConfig.summary_bits,
                   metavar="{auto,8,16}",
                   help="bits of each page's key min / max that retrieval scores every decode step: 16 (the "
                        "keys' dtype on CUDA, fp32 on CPU), 8 (int8 codes rounded outward with a power-of-two "
                        "scale per page and kv head: half the bytes read and held) or auto (default: 8 on CUDA, "
                        "16 on CPU)")
    p.add_argument("--kvmem-gpu-cache", type=int, default=0,
                   help="retrieval past the GPU pool (CUDA): tokens of GPU pool pages that keep the host pages "
                        "decode selects, so a page chosen again is not read over the bus again (0: off, the "
                        "default; -1: four budgets). Pays where decode keeps choosing the same old pages")
    p.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"),
                   help="capture decode steps as CUDA graphs (auto: on CUDA with the triton backend)")
    p.add_argument("--overlap", default="auto", choices=("auto", "on", "off"),
                   help="plan and launch each decode step while the one before it runs (auto: on CUDA)")
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    p.add_argument("--gpu-kv-mib", type=int, default=None, help="KV pool size on the compute device")
    p.add_argument("--host-kv-mib", type=int, default=0, help="pinned host-RAM KV tier size")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help=f"tokens per prefill step (default {DEFAULT_PREFILL_CHUNK} on CPU, "
                        f"{CUDA_PREFILL_CHUNK} on CUDA)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--decode-threads", type=int, default=None,
                   help="CPU threads for decode steps (default: --threads; fewer can pay on a machine "
                        "busy with other work)")


def _engine_config(a: argparse.Namespace) -> EngineConfig:
    cache = CacheConfig(page_size=a.page_size, kv_dtype=a.kv_dtype, gpu_kv_mib=a.gpu_kv_mib,
                        host_kv_mib=a.host_kv_mib, enable_prefix_cache=not a.no_prefix_cache)
    return EngineConfig(device=a.device, dtype=a.dtype, max_batch=a.max_batch,
                        prefill_chunk=a.prefill_chunk, max_model_len=a.max_model_len,
                        cache=cache, threads=a.threads, decode_threads=a.decode_threads,
                        decode_weights=a.decode_weights, weights=a.weights, offload_layers=a.offload_layers,
                        attention_backend=a.attention_backend, cuda_graphs=a.cuda_graphs, overlap=a.overlap,
                        retrieval=RetrievalConfig(budget=a.kvmem_budget, sink=a.kvmem_sink,
                                                  window=a.kvmem_window, selector=a.kvmem_selector,
                                                  gpu_cache=a.kvmem_gpu_cache,
                                                  summary_bits=a.kvmem_summary_bits))


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _params(a: argparse.Namespace):
    from kvtier.engine.request import SamplingParams
    return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                          max_tokens=a.max_tokens)


def cmd_serve(a: argparse.Namespace) -> int:
    from kvtier.engine.build import build_engine
    from kvtier.engine.engine import AsyncEngine
    from kvtier.server.app import serve

    key = a.api_key or os.environ.get("KVTIER_API_KEY")
    scfg = ServerConfig(host=a.host, port=a.port, api_key=key, cors=tuple(a.cors),
                        max_concurrency=a.max_concurrency, max_queue=a.max_queue,
                        model_name=a.served_name or a.model, default_temperature=a.temperature,
                        default_top_p=a.top_p, default_top_k=a.top_k, default_min_p=a.min_p,
                        progress_log_s=a.progress_log_s)
    from kvtier.engine.plan import checked_engine_config
    config = checked_engine_config(_engine_config(a), a.model, a.gpu_memory_limit)  # refuses before loading
    # built on the thread that will step it (AsyncEngine.start: one OpenMP team on CPU)
    engine = AsyncEngine.start(lambda: build_engine(a.model, config, console=console))
    scfg = ServerConfig(**{**scfg.__dict__, "model_name": a.served_name or engine.model_name})
    url = f"http://{a.host}:{a.port}"
    page = chat_page_url(a.host, a.port, key)
    console.print(f"[bold]kvtier[/] serving [cyan]{scfg.model_name}[/] at {url}", soft_wrap=True)
    console.print(f"chat page: {page}" + ("  (logs a browser in once; the key is stored there, not kept in "
                                          "the address)" if key else ""), soft_wrap=True, highlight=False)
    if a.open:
        open_when_listening(page, a.host, a.port)
    auth = f" -H 'Authorization: Bearer {key}'" if key else ""
    console.print(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
                  f"-d '{{\"model\":\"{scfg.model_name}\",\"messages\":[{{\"role\":\"user\","
                  f"\"content\":\"Hello!\"}}],\"max_tokens\":64}}'", soft_wrap=True, highlight=False)
    serve(engine, scfg)
    return 0


def chat_page_url(host: str, port: int, key: str | None) -> str:
    """The chat page's URL for a browser on this machine; with a key, a `#key=` fragment that the page
    stores and then removes from the address bar (fragments are never sent to the server)."""
    from urllib.parse import quote
    browser_host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)
    return f"http://{browser_host}:{port}/" + (f"#key={quote(key, safe='')}" if key else "")


def open_when_listening(url: str, host: str, port: int, timeout_s: float = 60.0) -> None:
    """Open `url` in the default browser once the server accepts connections (background thread)."""
    import socket
    import threading
    import webbrowser

    def wait_and_open() -> None:
        target = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection((target, port), timeout=1).close()
            except OSError:
                time.sleep(0.2)
                continue
            if not webbrowser.open(url):
                console.print("[yellow]--open: no browser found; open the chat page URL above[/]")
            return
    threading.Thread(target=wait_and_open, name="kvtier-open-browser", daemon=True).start()


def _stream(engine, req, out=sys.stdout) -> tuple[int, float, float]:
    """Run one request, printing text as it arrives. Returns (tokens, ttft, seconds)."""
    t0 = time.perf_counter()
    ttft = None
    n = 0
    engine.add_request(req)
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            n += len(o.token_ids)
            if o.text:
                out.write(o.text)
                out.flush()
            if o.finish_reason == "error":
                console.print(f"[red]error:[/] {o.error}")
    return n, ttft or 0.0, time.perf_counter() - t0


def cmd_generate(a: argparse.Namespace) -> int:
    from kvtier.engine.build import build_engine
    from kvtier.engine.request import Request

    engine = build_engine(a.model, _engine_config(a), console=console)
    tok = engine.tokenizer
    if a.raw:
        ids = tok.encode(a.prompt, add_special_tokens=True)
    else:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": a.prompt}]))
    n, ttft, dt = _stream(engine, Request(uuid.uuid4().hex, ids, _params(a)))
    print()
    decode_s = max(dt - ttft, 1e-9)
    console.print(f"[dim]{len(ids)} prompt tokens, {n} generated; TTFT {ttft * 1000:.0f} ms, "
                  f"{max(n - 1, 0) / decode_s:.1f} tok/s decode[/]")
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from kvtier.engine.build import build_engine
    from kvtier.engine.request import Request

    engine = build_engine(a.model, _engine_config(a), console=console)
    tok = engine.tokenizer
    history: list[dict] = [{"role": "system", "content": a.system}] if a.system else []
    console.print("[dim]kvtier chat: empty line or Ctrl-D quits[/]")
    while True:
        try:
            line = console.input("[bold green]> [/]")
        except (EOFError, KeyboardInterrupt):
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(history))
        import io
        buf = io.StringIO()

        class Tee:
            def write(self, s: str) -> None:
                buf.write(s)
                sys.stdout.write(s)

            def flush(self) -> None:
                sys.stdout.flush()

        n, ttft, dt = _stream(engine, Request(uuid.uuid4().hex, ids, _params(a)), Tee())
        print()
        st = engine.stats()["cache"]
        console.print(f"[dim]{n} tokens, {max(n - 1, 0) / max(dt - ttft, 1e-9):.1f} tok/s, "
                      f"TTFT {ttft * 1000:.0f} ms, prompt tokens from the prefix cache so far {st.get('cached_tokens', 0)}[/]")
        history.append({"role": "assistant", "content": buf.getvalue()})
    return 0


def _cell_text(cell) -> str:
    from rich.text import Text
    return cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain


def plain_table(table) -> list[str]:
    """A rich Table as plain lines: `# title`, the header, then one tab-separated row a line."""
    lines = [f"# {_cell_text(table.title)}"] if table.title else []
    cols = table.columns
    if table.show_header:
        lines.append("\t".join(_cell_text(c.header) for c in cols))
    lines += ["\t".join(_cell_text(cell) for cell in row) for row in zip(*(list(c.cells) for c in cols))]
    return lines


def print_tables(*tables, out=None) -> None:
    """Tables to stdout: rich boxes on a terminal (long cells fold onto more lines, never cut),
    plain text when piped or redirected, so `kvtier models list | grep NAME` finds whole names."""
    out = out or sys.stdout
    if out.isatty():
        for t in tables:
            for col in t.columns:
                if not col.no_wrap:
                    col.overflow = "fold"
            Console(file=out).print(t)
        return
    for t in tables:
        out.write("\n".join(plain_table(t)) + "\n")


def print_json(obj) -> None:
    import json
    print(json.dumps(obj, indent=2, default=str))


def cmd_inspect(a: argparse.Namespace) -> int:
    from kvtier.models.hub import resolve_model
    from kvtier.models.inspect import format_inspect, inspect_model

    info = inspect_model(resolve_model(a.model))
    if a.json:
        print_json(info)
    else:
        print_tables(*format_inspect(info).renderables)
    return 0


def cmd_models(a: argparse.Namespace) -> int:
    from kvtier.models import hub

    if a.action == "list":
        models = hub.list_models()
        if a.json:
            print_json(models)
            return 0
        from rich.table import Column, Table
        t = Table("status", "size", "file", "description")
        # the name is what people copy: never folded (the description folds instead)
        t.columns.insert(0, Column("name", no_wrap=True, min_width=max(len(m["name"]) for m in models)))
        for m in models:
            size = f"{m['size'] / 2**20:,.0f} MiB" if m["size"] is not None else "-"
            t.add_row(m["name"], "fetched" if m["fetched"] else "not fetched", size, m["filename"],
                      m["description"])
        print_tables(t)
        return 0
    path = hub.fetch(a.name)
    print(path)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    if a.swap_pages:
        from kvtier.bench.swap import run_swap_bench
        return run_swap_bench(a.swap_pages, a.page_size, a.out)
    config = _engine_config(a)
    if a.gpu_memory_limit:  # as serve: the plan's pool sizes and streamed layers, the process capped
        from dataclasses import replace

        from kvtier.engine.plan import checked_engine_config
        longest = max([int(c) for c in (a.contexts or "").split(",") if c.strip()]
                      + [a.prompt_tokens, a.cached_tokens + a.new_tokens]) + a.gen_tokens
        kv = a.kv_dtypes.split(",")[0] if a.contexts else config.cache.kv_dtype  # the grid: its first format
        config = replace(config, max_model_len=config.max_model_len or longest,
                         cache=replace(config.cache, kv_dtype=kv))
        config = checked_engine_config(config, a.shape or a.model, a.gpu_memory_limit)
    if a.contexts:
        from kvtier.bench.grid import run_grid
        return run_grid(a, config)
    from kvtier.bench.run import run_bench
    return run_bench(a, config)


def cmd_plan(a: argparse.Namespace) -> int:
    from kvtier.engine.plan import GIB, plan_for_args, render

    sums = a.kvmem_selector in SUM_SELECTORS
    plan = plan_for_args(a.model, a.kv_dtype, a.context, a.gpu_memory_limit, a.host_kv_mib,
                         offload_layers=a.offload_layers, retrieval=a.kvmem_budget > 0, key_sums=sums,
                         summary_bits=a.kvmem_summary_bits)
    print_tables(render(plan))
    for n in plan.notes:
        console.print(f"[yellow]note:[/] {n}")
    if plan.summary_bytes and sums and plan.host_kv_bytes:
        lean = plan_for_args(a.model, a.kv_dtype, a.context, a.gpu_memory_limit, a.host_kv_mib,
                             offload_layers=a.offload_layers, retrieval=True, key_sums=False,
                             summary_bits=a.kvmem_summary_bits)
        if lean.gpu_kv_tokens > plan.gpu_kv_tokens or lean.offload_layers < plan.offload_layers:
            gain = (f"{lean.gpu_kv_tokens:,} context tokens on the GPU instead of {plan.gpu_kv_tokens:,}"
                    if lean.offload_layers == plan.offload_layers else
                    f"{lean.offload_layers} layers streamed from host RAM instead of {plan.offload_layers}")
            console.print(f"[yellow]note:[/] --kvmem-selector hybrid-mid keeps no key sums: summaries "
                          f"{lean.summary_bytes / GIB:.2f} GiB instead of {plan.summary_bytes / GIB:.2f} GiB, {gain}")
    if plan.fits:
        print("fits")  # the verdict is the command's result: stdout, beside the table
        return 0
    for p in plan.problems:
        console.print(f"[red]does not fit:[/] {p}")
    return EXIT_BAD_INPUT


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve", help="serve the OpenAI + Anthropic HTTP APIs")
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="required off loopback (or KVTIER_API_KEY)")
    p.add_argument("--cors", nargs="+", default=(), metavar="ORIGIN",
                   help="allow cross-origin browser requests from these origins ('*' = any)")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in the engine at once")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting beyond those; more get 429/529")
    p.add_argument("--served-name", default=None)
    p.add_argument("--open", action="store_true", help="open the chat page in a browser once serving")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling default for requests that send none (a request's own value wins)")
    p.add_argument("--top-p", type=float, default=1.0, help="default top_p (as --temperature)")
    p.add_argument("--top-k", type=int, default=0, help="default top_k, 0 = off (as --temperature)")
    p.add_argument("--min-p", type=float, default=0.0, help="default min_p (as --temperature)")
    p.add_argument("--gpu-memory-limit", default=None,
                   help="cap on everything kvtier allocates on the GPU, e.g. 12GiB (checked by `kvtier plan`)")
    p.add_argument("--progress-log-s", type=float, default=1.0, metavar="SECONDS",
                   help="a long request logs what it is doing (prompt read, tokens out, tok/s) this often")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("generate", help="complete one prompt")
    _engine_args(p)
    _sampling_args(p)
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("chat", help="interactive chat in the terminal")
    _engine_args(p)
    _sampling_args(p)
    p.add_argument("--system", default=None)
    p.set_defaults(fn=cmd_chat)
    p = sub.add_parser("inspect", help="describe a model file without loading it")
    p.add_argument("model")
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("models", help="list or fetch named models")
    p.add_argument("action", choices=("list", "fetch"))
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true", help="list: one JSON array of the models")
    p.set_defaults(fn=cmd_models)
    p = sub.add_parser("bench", help="decode/prefill tokens/s vs HF transformers")
    _engine_args(p)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--llama-cpp", action="store_true")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="also stream the same requests through llama.cpp's llama-server binary at PATH "
                        "(GGUF models), beside --serve")
    p.add_argument("--out", default=None, help="append a markdown table here")
    p.add_argument("--shape", default=None, help="random weights of a real shape (kvtier.bench.shapes)")
    p.add_argument("--gpu-memory-limit", default=None,
                   help="as serve's: size the pools from the plan, stream the layers it needs, and cap "
                        "the process's GPU memory there (peak GPU memory is reported)")
    p.add_argument("--cached-tokens", type=int, default=0, help="prefix-cache TTFT: cached history length")
    p.add_argument("--new-tokens", type=int, default=50, help="prefix-cache TTFT: new tokens after it")
    p.add_argument("--swap-pages", type=int, default=0, help="host->GPU swap bandwidth over N pages")
    p.add_argument("--serve", action="store_true",
                   help="also stream the same requests through a real `kvtier serve` child (speed as users see it)")
    p.add_argument("--contexts", default=None,
                   help="grid bench (with --shape): prompt lengths, e.g. 1024,32768")
    p.add_argument("--batches", default="1", help="grid bench: concurrent requests, e.g. 1,32")
    p.add_argument("--kv-dtypes", default="bf16", help="grid bench: KV formats, e.g. bf16,int8,k8v4")
    p.add_argument("--grid-max-tokens", type=int, default=65536,
                   help="grid bench: skip batches > 1 whose prompts add up to more tokens")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("plan", help="memory plan for a model, context and limits")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL)
    p.add_argument("--gpu-memory-limit", default=None)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--kv-dtype", default="bf16")
    p.add_argument("--host-kv-mib", type=int, default=0)
    p.add_argument("--offload-layers", type=int, default=None,
                   help="layers streamed from host RAM (default: the fewest --gpu-memory-limit needs)")
    p.add_argument("--kvmem-budget", type=int, default=0,
                   help="retrieval attention on (as serve's flag): count its page summaries on the GPU")
    p.add_argument("--kvmem-selector", default=RetrievalConfig.selector, choices=SELECTORS,
                   help="as serve's flag: hybrid-mid / quest / quest-max / midrange keep no key sums")
    p.add_argument("--kvmem-summary-bits", type=_summary_bits, default=RetrievalConfig.summary_bits,
                   metavar="{auto,8,16}", help="as serve's flag (a plan is for the GPU: auto is 8)")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("eval", help="quality evaluations (recall: dense vs retrieval attention)")
    from kvtier.eval import recall_cli  # torch-free: the evaluation itself is imported when it runs
    evals = p.add_subparsers(dest="eval_cmd", required=True)
    recall_cli.add_parser(evals)
    recall_cli.add_planted_parser(evals)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.cmd == "models" and a.action == "fetch" and not a.name:
        console.print("[red]error:[/] kvtier models fetch NAME (see kvtier models list)")
        return EXIT_BAD_INPUT
    try:
        return a.fn(a)
    except ValueError as e:  # bad model file, bad config, context overflow: one line, exit 2
        console.print(f"[red]error:[/] {e}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvtier models list | head -1`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
