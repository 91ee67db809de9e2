#!/usr/bin/env bash
# `make gpu-check`: one run on the lent GPU machine (its own image: Python 3.12, jax 0.11.2 +
# CUDA, triton; no package index). Installs the wheels carried in .whl (`make gpu-wheels`, with
# --no-deps: ejkernel 0.0.80.3 declares jax~=0.10.0, and we check that it runs on 0.11.2), then
# runs the GPU tests, the quickcheck and a short bf16 bench. Every log and result goes to
# $GPU_OUT (default gpu_out/); summary.txt has one line per step. The step limits add up to
# 8 minutes; a step that fails or times out does not stop the others, but makes the script
# exit non-zero at the end (a skipped GPU test fails its step: see tests/conftest.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_OUT:-gpu_out}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
FAILED_STEPS=""

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a time limit, logs to $OUT/NAME.log
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc after $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || FAILED_STEPS="$FAILED_STEPS $name"
  tail -n 8 "$OUT/$name.log"
}

if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/splash_hk-site .whl/*.whl > "$OUT/install.log" 2>&1
  export PYTHONPATH=/tmp/splash_hk-site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}

step environment 30 python3 -c "
import sys, jax, jaxlib
print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)
print('devices', jax.devices())
import triton; print('triton', triton.__version__)"
step ejkernel_import 60 python3 -c "
import splash_hk as sh
from splash_hk.backends.gpu import ejkernel as _ejkernel
print('ejkernel available:', _ejkernel.available(), type(_ejkernel.blocksparse_op()).__name__)
import jax; q = jax.ShapeDtypeStruct((1, 1024, 8, 128), 'bfloat16')
print(sh.explain(q, q, q))"
# -m gpu: conftest leaves the GPU visible, and a skipped GPU test fails (no pass by skipping).
step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_gpu.py
grep -E "^(PASSED|FAILED|ERROR|SKIPPED) " "$OUT/gpu_tests.log" | sed 's/^/  /' >> "$OUT/summary.txt"
step quickcheck 60 python3 -m splash_hk.quickcheck
step bench 180 python3 -m benchmarks.bench --dtype=bfloat16 --num_heads=16 \
  --num_kv_heads=16 --head_dim=128 --repeats=5 --out="$OUT" \
  --impls=splash_hk_auto,jax_nn_auto,splash_hk_xla,reference \
  --workloads=causal@8192,window:512@8192,packed:16@8192,decode:8000/32768
echo "results in $OUT/ (summary.txt, *.log, bench.json)"
if [ -n "$FAILED_STEPS" ]; then
  echo "gpu-check FAILED:$FAILED_STEPS" | tee -a "$OUT/summary.txt"
  exit 1
fi
