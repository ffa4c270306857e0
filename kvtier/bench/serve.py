"""`kvtier bench --serve`: decode speed as a user sees it, streamed through a real `kvtier serve`.

The server runs in a child process (its own event loop and engine thread, as in production) on a
free loopback port; this process is the client. Each request sends the bench's token ids to
/v1/completions with `stream: true` and `ignore_eos`, and times the chunks as they arrive:

    TTFT     request sent -> first text chunk
    decode   (completion tokens - 1) / (last chunk - first chunk)

`--llama-server PATH` times llama.cpp's own server the same way, on the same GGUF and token ids.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time

import httpx

# Seconds a child server may take to load its model and answer /health.
START_TIMEOUT_S = 300
# Streamed requests timed (the first one also warms the server up and is not counted).
SERVE_REPEATS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(a) -> list[str]:
    """The engine options of this bench run, as `kvtier serve` arguments."""
    out = ["--model", a.model, "--device", a.device, "--dtype", a.dtype, "--kv-dtype", a.kv_dtype]
    for flag, val in (("--threads", a.threads), ("--decode-threads", a.decode_threads),
                      ("--max-model-len", a.max_model_len)):
        if val is not None:
            out += [flag, str(val)]
    return out


Gaps = tuple[float, float, float]  # ms between streamed text chunks: median, 99th percentile, longest


def bench_serve(a, ids: list[int], gen: int) -> tuple[float, float, int, Gaps]:
    """(TTFT s, streamed decode tok/s, completion tokens, chunk gaps): the median of SERVE_REPEATS
    requests by tok/s; the gaps pooled over all of them."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kvtier", "serve", "--port", str(port), *serve_args(a)]
    return _time_server(cmd, port, "kvtier serve", ids, gen)


def bench_llama_server(binary: str, gguf: str, ids: list[int], gen: int,
                       threads: int) -> tuple[float, float, int, Gaps]:
    """The same streamed requests against llama.cpp's own server (`llama-server` at `binary`) on the
    same GGUF: as bench_serve."""
    port = _free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-c", str(len(ids) + gen + 64), "-np", "1", "--no-webui"]
    return _time_server(cmd, port, "llama-server", ids, gen)


def _time_server(cmd: list[str], port: int, who: str, ids: list[int],
                 gen: int) -> tuple[float, float, int, Gaps]:
    """Start a server child, stream SERVE_REPEATS + 1 requests (the first warms up), stop it."""
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(proc, url, who)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        # each request rotated so no prefix-cache hit shortens its TTFT
        runs = [_stream(url, model, ids[7 * i:] + ids[:7 * i], gen) for i in range(SERVE_REPEATS + 1)][1:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    gaps = sorted(g for r in runs for g in r[3])
    runs.sort(key=lambda r: r[1])
    ttft, tok_s, tokens, _ = runs[len(runs) // 2]
    return ttft, tok_s, tokens, gap_percentiles(gaps)


def gap_percentiles(gaps: list[float]) -> Gaps:
    """Sorted gaps in seconds -> (median, 99th percentile by nearest rank, longest) in ms (zeros
    when empty)."""
    if not gaps:
        return 0.0, 0.0, 0.0
    return gaps[len(gaps) // 2] * 1e3, gaps[math.ceil(0.99 * len(gaps)) - 1] * 1e3, gaps[-1] * 1e3


def _wait_ready(proc: subprocess.Popen, url: str, who: str = "kvtier serve") -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{who} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{who} did not answer /health within {START_TIMEOUT_S} s")


def _stream(url: str, model: str, ids: list[int], gen: int) -> tuple[float, float, int, list[float]]:
    """One streamed completion: (TTFT s, decode tok/s, completion tokens, seconds between text chunks)."""
    body = {"model": model, "prompt": ids, "max_tokens": gen, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    gaps: list[float] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                first = first or last
    if first is None or last is None or tokens < 2:
        raise RuntimeError("the server streamed no text")
    return first - t0, (tokens - 1) / max(last - first, 1e-9), tokens, gaps
