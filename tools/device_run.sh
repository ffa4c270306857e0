#!/usr/bin/env bash
# One device call: GPU tests + benchmarks, everything logged under $OUT.
# Needs .whl (../shared/tools/device-wheels.sh) carried; SmolLM2 at /tmp/SmolLM2-135M-Instruct.Q4_1.gguf if sent.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpu.txt"
B="$OUT/bench.md"
run() { echo "+ $*" | tee -a "$B"; timeout "${T:-240}" "$@" 2>&1 | tee -a "$OUT/log.txt" | tail -25; }
T=300 run python3 -m pytest -q -p no:cacheprovider tests/gpu
run python3 -m kvtier.cli bench --shape qwen3-8b --prompt-tokens 512 --gen-tokens 64 --out "$B"
run python3 -m kvtier.cli bench --shape qwen3-8b --prompt-tokens 512 --gen-tokens 64 --max-batch 1 --kv-dtype int8 --no-hf --out "$B"
run python3 -m kvtier.cli bench --shape qwen3-8b --cached-tokens 81920 --new-tokens 50 --prefill-chunk 8192 --gpu-kv-mib 20000 --out "$B"
run python3 -m kvtier.cli bench --swap-pages 2048 --out "$B"
