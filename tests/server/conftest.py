"""Server test fixtures: the real SmolLM2 tokenizer, a FakeEngine, in-process and real-process servers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `tests.server.*` imports work under plain `pytest` too
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import pytest  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from kvtier.config import ServerConfig
from kvtier.server.app import create_app
from tests.server.fakes import FakeEngine, HFTokenizer

SERVER_START_TIMEOUT_S = 90  # tokenizer load + uvicorn start on a slow 2-core CI box
API_KEY = "test-key-123"



def tokenizer_cache_dir() -> Path:
    """The SmolLM2 tokenizer saved once as tokenizer.json (reading it from the GGUF takes ~10 s)."""
    d = Path(tempfile.gettempdir()) / f"kvtier-test-smollm2-tokenizer-{os.getuid()}"
    d.mkdir(exist_ok=True)
    if not (d / "tokenizer.json").exists():
        HFTokenizer.load(d)
    return d


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return tokenizer_cache_dir()


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return HFTokenizer.load(tokenizer_dir)


@pytest.fixture
def engine(tokenizer) -> FakeEngine:
    return FakeEngine(tokenizer)


def make_client(engine, **cfg) -> TestClient:
    cfg.setdefault("model_name", "smollm2-135m")
    return TestClient(create_app(engine, ServerConfig(**cfg)), base_url="http://127.0.0.1:8000")


@pytest.fixture
def client(engine):
    with make_client(engine) as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], env_extra: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"kvtier-test-server-{self.port}.log", "w+")
        self.proc = subprocess.Popen([*args, "--port", str(self.port)], cwd=REPO, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not start in {SERVER_START_TIMEOUT_S} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# The embedded model served for real: CPU, small context so prompt + max_tokens checks are cheap,
# small prefill chunks so a ~1k-token prompt reports progress.
# progress lines every 0.2 s: a test prompt's prefill can finish within the default second on a fast box
REAL_MODEL_ARGS = ["--device", "cpu", "--max-model-len", "2048", "--prefill-chunk", "128", "--progress-log-s", "0.2"]


def real_server_process(*extra: str) -> ServerProcess:
    return ServerProcess([sys.executable, "-m", "kvtier", "serve", *REAL_MODEL_ARGS, *extra])


@pytest.fixture(scope="session")
def real_server():
    """`kvtier serve` on the embedded SmolLM2-135M, shared by every real-model test module."""
    srv = real_server_process("--api-key", API_KEY, "--max-concurrency", "8", "--max-queue", "64")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def fake_server(tokenizer_dir):
    """A real uvicorn process over the FakeEngine (the real-model variant lives beside it)."""
    srv = ServerProcess([sys.executable, "-m", "tests.server.fake_server", "--tokenizer-dir", str(tokenizer_dir),
                         "--api-key", API_KEY, "--token-delay", "0.002", "--max-concurrency", "8",
                         "--max-queue", "64"])
    yield srv
    srv.stop()
