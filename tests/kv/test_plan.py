"""Memory plan: per-tier sizes and tokens, `kvtier plan` output, `serve` refusing before loading."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kvtier.engine.plan as plan_mod
from kvtier.cli import main
from kvtier.config import CacheConfig, EngineConfig
from kvtier.engine.plan import GIB, MIB, checked_engine_config, make_plan, parse_size, spec_for

FREE_RAM = 64 * GIB  # host RAM the tests pretend is free (independent of the machine)


@pytest.fixture(autouse=True)
def _fixed_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_mod, "host_ram_available", lambda: FREE_RAM)


def test_parse_size() -> None:
    assert parse_size("12GiB") == 12 * GIB and parse_size("500MiB") == 500 * MIB
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("4096") == 4 * GIB
    with pytest.raises(ValueError, match="12GiB"):
        parse_size("twelve")


def test_plan_splits_context_across_tiers() -> None:
    spec = spec_for("qwen3-8b")
    p = make_plan(spec, "k8v4", 262144, 24 * GIB, None)
    assert p.fits and p.gpu_total_bytes <= 24 * GIB
    assert p.gpu_kv_tokens + p.host_kv_tokens >= 262144 - 1 and p.host_kv_tokens > 0
    room = 24 * GIB - p.weight_bytes - p.scratch_bytes - p.runtime_bytes - p.graph_bytes
    assert 0 <= room - p.gpu_kv_bytes < 16 * p.kv_bytes_per_token  # the room, in whole pages
    # a quantized format fits more tokens per GiB
    assert make_plan(spec, "bf16", 262144, 24 * GIB, None).gpu_kv_tokens < p.gpu_kv_tokens / 2.5
    short = make_plan(spec, "k8v4", 4096, 24 * GIB, None)
    assert short.fits and short.host_kv_bytes == 0 and short.gpu_kv_tokens == 4096


def test_plan_refusals_say_what_to_change() -> None:
    spec = spec_for("qwen3-8b")
    p = make_plan(spec, "k8v4", 131072, 12 * GIB, None, offload_layers=0)  # 15 GiB of bf16 weights, none streamed
    assert not p.fits and "raise --gpu-memory-limit to at least" in p.problems[0]
    p = make_plan(spec, "k8v4", 131072, 2 * GIB, None)  # embedding + head alone: 2.3 GiB, every layer streamed
    assert not p.fits and p.offload_layers == spec.num_layers and "already streaming 36 of 36" in p.problems[0]
    p = make_plan(spec, "k8v4", 262144, 24 * GIB, 64 * MIB)
    assert not p.fits and "--host-kv-mib" in p.problems[0]


def test_plan_cli_prints_every_tier(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "qwen3-8b", "--gpu-memory-limit", "24GiB", "--context", "262144",
                 "--kv-dtype", "k8v4"]) == 0
    out = capsys.readouterr().out
    for row in ("weights", "GPU KV pool", "host KV tier", "scratch", "CUDA graphs", "CUDA runtime", "fits"):
        assert row in out
    assert main(["plan", "--model", "qwen3-8b", "--gpu-memory-limit", "12GiB", "--kv-dtype", "k8v4",
                 "--offload-layers", "0"]) == 2
    capsys.readouterr()
    assert main(["plan", "--model", "qwen3-8b", "--gpu-memory-limit", "12GiB", "--kv-dtype", "k8v4"]) == 0
    assert "weights streamed from host RAM" in capsys.readouterr().out


def test_plan_cli_lean_summaries_note_counts_streamed_layers(capsys: pytest.CaptureFixture[str]) -> None:
    """Where the key sums cost streamed weight layers rather than GPU pool tokens (a 32B 4-bit
    shape at 256K under 12 GiB: the pool stays at its floor either way), the note says how many
    layers fewer stream with hybrid-mid."""
    args = ["plan", "--model", "qwen3-32b-int4", "--gpu-memory-limit", "12GiB", "--kv-dtype", "k8v4",
            "--kvmem-budget", "2048", "--context", "262144"]
    main(args)  # (may not fit this box's free RAM: the note comes either way)
    got = capsys.readouterr()
    out = " ".join((got.out + got.err).split())
    full = plan_mod.plan_for_args("qwen3-32b-int4", "k8v4", 262144, "12GiB", 0, retrieval=True, key_sums=True,
                                  summary_bits=0)
    lean = plan_mod.plan_for_args("qwen3-32b-int4", "k8v4", 262144, "12GiB", 0, retrieval=True, key_sums=False,
                                  summary_bits=0)
    assert lean.offload_layers < full.offload_layers, "vacuous: the key sums cost no streamed layers"
    assert (f"{lean.offload_layers} layers streamed from host RAM instead of {full.offload_layers}") in out


def test_plan_cli_points_to_the_lean_summaries(capsys: pytest.CaptureFixture[str]) -> None:
    """With retrieval past the GPU pool and a selector that keeps key sums, `kvtier plan` says how
    much more of the context hybrid-mid's summaries leave on the GPU; not where nothing changes."""
    base = ["plan", "--model", "qwen3-8b-int4", "--gpu-memory-limit", "12GiB", "--kv-dtype", "k8v4",
            "--kvmem-budget", "2048"]
    assert main(base + ["--context", "262144"]) == 0
    got = capsys.readouterr()
    out = " ".join((got.out + got.err).split())  # notes go to the console (stderr); rich wraps them
    assert "--kvmem-selector hybrid-mid keeps no key sums" in out
    lean = plan_mod.plan_for_args("qwen3-8b-int4", "k8v4", 262144, "12GiB", 0, retrieval=True, key_sums=False,
                                  summary_bits=0)  # the CLI's default: auto, 8-bit on the GPU
    assert f"{lean.gpu_kv_tokens:,} context tokens on the GPU" in out
    for extra in (["--context", "262144", "--kvmem-selector", "hybrid-mid"], ["--context", "16384"]):
        assert main(base + extra) == 0
        got = capsys.readouterr()
        assert "keeps no key sums" not in got.out + got.err


