#!/usr/bin/env bash
# A/B of two profiles in one lease (same machine, same run): ice rows of `bench --ctx CTX` on
# random-weight models, each profile's run after the other. Usage: ab.sh CTX PROFILE_A PROFILE_B
set -u
export PYTHONUNBUFFERED=1 NO_COLOR=1
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"; T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/steps.log"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "from icecache.warmup import compile_cache; compile_cache()" > /dev/null 2>&1 &
python3 -c "from icecache.warmup import compile_index; compile_index()" > /dev/null 2>&1 &
[ -d /tmp/smol ] || python3 scripts/gpu/random_model.py /tmp/smol smol > /dev/null 2>&1
wait; stamp "warm-up and model done"
for model in ${MODELS:-smol}; do
  [ -d /tmp/$model ] || python3 scripts/gpu/random_model.py /tmp/$model $model > /dev/null 2>&1
  for p in "$2" "$3"; do
    name=$model-$(basename "$p" .yaml)
    timeout "${CAP:-100}" python3 -m icecache_cli bench --ctx "$1" --methods ice --profile "$p" --model /tmp/$model \
      --full-prefill-max "$1" > "$OUT/$name.log" 2>&1
    stamp "$name rc=$? $(grep -E '^ice ' "$OUT/$name.log" | tail -1)"
  done
done
