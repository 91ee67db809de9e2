#!/usr/bin/env bash
# `make gpu-check`: on the lent GPU machine (its own Python 3.12 + jax/CUDA/triton image),
# install the wheels carried in .whl (make gpu-wheels) and run the GPU tests and the quickcheck.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
python3 -m splash_hk.examples.quickcheck --platform=auto
