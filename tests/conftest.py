"""Test setup: 8 virtual CPU devices (before jax is imported), a private HOME, slow files first.

`pytest -m gpu` (what `make gpu-check` runs on a GPU machine) and `pytest -m tpu` (`make
tpu-check` on a TPU machine) leave JAX_PLATFORMS and the device count as the machine has them,
so the accelerator's tests see it; a test they select that skips fails.
"""

import os
import tempfile

import pytest

import processes


def _gpu_run(config: pytest.Config) -> bool:
  """Whether this run selects an accelerator's tests (`-m gpu`, `-m tpu`; `-m "not gpu"` is a
  CPU run)."""
  return (config.getoption("markexpr", "") or "").strip() in ("gpu", "tpu")


def pytest_configure(config: pytest.Config) -> None:
  config.addinivalue_line("markers", "gpu: needs a GPU (run with -m gpu by make gpu-check)")
  config.addinivalue_line("markers", "tpu: needs a TPU (run with -m tpu by make tpu-check)")
  gpu = _gpu_run(config)
  if not gpu:
    os.environ["XLA_FLAGS"] = " ".join((os.environ.get("XLA_FLAGS", ""), processes.FAST_COMPILE,
                                        "--xla_force_host_platform_device_count=8")).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # processes.py says why
  # The native kernel's build (a C++ compile of ~30 s, keyed by its sources, jax and the
  # compiler): one per machine for every test process (pytest's workers, Bazel's test targets,
  # whose .bazelrc names the same folder), not one per private HOME.
  os.environ.setdefault("SPLASH_HK_NATIVE_CACHE", os.path.join(
      tempfile.gettempdir(), f"splash_hk-test-native-{os.getuid()}"))
  # ejkernel creates cache folders under $HOME at import: keep them out of the user's.
  os.environ["HOME"] = tempfile.mkdtemp(prefix="splash_hk-test-home-")
  os.environ.setdefault("EJKERNEL_PERSISTENT_CACHE_DIR",
                        os.path.join(os.environ["HOME"], "ejkernel"))
  import jax  # pylint: disable=g-import-not-at-top

  # Set after jax's import, so only the subprocesses (training binaries, the bench, the README
  # and guide blocks) share it: a program two of them compile (the same training flags)
  # compiles once.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        tempfile.mkdtemp(prefix="splash_hk-test-jax-cache-"))
  if not gpu:
    assert jax.device_count() == 8, "tests/conftest.py must run before anything imports jax"



@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
  """Under -m gpu or -m tpu a skipped test fails: the check must not pass by skipping."""
  outcome = yield
  report = outcome.get_result()
  if report.skipped and _gpu_run(item.config):
    report.outcome = "failed"
    report.longrepr = (f"skipped under -m {item.config.getoption('markexpr')} (is the "
                       f"accelerator there?): {report.longrepr}")


# Files whose tests run training binaries or processes, or real sizes in interpret mode (tens of
# seconds each; `make test`'s --durations): run first, so
# that under two pytest workers the short tests fill in around them instead of one worker
# finishing a long one alone at the end.
SLOW_FIRST = ("test_multihost.py", "test_train.py", "test_readme.py", "test_real_sizes.py",
              "test_ulysses.py", "test_block_list_kernel.py", "test_serve.py", "test_bench.py",
              "test_flax.py", "test_dropout.py", "test_quant.py", "test_blocks.py",
              "test_paged_tiles.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  del config
  rank = lambda item: (SLOW_FIRST.index(item.path.name) if item.path.name in SLOW_FIRST
                       else len(SLOW_FIRST))
  items.sort(key=rank)  # stable: each file keeps its own order
