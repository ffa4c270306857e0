"""`kvtier models list | inspect | plan` output: whole identifiers, plain text when piped, --json."""

from __future__ import annotations

import io
import json

from rich.table import Table

from kvtier.cli import main, plain_table, print_tables
from kvtier.models.hub import MODELS


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_models_list_piped_is_plain_and_whole(capsys):
    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("\t")[:2] == ["name", "status"]
    rows = [ln.split("\t") for ln in lines[1:]]
    assert [r[0] for r in rows] == list(MODELS)  # `| grep qwen2.5-coder-0.5b` finds the row
    assert all(r[1] in ("fetched", "not fetched") for r in rows)
    assert "…" not in "".join(lines)
    assert not any("\x1b[" in ln for ln in lines)  # no colour codes into a pipe


def test_models_list_json(capsys):
    assert main(["models", "list", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in models] == list(MODELS)
    for m in models:
        assert m["fetched"] == (m["path"] is not None) == (m["size"] is not None)
        assert len(m["sha256"]) == 64


def test_tty_table_never_cuts_identifiers(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.delenv("NO_COLOR", raising=False)
    name = "qwen2.5-coder-0.5b-instruct-with-a-long-name"
    t = Table("name", "description", title="models")
    t.add_row(name, "a description long enough that it has to wrap somewhere " * 2)
    out = FakeTTY()
    print_tables(t, out=out)
    text = out.getvalue()
    assert "…" not in text
    # folded cells continue on the next line: the name's pieces, joined, give the name back
    pieces = [ln.split("│")[1].strip() for ln in text.splitlines() if ln.count("│") >= 2]
    assert name in "".join(pieces)


def test_plain_table_shape():
    t = Table("a", "b", title="[bold]T[/]")
    t.add_row("x y", "[green]ok[/]")
    assert plain_table(t) == ["# T", "a\tb", "x y\tok"]


def test_inspect_piped_and_json(capsys, smollm2_path):
    assert main(["inspect", str(smollm2_path)]) == 0
    out = capsys.readouterr().out
    assert f"# {smollm2_path.name}" in out and "architecture\tllama" in out
    assert main(["inspect", str(smollm2_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["arch"] == "llama" and info["path"] == str(smollm2_path)


def test_plan_piped_is_plain(capsys, smollm2_path):
    assert main(["plan", "--model", str(smollm2_path), "--context", "2048"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# memory plan:") and out[1] == "item\tsize\ttokens"
    assert any(ln.startswith("context KV\t") and ln.endswith("\t2048") for ln in out)
