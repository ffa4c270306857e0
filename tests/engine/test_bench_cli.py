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


def test_bench_serve_streams_through_a_real_server(tmp_path):
    """--serve: the same token ids streamed through a `kvtier serve` child, as a table row."""
    out = tmp_path / "serve.md"
    assert main(["bench", "--model", "smollm2-135m", "--prompt-tokens", "32", "--gen-tokens", "8", "--no-hf",
                 "--serve", "--out", str(out)]) == 0
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
            for ln in out.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| engine")}
    assert set(rows) == {"kvtier", "kvtier serve, streamed"}
    prompt, gen, ttft, _, decode = rows["kvtier serve, streamed"][:5]
    assert (prompt, gen) == ("32", "8") and float(ttft) > 0 and float(decode) > 0
    med, p99, longest = (float(x) for x in rows["kvtier serve, streamed"][6].split("/"))  # token gaps, ms
    assert 0 < med <= p99 <= longest
    assert rows["kvtier"][6] == ""  # the in-process row streams nothing


def test_gap_percentiles():
    from kvtier.bench.serve import gap_percentiles
    assert gap_percentiles([]) == (0.0, 0.0, 0.0)
    gaps = sorted([0.01] * 98 + [0.05, 0.4])  # seconds
    assert gap_percentiles(gaps) == (10.0, 50.0, 400.0)


def test_grid_bench_rows(tmp_path):
    """The decode grid: one row per KV format x context x batch, % of bound with KV bytes counted."""
    out = tmp_path / "grid.md"
    assert main(["bench", "--shape", "llama-tiny", "--contexts", "40,70", "--batches", "1,2", "--kv-dtypes",
                 "fp32,int8", "--gen-tokens", "5", "--no-hf", "--out", str(out)]) == 0
    rows = [ln.split("|")[1:-1] for ln in out.read_text().splitlines()
            if ln.startswith("| kvtier")]
    assert len(rows) == 2 * 2 * 2
    assert {(r[1].strip(), r[2].strip(), r[3].strip()) for r in rows} == {
        (kv, c, b) for kv in ("fp32", "int8") for c in ("40", "70") for b in ("1", "2")}
    assert all(float(r[6]) > 0 and r[7].strip().endswith("%") for r in rows)
    steps = [[float(x) for x in r[8].split("/")] for r in rows]  # decode step ms: median / slowest
    assert all(0 < med <= slowest for med, slowest in steps)


def test_grid_bench_shorter_than_its_warm_up(tmp_path):
    """Contexts shorter than the grid's warm-up request (64 + 8 tokens): max_model_len counts it."""
    out = tmp_path / "grid.md"
    assert main(["bench", "--shape", "llama-tiny", "--contexts", "24", "--batches", "1", "--kv-dtypes", "fp32",
                 "--gen-tokens", "4", "--no-hf", "--out", str(out)]) == 0
    assert sum(ln.startswith("| kvtier") for ln in out.read_text().splitlines()) == 1


def test_grid_bench_past_the_pool_with_a_host_tier(tmp_path):
    """With a host tier, contexts longer than the compute pool run (the issue-12 table), here with
    retrieval past a small budget; without one they are skipped."""
    out = tmp_path / "grid.md"
    args = ["bench", "--shape", "llama-tiny", "--contexts", "64,12000", "--batches", "1", "--kv-dtypes", "int8",
            "--gen-tokens", "4", "--no-hf", "--page-size", "16", "--gpu-kv-mib", "1", "--kvmem-budget", "128",
            "--kvmem-window", "32",
            "--out", str(out)]
    assert main(args + ["--host-kv-mib", "8"]) == 0
    rows = [ln.split("|")[1:-1] for ln in out.read_text().splitlines() if ln.startswith("| kvtier")]
    assert {r[2].strip() for r in rows} == {"64", "12000"}
    out.unlink()
    assert main(args) == 0
    rows = [ln.split("|")[1:-1] for ln in out.read_text().splitlines() if ln.startswith("| kvtier")]
    assert {r[2].strip() for r in rows} == {"64"}


def test_step_kv_bytes_counts_what_a_step_reads():
    """Dense: the whole context's KV; retrieval past its budget: the budget's KV plus the whole
    context's summaries; at or under the budget it is dense attention, read as such."""
    from kvtier.bench.grid import step_kv_bytes
    assert step_kv_bytes(1000, 2, 10.0) == 2 * 1000 * 10.0
    assert step_kv_bytes(1000, 1, 10.0, budget=2048, summary_per_token=1.5) == 1000 * 10.0
    assert step_kv_bytes(262144, 1, 10.0, budget=2048, summary_per_token=1.5) == 2048 * 10.0 + 262144 * 1.5
