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
in 2 of 3 runs; greedy it runs the command, then either ends the turn or calls write_stdin on the
finished process until stopped (which of the two flips with the prompt's numerics: see
test_codex_tool_turn). Each client gets MAX_ATTEMPTS tries.
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
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import REPO, ServerProcess

CLIENT_BIN = Path(os.environ.get("KVTIER_AGENT_CLIENTS", REPO / ".venv" / "npm" / "node_modules" / ".bin"))
# Greedy, a small model may loop on tools or run another command; each try meets another
# prefix-cache state (the cached prompt comes back from another chunking), so tries differ.
MAX_ATTEMPTS = 3
TURN_TIMEOUT_S = 300  # one client run, prefill of a ~6K-token prompt on a busy 2-core box included
# The whole test: every try run to its timeout, plus the server's start (the 1.5B loads in ~50 s).
TEST_TIMEOUT_S = MAX_ATTEMPTS * TURN_TIMEOUT_S + 240
# Codex: seconds a run goes on for its turn to end once the follow-up to the command was answered
END_GRACE_S = 60


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


def _metric(srv: ServerProcess, name: str) -> float:
    """One unlabelled counter from the server's /metrics."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _codex_run(cmd: list[str], workdir: Path, env: dict[str, str], srv: ServerProcess) -> list[dict]:
    """One Codex run, stopped once the server has answered the request that carried the command's
    output back (the model's reply to it parsed into a message or another call) and the turn had
    END_GRACE_S more to end, or at TURN_TIMEOUT_S. Returns the client's JSON events."""
    out = workdir.parent / f"{workdir.name}-events.jsonl"
    ran_at = None
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=f, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + TURN_TIMEOUT_S
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
                events = _events(out)
                if ran_at is None and any(_ran(e) for e in events):
                    ran_at = len(_statuses(srv, "/v1/responses"))  # requests answered when the command ran
                if ran_at is not None and len(_statuses(srv, "/v1/responses")) > ran_at:
                    deadline = min(deadline, time.monotonic() + END_GRACE_S)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return _events(out)


def _events(path: Path) -> list[dict]:
    events = []
    for ln in path.read_text().splitlines():
        try:
            events.append(json.loads(ln))
        except json.JSONDecodeError:
            pass  # the line being written when we read
    return events


def _ran(e: dict) -> bool:
    """A completed command_execution item: Codex ran a shell call the model made (a model may write
    the file another way, e.g. apply_patch: not what was asked)."""
    return e.get("type") == "item.completed" and e["item"].get("type") == "command_execution"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_codex_tool_turn(codex_server, tmp_path):
    """Codex over the Responses API: the model's call streams as a function_call item that Codex
    runs, the command's output comes back as a function_call_output that the server parses and
    answers from the prefix cache. Whether the greedy 1.5B then ends its turn is the model's
    behaviour, not the server's: after Codex's "Chunk ID ... Process exited with code 0" output it
    often calls write_stdin on the finished process again and again (seen through every try of a CI
    run). So the run stops END_GRACE_S after the follow-up is answered; an ended turn is checked
    further (its usage) when it comes."""
    srv = codex_server
    codex = _client("codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{SERVED}"\nmodel_provider = "kvtier"\ncheck_for_update_on_startup = false\n\n'
        f'[model_providers.kvtier]\nname = "kvtier"\nbase_url = "{srv.url}/v1"\nwire_api = "responses"\n')
    env = {**os.environ, "CODEX_HOME": str(home), "HOME": str(tmp_path)}

    def run(workdir: Path) -> list[dict]:
        cmd = [str(codex), "exec", "--json", "--skip-git-repo-check", "-s", "danger-full-access",
               f"Run this shell command with the exec_command tool: {TASK}"]
        return _codex_run(cmd, workdir, env, srv)

    attempt, runs = _attempts(run, tmp_path / "work", lambda events: any(_ran(e) for e in events))
    statuses = _statuses(srv, "/v1/responses")
    print(f"codex: POST /v1/responses statuses {statuses}")
    assert statuses and all(s == 200 for s in statuses), statuses
    assert attempt, f"no run in {MAX_ATTEMPTS} ran the command: {[[e.get('type') for e in r] for r in runs]}"
    print(f"codex: the command ran on try {attempt} of {MAX_ATTEMPTS}")
    events = runs[attempt - 1]
    ran = [e["item"] for e in events if _ran(e)]
    assert ran[0].get("exit_code") == 0 and "hi" in ran[0].get("aggregated_output", ""), ran[0]
    assert (tmp_path / "work" / "hello.txt").read_text().strip() == "hi"
    # the request that carried the command's output back was answered (a 200 after the call's),
    # and the follow-ups read the conversation so far from the prefix cache
    assert len(statuses) >= 2, statuses
    cached = _metric(srv, "kvtier_cached_prompt_tokens")
    print(f"codex: prompt tokens served from the prefix cache {cached:.0f}")
    assert cached > 0
    done = [e for e in events if e.get("type") == "turn.completed"]
    print(f"codex: turn ended: {bool(done)}; usage {done[-1]['usage'] if done else None}")
    if done:
        assert done[-1]["usage"]["cached_input_tokens"] > 0, done
