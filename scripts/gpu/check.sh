#!/usr/bin/env bash
# One lease's checks on a lent GPU (scripts/gpu/README.md): wheels, numba warm-up, the GPU parity
# tests, then the end-to-end bench on random-weight models. Every step has its own time cap and
# writes its log under $OUT as it goes, so a step that runs out of time leaves the others' output.
set -u
export PYTHONUNBUFFERED=1 NO_COLOR=1
OUT=${OUT:-/tmp/gpu-out}; LOG=/tmp/gpu-logs; mkdir -p "$OUT" "$LOG"
# at most 8 files come back: the step log, and every other log in one archive renewed after each step
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/steps.log"; tar czf "$OUT/logs.tgz" -C "$LOG" .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import torch, transformers, numba; print(torch.__version__, transformers.__version__, numba.__version__)"; } > "$LOG/env.txt" 2>&1
stamp "env: $(tr '\n' ' ' < "$LOG/env.txt")"
# numba kernels: two processes compile the two halves at once
python3 -c "from icecache.warmup import compile_cache; compile_cache()" > "$LOG/warm1.log" 2>&1 &
python3 -c "from icecache.warmup import compile_index; compile_index()" > "$LOG/warm2.log" 2>&1 &
python3 scripts/gpu/random_model.py /tmp/smol smol > "$LOG/models.log" 2>&1
wait; stamp "warm-up and model done"
[ -n "${SKIP_TESTS:-}" ] || timeout "${TEST_CAP:-150}" python3 -m pytest -m gpu tests/test_gpu.py tests/test_ice_cache.py -q -p no:cacheprovider \
  -n 4 > "$LOG/tests.log" 2>&1; stamp "tests rc=$? $(tail -1 "$LOG/tests.log")"
bench() {  # model ctx cap
  timeout "$3" python3 -m icecache_cli bench --ctx "$2" --methods full,dense,ice --profile h100-80gb --model "$1" \
    --full-prefill-max 128k --out "$LOG/bench-$(basename "$1")-$2" > "$LOG/bench-$(basename "$1")-$2.log" 2>&1
  stamp "bench $1 $2 rc=$?"
}
[ -n "${SKIP_BENCH:-}" ] && exit 0
bench /tmp/smol 32k "${BENCH32_CAP:-90}"
bench /tmp/smol 128k "${BENCH128_CAP:-230}"