def test_serve_refuses_before_loading(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import kvtier.engine.build as build

    def no_load(*a, **k):
        raise AssertionError("serve loaded the model before checking the plan")

    monkeypatch.setattr(build, "build_engine", no_load)
    assert main(["serve", "--model", "qwen3-8b", "--gpu-memory-limit", "12GiB", "--kv-dtype", "k8v4",
                 "--offload-layers", "0"]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "--gpu-memory-limit" in err


@pytest.mark.parametrize("context", [65536 + 32, 4096, 1000, 131072 + 32, 262144 + 32])
def test_a_context_that_fits_gets_every_page_it_needs(context: int) -> None:
    """The pool and host tier serve's config sizes from the plan hold every page of a max-length
    context (the last one partial), as the engine counts pages (`Engine._auto_pages`, the host
    pool's floor). Both came out a page or more short (MiB rounded down, tokens not pages), so `kvtier
    bench --gpu-memory-limit` skipped a 64K row for want of a host tier, and a 128K row, with a
    host tier, never finished."""
    from kvtier.kv.formats import make_format
    from kvtier.kv.pool import kv_bytes_per_token
    spec = spec_for("qwen3-8b-int4")
    cfg = EngineConfig(device="cuda", max_model_len=context, cache=CacheConfig(kv_dtype="k8v4"),
                       retrieval=replace(EngineConfig().retrieval, budget=2048))
    got = checked_engine_config(cfg, "qwen3-8b-int4", "12GiB")
    per_page = kv_bytes_per_token(make_format("k8v4"), spec.num_kv_heads, spec.head_dim, 16,
                                  torch.bfloat16) * spec.num_layers * 16
    gpu_pages = got.cache.gpu_kv_mib * MIB // per_page  # Engine._auto_pages' count
    host_pages = got.cache.host_kv_mib * MIB // per_page  # the host pool's
    assert gpu_pages + host_pages >= -(-context // 16)
    assert (host_pages == 0) == (context <= 65536 + 32)  # under 12 GiB the GPU pool holds 64K


def test_fitting_plan_sizes_the_pools() -> None:
    cfg = EngineConfig(device="cpu", max_model_len=262144)
    got = checked_engine_config(cfg, "qwen3-8b", "24GiB")
    p = make_plan(spec_for("qwen3-8b"), "bf16", 262144, 24 * GIB, None)
    assert got.cache.gpu_kv_mib == -(-p.gpu_kv_bytes // MIB) and got.cache.host_kv_mib * MIB >= p.host_kv_bytes
    assert checked_engine_config(cfg, "qwen3-8b", None) is cfg
    with pytest.raises(ValueError, match="--gpu-kv-mib"):
        checked_engine_config(replace(cfg, cache=replace(cfg.cache, gpu_kv_mib=20_000)), "qwen3-8b", "24GiB")


def test_plan_counts_a_gguf_as_stored(smollm2_path):
    """The plan's weight bytes are the QuantWeights' (and dense tensors' bf16) bytes the loader
    makes from the file, not every parameter in bf16."""
    from kvtier.engine.plan import plan_for_args
    from kvtier.layers.qweight import QuantWeight
    from kvtier.models.loading import load_checkpoint

    ckpt = load_checkpoint(smollm2_path, weights="stored")
    held = sum(t.nbytes() if isinstance(t, QuantWeight) else t.numel() * 2 for t in ckpt.tensors.values())
    plan = plan_for_args(str(smollm2_path), "bf16", 4096, None, 0)
    assert abs(plan.weight_bytes - held) <= 0.01 * held and plan.weight_format == "as stored in the GGUF"
    dense = plan_for_args(str(smollm2_path), "bf16", 4096, None, 0, weights="bf16")
    assert dense.weight_bytes > 2.5 * plan.weight_bytes and dense.weight_format == "bf16"


def test_a_32b_4bit_shape_with_256k_fits_12gib_by_streaming_layers() -> None:
    """Issue 11's target: a 27B/32B-class 4-bit model, a 256K k8v4 context, a 12 GiB GPU. The
    weights (19 GiB) cannot all stay: the plan streams the fewest layers that leave the KV floor,
    the rest of the context goes to the host tier, and serve's config takes the plan's count."""
    spec = spec_for("qwen3-32b-int4")
    whole = make_plan(spec, "k8v4", 262144, None, None, held=plan_mod.held_weight_bytes("qwen3-32b-int4", spec))
    p = plan_mod.plan_for_args("qwen3-32b-int4", "k8v4", 262144, "12GiB", 0)
    assert p.fits, p.problems
    assert 0 < p.offload_layers < spec.num_layers and p.gpu_total_bytes <= 12 * GIB
    per_layer = p.offload_bytes / p.offload_layers
    # GPU: everything but the streamed layers, plus one staging layer (with its margin)
    assert abs(p.weight_bytes - (whole.weight_bytes - p.offload_bytes + plan_mod.STAGING_MARGIN * per_layer)) < MIB
    assert p.gpu_kv_tokens >= plan_mod.OFFLOAD_MIN_GPU_KV_TOKENS and p.gpu_kv_tokens + p.host_kv_tokens >= 262143
    # one layer fewer streamed would not fit the limit with that KV floor
    tighter = make_plan(spec, "k8v4", 262144, 12 * GIB, None, held=plan_mod.held_weight_bytes("qwen3-32b-int4", spec),
                        offload_layers=p.offload_layers - 1)
    assert tighter.gpu_kv_tokens < plan_mod.OFFLOAD_MIN_GPU_KV_TOKENS
    cfg = EngineConfig(device="cuda", max_model_len=262144, cache=CacheConfig(kv_dtype="k8v4"))
    assert checked_engine_config(cfg, "qwen3-32b-int4", "12GiB").offload_layers == p.offload_layers
    with pytest.raises(ValueError, match="raise --gpu-memory-limit"):  # on the CPU nothing is streamed
        checked_engine_config(replace(cfg, device="cpu"), "qwen3-32b-int4", "12GiB")
    assert make_plan(spec, "k8v4", 4096, 80 * GIB, None).offload_layers == 0  # it fits: nothing streamed


def test_retrieval_summaries_count_on_the_gpu() -> None:
    """With retrieval every page of both tiers has key summaries on the GPU (bf16 min / max): the plan counts
    them (a host-tier token costs GPU memory too), the pool shrinks to keep the total under the
    limit, and issue 12's case (an 8B 4-bit shape, 256K of k8v4, 12 GiB) still fits."""
    import torch

    from kvtier.kv.summaries import summary_bytes_per_token

    spec = spec_for("qwen3-8b-int4")
    held = plan_mod.held_weight_bytes("qwen3-8b-int4", spec)
    dense = make_plan(spec, "k8v4", 262144, 12 * GIB, None, held=held)
    p = make_plan(spec, "k8v4", 262144, 12 * GIB, None, held=held, retrieval=True)
    assert dense.summary_bytes == 0 and p.fits, p.problems
    spt = summary_bytes_per_token(spec.num_kv_heads, spec.head_dim, 16, spec.num_layers, torch.bfloat16)
    assert spt == spec.num_layers * ((2 * 2 + 4) * spec.num_kv_heads * spec.head_dim + 4) / 16  # bf16 min / max
    assert abs(p.summary_bytes - (p.gpu_kv_tokens + p.host_kv_tokens) * spt) < MIB
    assert p.gpu_kv_tokens + p.host_kv_tokens >= 262143 and p.gpu_total_bytes <= 12 * GIB
    assert abs(p.gpu_kv_bytes - (dense.gpu_kv_bytes - 262144 * spt)) < MIB  # the pool gave the room up
    # a short context: the pool is the context, its summaries beside it
    short = make_plan(spec, "k8v4", 4096, 12 * GIB, None, held=held, retrieval=True)
    assert short.gpu_kv_tokens == 4096 and short.host_kv_tokens == 0 and abs(short.summary_bytes - 4096 * spt) < 1
    # a given host tier: its pages' summaries first, the pool from the rest
    given = make_plan(spec, "k8v4", 131072, 12 * GIB, 8000 * MIB, held=held, retrieval=True)
    assert given.fits and given.gpu_total_bytes <= 12 * GIB + MIB
    assert abs(given.summary_bytes - (given.gpu_kv_tokens + given.host_kv_tokens) * spt) < MIB
    # summaries that leave no room for the pool say so (here: a 40,000 MiB host tier's pages)
    big = make_plan(spec, "k8v4", 262144, 12 * GIB, 40000 * MIB, held=held, retrieval=True, offload_layers=0)
    assert not big.fits and "page summaries" in big.problems[0]
    import re
    at_least = int(re.search(r"at least (\d+) MiB", big.problems[0]).group(1)) * MIB
    assert at_least > big.weight_bytes + 40000 * MIB / big.kv_bytes_per_token * spt  # the summaries counted
    # a selector without key sums (hybrid-mid): min / max only, and that room goes to the pool
    bare = make_plan(spec, "k8v4", 262144, 12 * GIB, None, held=held, retrieval=True, key_sums=False)
    spt_bare = spec.num_layers * (2 * 2 * spec.num_kv_heads * spec.head_dim + 4) / 16
    assert abs(bare.summary_bytes - (bare.gpu_kv_tokens + bare.host_kv_tokens) * spt_bare) < MIB
    assert bare.fits and bare.gpu_kv_tokens > p.gpu_kv_tokens and bare.summary_bytes < 0.6 * p.summary_bytes
    # 8-bit min / max (--kvmem-summary-bits 8): codes and an exponent a kv head; the room to the pool
    lean = make_plan(spec, "k8v4", 262144, 12 * GIB, None, held=held, retrieval=True, key_sums=False, summary_bits=8)
    spt_lean = spec.num_layers * (2 * spec.num_kv_heads * spec.head_dim + spec.num_kv_heads + 4) / 16
    assert abs(lean.summary_bytes - (lean.gpu_kv_tokens + lean.host_kv_tokens) * spt_lean) < MIB
    assert lean.fits and lean.gpu_kv_tokens > bare.gpu_kv_tokens and lean.summary_bytes < 0.52 * bare.summary_bytes
    # serve's check sizes the pools from the plan of its summaries (auto: 8-bit on the GPU)
    cfg = EngineConfig(device="cuda", max_model_len=262144, cache=CacheConfig(kv_dtype="k8v4"),
                       retrieval=replace(EngineConfig().retrieval, budget=2048))
    assert cfg.retrieval.summary_bits == 0
    got = checked_engine_config(cfg, "qwen3-8b-int4", "12GiB")
    auto = make_plan(spec, "k8v4", 262144, 12 * GIB, None, held=held, retrieval=True, summary_bits=0)
    assert auto.summary_bytes < p.summary_bytes and got.cache.gpu_kv_mib == -(-auto.gpu_kv_bytes // MIB)
    got16 = checked_engine_config(replace(cfg, retrieval=replace(cfg.retrieval, summary_bits=16)), "qwen3-8b-int4",
                                  "12GiB")
    assert got16.cache.gpu_kv_mib == -(-p.gpu_kv_bytes // MIB)
