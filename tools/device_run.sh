#!/usr/bin/env bash
# One device call: GPU tests and/or benchmarks, everything logged under $OUT.
# Wheels (.whl from ../shared/tools/device-wheels.sh) go to /tmp/site once per warm machine.
#   tools/device_run.sh setup      (carry [".whl"]; also stash a SmolLM2 piece: see device-split.sh)
#   tools/device_run.sh tests      GPU tests (uses /tmp/SmolLM2-135M-Instruct.Q4_1.gguf if there) + swap bench
#   tools/device_run.sh bench      decode/prefill benches (bf16, int8, k8v4 KV) + 80K prefix TTFT
#   tools/device_run.sh runtime    runtime/kernel GPU tests + the decode grid bench (bf16, 1K, batch 1/32)
#   tools/device_run.sh grid       the full decode grid (bf16/int8/k8v4 KV, 1K/32K, batch 1/32) + 8K prefill
#   tools/device_run.sh filter     the threshold top-k's and the decode kernels' GPU tests, the top-k
#                                  sweeps, issue 12's 4K / 256K rows, issue 10's 32K rows (~520 s)
#   tools/device_run.sh rows       the selection sweep (chunked / ticket / coarse top-k), issue 12's
#                                  4K / 256K rows with VARIANTS (default "True Coarse": the ticket and
#                                  the coarse top-k; False: chunked), issue 10's 32K rows (~500 s)
#   tools/device_run.sh            both
set -u
export PYTHONUNBUFFERED=1
if [ "${1:-}" = setup ] || [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  [ "${1:-}" = setup ] && exit 0
fi
export PYTHONPATH=/tmp/site:$PWD
[ -f /tmp/SmolLM2-135M-Instruct.Q4_1.gguf ] && export KVTIER_SMOLLM2=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpu.txt"
B="$OUT/bench.md"
run() { echo "+ $*" | tee -a "$B"; timeout "${T:-240}" "$@" 2>&1 | tee -a "$OUT/log.txt" | tail -25; }
what=${1:-all}
if [ "$what" = runtime ]; then
  T=300 run python3 -m pytest -q -p no:cacheprovider -x -rs tests/gpu/test_runtime.py tests/gpu/test_kv_kernels.py \
    $(ls tests/gpu/test_paged_attention.py tests/gpu/test_fused.py 2>/dev/null)
  T=60 run python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_paged_attention.py -k print
  T=200 run python3 -m kvtier.cli bench --shape qwen3-8b --contexts 1024 --batches 1,32 --kv-dtypes bf16 \
    --gen-tokens 64 --out "$B"
fi
if [ "$what" = grid ]; then
  T=360 run python3 -m kvtier.cli bench --shape qwen3-8b --contexts 1024,8192,32768 --batches 1,32 \
    --kv-dtypes bf16,int8,k8v4 --gen-tokens 48 --out "$B"
  T=150 run python3 -m kvtier.cli bench --shape qwen3-8b --cached-tokens 81920 --new-tokens 50 --no-hf --out "$B"
fi
if [ "$what" = filter ]; then
  T=170 run python3 -m pytest -q -p no:cacheprovider -n 8 tests/gpu/test_retrieval_kernel.py tests/gpu/test_hot_pages.py \
    tests/gpu/test_host_tier.py tests/gpu/test_kv_kernels.py -k "topk or 8bit or wired or graph or engine or retrieval \
    or kernels_match_reference"
  (cd tools && T=50 run python3 sweep_select.py)
  (cd tools && T=60 run python3 sweep_topk.py --filter)
  T=260 run python3 -m kvtier.cli bench \
    --shape qwen3-8b-int4 --gpu-memory-limit 12GiB --contexts 4096,262144 --batches 1 --max-batch 2 \
    --kv-dtypes k8v4 --kvmem-budget 2048 --kvmem-selector hybrid-mid --no-hf --gen-tokens 64 --out "$B"
  T=150 run python3 -m kvtier.cli bench --shape qwen3-8b --contexts 32768 --batches 1 --kv-dtypes bf16,int8,k8v4 \
    --gen-tokens 48 --no-hf --out "$B"
fi
if [ "$what" = rows ]; then
  (cd tools && T=60 run python3 sweep_select.py)
  for f in ${VARIANTS:-True Coarse}; do  # True: the default (ticket) top-k; False: chunked; Coarse
    a="TOPK_FILTER=$f"; [ $f = Coarse ] && a="TOPK_FILTER_COARSE=True"
    ATTRS="kvtier.kernels.retrieval_attention:$a" T=200 run python3 tools/with_attrs.py cli bench \
      --shape qwen3-8b-int4 --gpu-memory-limit 12GiB --contexts 4096,262144 --batches 1 --max-batch 2 \
      --kv-dtypes k8v4 --kvmem-budget 2048 --kvmem-selector hybrid-mid --no-hf --gen-tokens 64 --out "$B"
  done
  T=120 run python3 -m kvtier.cli bench --shape qwen3-8b --contexts 32768 --batches 1 \
    --kv-dtypes bf16,int8,k8v4 --gen-tokens 48 --no-hf --out "$B"
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  T=240 run python3 -m pytest -q -p no:cacheprovider -x -rs tests/gpu
  T=60 run python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_page_copy.py -k print
  T=60 run python3 -m kvtier.cli bench --swap-pages 2048 --out "$B"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  T=150 run python3 -m kvtier.cli bench --shape qwen3-8b --prompt-tokens 512 --gen-tokens 64 --out "$B"
  for f in int8 k8v4; do
    T=90 run python3 -m kvtier.cli bench --shape qwen3-8b --prompt-tokens 512 --gen-tokens 64 --kv-dtype $f --no-hf --out "$B"
  done
  T=150 run python3 -m kvtier.cli bench --shape qwen3-8b --cached-tokens 81920 --new-tokens 50 --prefill-chunk 8192 --gpu-kv-mib 20000 --no-hf --out "$B"
fi
