"""`kvtier bench` end to end on a tiny random-weight shape: kvtier and HF rows, markdown output, prefix TTFT."""

from __future__ import annotations

from kvtier.cli import main


def test_bench_random_shape_writes_table(tmp_path, capsys):
    out = tmp_path / "bench.md"
    assert main(["bench", "--shape", "llama-tiny", "--prompt-tokens", "24", "--gen-tokens", "6",
                 "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in lines
            if ln.startswith("| ") and not ln.startswith("| engine")}
    assert set(rows) == {"kvtier", "hf-transformers"}
    for cells in rows.values():
        prompt, gen, ttft, prefill, decode = cells[:5]
        assert (prompt, gen) == ("24", "6")
        assert float(ttft) >= 0 and float(prefill) > 0 and float(decode) > 0
    assert "memory bandwidth" in lines[1]


def test_bench_prefix_cache_ttft(tmp_path):
    out = tmp_path / "prefix.md"
    assert main(["bench", "--shape", "llama-tiny", "--cached-tokens", "256", "--new-tokens", "8",
                 "--no-hf", "--out", str(out)]) == 0
    text = out.read_text()
    assert "256 cached + 8 new tokens" in text and "prefix hit" in text
