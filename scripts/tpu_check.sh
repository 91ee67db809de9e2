#!/usr/bin/env bash
# `make tpu-check`: one run on the lent TPU machine (its own image: Python 3.11, jax 0.10.2 with
# libtpu, numpy, pytest; no dm-haiku, chex, jmp, tabulate or tokamax). Installs the wheels
# carried in .whl-tpu (`make tpu-wheels`) under /tmp (the machine's JAX stays first), then runs
# the tpu-marked tests compiled on the chip (one process: the chip takes one program at a time;
# a skipped TPU test fails its step: see tests/conftest.py), the quickcheck, the TPU bench
# (`benchmarks/bench_tpu.py`), the decode bench (`benchmarks/bench_tpu_decode.py`), the
# serving binary (step "serve": `make serve-demo` on the chip) and the chosen-blocks bench
# (step "blocks": `benchmarks/bench_tpu_blocks.py`). Every log and result goes to $TPU_OUT
# (default $OUT, else tpu_out/); summary.txt has one line per step. TPU_STEPS picks steps
# (default: all but tune, serve and blocks; pick so that their limits add up to under the
# call's 10 minutes); TPU_TESTS_K picks tests (pytest -k), TPU_BENCH to the bench, TPU_DECODE
# to the decode bench, TPU_SERVE to the serving binary, TPU_BLOCKS to the chosen-blocks bench;
# TPU_TESTS_LIMIT the tests step's seconds (300).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${TPU_OUT:-${OUT:-tpu_out}}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
FAILED_STEPS=""
STEPS=${TPU_STEPS:-environment tests quickcheck bench decode}

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a time limit, logs to $OUT/NAME.log
  local name=$1 limit=$2 start rc
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc after $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || FAILED_STEPS="$FAILED_STEPS $name"
  tail -n 6 "$OUT/$name.log"
}

SITE=/tmp/splash_hk-site
if ls .whl-tpu/*.whl > /dev/null 2>&1; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target "$SITE" .whl-tpu/*.whl > "$OUT/install.log" 2>&1 \
    || echo "install: failed (see install.log)" | tee -a "$OUT/summary.txt"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}:$SITE
export PYTHONUNBUFFERED=1
# The tuner writes $OUT/tiles.json and the library reads it first (a run after `tune` in the
# same call measures those tiles); without it, the shipped table.
export SPLASH_HK_TILE_CACHE=${SPLASH_HK_TILE_CACHE:-$OUT/tiles.json}

step environment 60 python3 -c "
import sys, jax, jaxlib
print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)
print('devices', jax.devices(), jax.devices()[0].device_kind)
import haiku, chex; print('haiku', haiku.__version__, 'chex', chex.__version__)
import tokamax; print('tokamax', tokamax.__version__)"
# -m tpu: conftest leaves the TPU visible, and a skipped TPU test fails (no pass by skipping).
step tests "${TPU_TESTS_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider -m tpu -rA ${TPU_TESTS_K:+-k "$TPU_TESTS_K"} \
  tests/test_tpu.py
grep -E "^(PASSED|FAILED|ERROR|SKIPPED) " "$OUT/tests.log" | sed 's/^/  /' >> "$OUT/summary.txt"
step quickcheck 150 python3 -m splash_hk.quickcheck
step tune 360 python3 -m splash_hk.tune --cache="$OUT/tiles.json" ${TPU_TUNE:-}
step bench 560 python3 -m benchmarks.bench_tpu --out="$OUT" ${TPU_BENCH:-}
[ -f "$OUT/bench_tpu.txt" ] && sed 's/^/  /' "$OUT/bench_tpu.txt" >> "$OUT/summary.txt"
step decode 300 python3 -m benchmarks.bench_tpu_decode --out="$OUT" ${TPU_DECODE:-}
[ -f "$OUT/bench_tpu_decode.txt" ] && sed 's/^/  /' "$OUT/bench_tpu_decode.txt" >> "$OUT/summary.txt"
# The serving binary on the chip (`make serve-demo`): trains the demo model briefly, serves its
# requests over pages, checks every output against greedy decoding and prints tokens/s.
step serve 300 python3 -m examples.serve --check ${TPU_SERVE:-}
grep -E "tokens/s" "$OUT/serve.log" 2>/dev/null | sed 's/^/  /' >> "$OUT/summary.txt"
step blocks 300 python3 -m benchmarks.bench_tpu_blocks --out="$OUT" ${TPU_BLOCKS:-}
[ -f "$OUT/bench_tpu_blocks.txt" ] && sed 's/^/  /' "$OUT/bench_tpu_blocks.txt" >> "$OUT/summary.txt"
echo "results in $OUT/ (summary.txt, *.log, bench_tpu.json)"
if [ -n "$FAILED_STEPS" ]; then
  echo "tpu-check FAILED:$FAILED_STEPS" | tee -a "$OUT/summary.txt"
  exit 1
fi
