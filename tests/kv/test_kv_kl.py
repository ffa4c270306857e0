"""The KV-quality harness (python -m kvtier.eval.kv_kl) runs end to end on the real SmolLM2."""

from __future__ import annotations

import json

from kvtier.engine.calibrate import prose_text
from kvtier.eval.kv_kl import main


def test_prose_text_is_prose() -> None:
    text = prose_text()
    assert len(text) > 50_000 and "def " not in text[:5000]


def test_harness_cli_int8_kl_is_tiny(smollm2_path, tmp_path, capsys) -> None:
    out = tmp_path / "kl.json"
    main(["--model", str(smollm2_path), "--tokens", "64", "--chunk", "32", "--formats", "bf16,int8",
          "--json", str(out)])
    table = capsys.readouterr().out
    assert "| int8 |" in table and "64 tokens" in table
    res = {r["fmt"]: r for r in json.loads(out.read_text())}
    assert res["bf16"]["mean_kl"] == 0.0 and res["bf16"]["top1_agree"] == 1.0
    assert 0 < res["int8"]["mean_kl"] < 2e-3  # 2K-token figures: docs/benchmarks.md, "KV quality"
    assert res["int8"]["bytes_per_token"] < res["bf16"]["bytes_per_token"]
