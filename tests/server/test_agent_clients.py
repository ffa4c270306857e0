"""The real agent CLIs (Claude Code, Codex) through one tool-using turn against `kvtier serve`.

The clients come from npm (`make install-test` puts them in .venv/npm when npm exists; or set
KVTIER_AGENT_CLIENTS to a `node_modules/.bin` folder); without them these tests skip.

Models: Qwen2.5-Coder-0.5B for Claude Code, 1.5B for Codex (GGUFs fetched once into the kvtier
cache; KVTIER_AGENT_MODEL=<gguf> serves another for both). The embedded SmolLM2-135M cannot drive a
tool call. The small models write their calls as bare or fenced JSON (no <tool_call> tags, which
kvtier accepts as llama.cpp does). Neither client sends a temperature; both servers run greedy
(`kvtier serve --temperature 0`, the default for requests that send none), so a turn is the same
every time. Claude Code's 0.5B runs the command on the first try. For Codex the 0.5B either
answers without calling a tool or, having run the command, calls it again and again until the run
times out (at temperature 1 and greedy alike); the 1.5B at temperature 1 answered without the tool
in 2 of 3 runs, greedy it runs the command and ends the turn. Each client gets MAX_ATTEMPTS tries.
Claude Code runs `--bare` with only the Bash tool and a one-line system prompt (~560 prompt
tokens); its default prompt is ~12K tokens, several minutes of prefill on 2 CPU cores. Codex
runs with its defaults (~6K tokens).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import REPO, ServerProcess

CLIENT_BIN = Path(os.environ.get("KVTIER_AGENT_CLIENTS", REPO / ".venv" / "npm" / "node_modules" / ".bin"))
# Greedy, a small model may loop on tools or run another command; each try meets another
# prefix-cache state (the cached prompt comes back from another chunking), so tries differ.
MAX_ATTEMPTS = 3
TURN_TIMEOUT_S = 300  # one client run, prefill of a ~6K-token prompt on a busy 2-core box included
# The whole test: every try run to its timeout, plus the server's start (the 1.5B loads in ~50 s).
TEST_TIMEOUT_S = MAX_ATTEMPTS * TURN_TIMEOUT_S + 240


def _run_client(cmd: list[str], workdir: Path, env: dict[str, str]) -> list[dict]:
    """The client's JSON events. A run still going at TURN_TIMEOUT_S (the model kept calling
    tools) is stopped and counts as a try that wrote nothing; its events so far are returned."""
    try:
        p = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=TURN_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
        out = p.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
TASK = "echo hi > hello.txt && cat hello.txt"
SERVED = "qwen2.5-coder"  # both servers answer to this name


def _client(name: str) -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm not installed: the agent clients come from npm")
    path = CLIENT_BIN / name
    if not path.exists():
        pytest.skip(f"{path} missing: run `make install-test` (npm install --prefix .venv/npm ...)")
    return path


def _serve(model_path: Path, *extra: str) -> ServerProcess:
    return ServerProcess([sys.executable, "-m", "kvtier", "serve", "--model", str(model_path), "--served-name",
                          SERVED, "--device", "cpu", "--max-model-len", "16384", *extra])


def _agent_model(default: str) -> Path:
    """The GGUF at KVTIER_AGENT_MODEL, else the registry model `default` (fetched once)."""
    override = os.environ.get("KVTIER_AGENT_MODEL")
    if override:
        return Path(override).expanduser()
    from kvtier.models.hub import fetch
    return fetch(default, progress=False)


@pytest.fixture(scope="module")
def qwen_server():
    """Claude Code's turn, greedy (`--temperature 0`: the same every time) on the 0.5B model."""
    srv = _serve(_agent_model("qwen2.5-coder-0.5b"), "--temperature", "0")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def codex_server():
    """Codex's turn, greedy (`--temperature 0`: Codex sends no temperature) on the 1.5B model."""
    srv = _serve(_agent_model("qwen2.5-coder-1.5b"), "--temperature", "0")
    yield srv
    srv.stop()


def _statuses(srv: ServerProcess, path: str) -> list[int]:
    """Status codes of `path` requests from the server's access log."""
    return [int(s) for s in re.findall(rf'"(?:POST|GET|HEAD) {re.escape(path)}\S* HTTP/1.1" (\d+)', srv.output())]


