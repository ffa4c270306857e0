"""Test-only entry: `python -m tests.server.fake_server --port N --tokenizer-dir D`.

Serves the real HTTP app over FakeEngine in a real uvicorn process, so the SDK
tests exercise sockets, streaming and disconnects exactly as in production.
GET /_test/stats exposes the fake engine's counters (running, aborted).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn

from kvtier.config import ServerConfig
from kvtier.server.app import create_app
from tests.server.fakes import FakeEngine, HFTokenizer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokenizer-dir", type=Path, required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    engine = FakeEngine(HFTokenizer.load(a.tokenizer_dir), max_model_len=a.max_model_len, token_delay=a.token_delay)
    app = create_app(engine, ServerConfig(port=a.port, api_key=a.api_key, max_concurrency=a.max_concurrency,
                                          max_queue=a.max_queue))

    @app.get("/_test/stats", include_in_schema=False)
    async def _stats() -> dict:
        return {**engine.stats(), "aborted": len(engine.aborted)}

    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
