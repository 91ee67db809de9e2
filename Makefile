# splash_hk: `make demo` and `make test` each set up .venv on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test docs typecheck wheel-check bazel-install bazel-test bazel-smoke demo multihost-demo serve-demo bench quickcheck clean gpu-wheels gpu-check tpu-wheels tpu-check tpu-aot tpu-tune

LOCK := requirements-lock.txt

$(STAMP): setup.py $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(LOCK) -e '.[test,examples,gpu,flax,quant,docs,tpu]'
	touch $(STAMP)

setup: $(STAMP)

# Two pytest workers: most of the suite is XLA compilation, which runs on one core.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25 tests

# The documentation site (docs/: the guides and the API reference from the docstrings) into
# build/docs, offline: every warning is an error and every reference must resolve (-n).
docs: $(STAMP)
	rm -rf build/docs && $(PY) -m sphinx -W -n --keep-going -q -b html docs build/docs

# mypy over splash_hk/ (mypy.ini): every public signature typed as what it takes.
typecheck: $(STAMP)
	$(PY) -m mypy

# The built wheel (not an editable install) in a fresh venv, against the lock:
# it installs, ships py.typed and the library alone (no example or bench module),
# and runs an attention call from outside the checkout.
WHEEL_DIR := build/wheel-check
wheel-check: $(STAMP)
	rm -rf $(WHEEL_DIR) && $(PYTHON) -m venv $(WHEEL_DIR)/venv
	$(PY) -m pip wheel -q --no-deps -w $(WHEEL_DIR)/dist .
	$(WHEEL_DIR)/venv/bin/pip install -q -c $(LOCK) $(WHEEL_DIR)/dist/splash_hk-*.whl
	cd $(WHEEL_DIR) && venv/bin/python $(CURDIR)/scripts/wheel_check.py dist/splash_hk-*.whl

# Debian's bazel-bootstrap (4.2.3) runs offline: WORKSPACE points it at local
# stand-ins and at .venv's interpreter. Installing it is the one step that needs apt.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
bazel-install:
	@command -v bazel >/dev/null || $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap \
	  || { $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap; }

bazel-test: $(STAMP) bazel-install
	bazel test //...

# CI's Bazel stage: every target builds, every test target collects its tests in
# its own sandbox (its imports and data resolve), the test rule runs (runner,
# sharding, runfiles imports, the skipped GPU target) and a binary runs. The tests'
# content already ran once under `make test`; running all of it twice does not fit CI.
BAZEL_SMOKE := //:test_build //:test_masks //:test_inputs //:test_package //:test_gpu
bazel-smoke: $(STAMP) bazel-install
	bazel build //...
	bazel test //... --test_arg=--collect-only --test_sharding_strategy=disabled
	bazel test $(BAZEL_SMOKE)
	bazel run //examples/train:train -- --steps=20 --log_every=20

demo: $(STAMP)
	$(PY) -m examples.train --sample

# Trains the demo model briefly (ALiBi positions), serves 64 requests with continuous
# batching over pages, then the same requests as static batches with KVCache.
# Extra flags for the serving binary: make serve-demo SERVE_FLAGS=--kv_dtype=int8
SERVE_FLAGS ?=
serve-demo: $(STAMP)
	$(PY) -m examples.serve --check $(SERVE_FLAGS)

multihost-demo: $(STAMP)
	$(PY) -m examples.train.launch --num_processes=2 --devices_per_process=4 -- \
	  $(PY) -m examples.train

bench: $(STAMP)
	$(PY) -m benchmarks.bench --out=bench_out

quickcheck: $(STAMP)
	$(PY) -m splash_hk.quickcheck

# Wheels the lent GPU machine lacks (Python 3.12), carried there in .whl, at the lock's versions.
GPU_PACKAGES := ejkernel dm-haiku jmp tabulate jaxtyping beartype wadler_lindig einops tqdm pydantic \
	pydantic_core annotated-types typing-inspection hypothesis sortedcontainers pytest pluggy iniconfig
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
	  $$(for p in $(GPU_PACKAGES); do grep -i "^$$p==" $(LOCK); done)

gpu-check:
	bash scripts/gpu_check.sh

# Wheels the lent TPU machine lacks (Python 3.11, jax 0.10.2 installed), carried there in
# .whl-tpu (ignored by git: `carry` it), at the lock's versions: the library's own needs and the
# TPU bench's peer tokamax with what it imports (tokamax is not in the lock: its version is here).
TPU_PACKAGES := dm-haiku jmp tabulate chex toolz absl-py typing_extensions qwix flax optax msgpack \
	PyYAML treescope rich Pygments etils jaxtyping wadler_lindig pydantic pydantic_core \
	annotated-types typing-inspection tqdm markdown-it-py mdurl protobuf packaging
TPU_EXTRA := tokamax==0.0.12 einshape==1.0 typeguard==2.13.3 immutabledict==4.3.1 tensorboardx==2.6.5
tpu-wheels:
	rm -rf .whl-tpu
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl-tpu \
	  $$(for p in $(TPU_PACKAGES); do grep -i "^$$p==" $(LOCK); done) $(TPU_EXTRA)

# On the TPU machine (the wheels beside the checkout): the tpu-marked tests compiled on the chip,
# the quickcheck and the TPU bench, into $$OUT (or tpu_out/); summary.txt a line per step.
tpu-check:
	bash scripts/tpu_check.sh

# On this CPU host, no chip: the benches' TPU programs compiled for a v5e by libtpu (installed
# into .libtpu at the version jax[tpu] pins), their copies and kernels listed
# (benchmarks/tpu_programs.py; TPU_AOT passes its flags).
LIBTPU := 0.0.42.1
tpu-aot: $(STAMP)
	test -d .libtpu/libtpu || $(PY) -m pip install -q --no-deps --target .libtpu libtpu==$(LIBTPU)
	PYTHONPATH=.libtpu $(PY) -m benchmarks.tpu_programs $(TPU_AOT)

# On the TPU machine: measures the TPU kernel's tiles (python -m splash_hk.tune) for the bench's
# shapes into $$OUT/tiles.json; the shipped table (splash_hk/backends/tpu/tiles_v5e.json) is its
# output on the lent v5e.
TPU_TUNE_SHAPES := 4x4096x16x16x128:causal,1x16384x16x16x128:causal,1x16384x16x16x128:window:1024,1x16384x16x16x128:segments:8,2x8192x8x4x256:causal
tpu-tune:
	TPU_STEPS="environment tune" TPU_TUNE="--shapes=$(TPU_TUNE_SHAPES)" bash scripts/tpu_check.sh

clean:
	if command -v bazel >/dev/null; then bazel clean --expunge; fi
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
