#!/usr/bin/env bash
# The 8B-shaped run on a lent GPU (scripts/gpu/README.md): wheels (FlashInfer's with its decode
# kernels built ahead), the numba warm-up while a random-weight Llama-3.1-8B-shaped model is made,
# the decode attention A/B (torch against FlashInfer), then `icecache bench --ctx 32k,128k
# --methods full,ice,offloaded` under the 24 GiB profile. Each step has its own time cap and
# writes under $OUT as it goes. `TESTS=1` runs the GPU parity tests instead of the bench
# (a second call on the warm machine).
set -u
export PYTHONUNBUFFERED=1 NO_COLOR=1 CUDA_HOME=/usr/local/cuda FLASHINFER_WORKSPACE_BASE=/tmp FLASHINFER_CUDA_ARCH_LIST=9.0
OUT=${OUT:-/tmp/gpu-out}; LOG=/tmp/gpu-logs; mkdir -p "$OUT" "$LOG"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/steps.log"; tar czf "$OUT/logs.tgz" -C "$LOG" .; }
export PYTHONPATH=/tmp/site:$PWD
if [ ! -d /tmp/site/flashinfer ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  mkdir -p /tmp/site/flashinfer/data/aot && cp -r .whl/flashinfer_aot_sm90a/. /tmp/site/flashinfer/data/aot/
fi
if [ -n "${TESTS:-}" ]; then
  timeout "${TEST_CAP:-200}" python3 -m pytest -m gpu tests/test_gpu.py tests/test_flashinfer_decode.py tests/test_ice_cache.py \
    -q -p no:cacheprovider -n 8 > "$LOG/tests.log" 2>&1; stamp "tests rc=$? $(tail -1 "$LOG/tests.log")"
  exit 0
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g
  python3 -c "import torch, transformers, numba, flashinfer; print(torch.__version__, transformers.__version__, numba.__version__, flashinfer.__version__)"; } > "$LOG/env.txt" 2>&1
stamp "env: $(tr '\n' ' ' < "$LOG/env.txt")"
python3 -c "from icecache.warmup import compile_cache; compile_cache()" > "$LOG/warm1.log" 2>&1 &
python3 -c "from icecache.warmup import compile_index; compile_index()" > "$LOG/warm2.log" 2>&1 &
[ -d /tmp/m8b ] || python3 scripts/gpu/random_model.py /tmp/m8b llama8b > "$LOG/model.log" 2>&1
stamp "model: $(tail -1 "$LOG/model.log")"
timeout 60 python3 scripts/gpu/attention_ab.py > "$LOG/attention_ab.log" 2>&1
stamp "attention A/B rc=$?: $(tr '\n' ' ' < "$LOG/attention_ab.log" | tail -c 600)"
wait; stamp "warm-up done"
timeout "${BENCH_CAP:-420}" python3 -m icecache_cli bench --ctx "${CTX:-32k,128k}" --methods full,ice,offloaded \
  --profile rtx4090-24gb --model /tmp/m8b --positions true --decode-steps "${STEPS:-8}" --out "$OUT/bench8b" \
  > "$LOG/bench.log" 2>&1
stamp "bench rc=$?"