def _attempts(run, workdir: Path, ended=lambda events: True) -> tuple[int, list]:
    """Runs until one writes the file and `ended(events)` (the client ended its turn):
    (the 1-based number of that run or 0, every run's events)."""
    results = []
    for i in range(MAX_ATTEMPTS):
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir()
        results.append(run(workdir))
        if (workdir / "hello.txt").exists() and ended(results[-1]):
            return i + 1, results
    return 0, results


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_claude_code_tool_turn(qwen_server, tmp_path):
    claude = _client("claude")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": qwen_server.url, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_MODEL": SERVED, "ANTHROPIC_SMALL_FAST_MODEL": SERVED, "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}

    def run(workdir: Path) -> list[dict]:
        cmd = [str(claude), "-p", f"Use the Bash tool to run this command: {TASK}", "--output-format", "stream-json",
               "--verbose", "--bare", "--tools", "Bash", "--allowedTools", "Bash", "--max-turns", "3",
               "--system-prompt", "You are a coding agent. Call the tools to act."]
        return _run_client(cmd, workdir, env)

    attempt, runs = _attempts(run, tmp_path / "work")
    statuses = _statuses(qwen_server, "/v1/messages")
    print(f"claude code: POST /v1/messages statuses {statuses}")
    assert statuses and all(s == 200 for s in statuses), statuses
    assert attempt, f"no run wrote the file: {[r[-1].get('result') for r in runs if r]}"
    events = runs[attempt - 1]
    assert any(b.get("type") == "tool_use" and b.get("name") == "Bash"
               for e in events if e.get("type") == "assistant" for b in e["message"]["content"])
    assert (tmp_path / "work" / "hello.txt").read_text().strip() == "hi"
    result = events[-1]
    # the 0.5B model may keep calling tools until --max-turns; either way the client ended cleanly
    assert result["type"] == "result" and result["subtype"] in ("success", "error_max_turns"), result
    # the turn after the tool call read the first request's whole prompt from the prefix cache
    print(f"claude code: turn usage {result['usage']}")
    assert result["usage"]["cache_read_input_tokens"] > 0


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_codex_tool_turn(codex_server, tmp_path):
    qwen_server = codex_server
    codex = _client("codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{SERVED}"\nmodel_provider = "kvtier"\ncheck_for_update_on_startup = false\n\n'
        f'[model_providers.kvtier]\nname = "kvtier"\nbase_url = "{qwen_server.url}/v1"\nwire_api = "responses"\n')
    env = {**os.environ, "CODEX_HOME": str(home), "HOME": str(tmp_path)}

    def run(workdir: Path) -> list[dict]:
        cmd = [str(codex), "exec", "--json", "--skip-git-repo-check", "-s", "danger-full-access",
               f"Run this shell command with the exec_command tool: {TASK}"]
        return _run_client(cmd, workdir, env)

    def ran_and_ended(events: list[dict]) -> bool:
        """The turn ran the command (a model may write the file another way, e.g. apply_patch: not
        what was asked) and ended."""
        return (any(e.get("type") == "turn.completed" for e in events)
                and any(e.get("type") == "item.completed" and e["item"].get("type") == "command_execution"
                        for e in events))

    attempt, runs = _attempts(run, tmp_path / "work", ran_and_ended)
    statuses = _statuses(qwen_server, "/v1/responses")
    print(f"codex: POST /v1/responses statuses {statuses}")
    assert statuses and all(s == 200 for s in statuses), statuses
    turns = [e for r in runs for e in r if e.get("type") == "turn.completed"]
    assert attempt, (f"no run in {MAX_ATTEMPTS} ran the command and ended its turn ({len(turns)} ended; the others "
                     f"were stopped still calling tools after {TURN_TIMEOUT_S} s): {turns}")
    print(f"codex: the run that ran the command and ended was try {attempt} of {MAX_ATTEMPTS}")
    events = runs[attempt - 1]
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    assert any(i.get("type") == "command_execution" for i in items), [
        {k: str(v)[:200] for k, v in i.items()} for i in items]
    done = [e for e in events if e.get("type") == "turn.completed"]
    print(f"codex: turn usage {done[-1]['usage'] if done else None}")
    assert done and done[-1]["usage"]["cached_input_tokens"] > 0, done
