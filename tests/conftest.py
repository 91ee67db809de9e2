"""Test setup: 8 virtual CPU devices (before jax is imported) and a private HOME."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# ejkernel creates cache folders under $HOME at import: keep them out of the user's.
os.environ["HOME"] = tempfile.mkdtemp(prefix="splash_hk-test-home-")
os.environ.setdefault("EJKERNEL_PERSISTENT_CACHE_DIR", os.path.join(os.environ["HOME"], "ejkernel"))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

assert jax.device_count() == 8, "tests/conftest.py must run before anything imports jax"
