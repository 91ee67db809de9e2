"""Run by `make wheel-check` in a fresh venv holding only the built wheel and its requirements.

  python wheel_check.py dist/splash_hk-*.whl
"""

import importlib.resources
import pathlib
import sys
import zipfile

import jax.numpy as jnp

import splash_hk as sh

(wheel,) = sys.argv[1:]
modules = sorted(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py"))
strays = [n for n in modules if not n.startswith("splash_hk/")
          or n.startswith(("splash_hk/examples/", "splash_hk/benchmarks/"))]
assert not strays, f"the wheel holds modules beside the library: {strays}"
assert "splash_hk/quickcheck.py" in modules, "splash_hk.quickcheck is missing from the wheel"
location = pathlib.Path(sh.__file__).resolve()
assert "site-packages" in location.parts, f"splash_hk imported from {location}, not the wheel"
assert importlib.resources.files("splash_hk").joinpath("py.typed").is_file(), "py.typed is missing"
for stray in ("examples", "benchmarks"):
  assert not (location.parent.parent / stray / "__init__.py").exists(), f"{stray} was installed"
assert "flax" not in sys.modules, "importing splash_hk imported flax (only splash_hk.flax may)"
try:
  import splash_hk.flax  # noqa: F401  (the [flax] extra is not installed here)
  raise AssertionError("splash_hk.flax imported without flax installed")
except ImportError as e:
  assert "pip install 'splash_hk[flax]'" in str(e), e
q = jnp.ones((1, 128, 4, 32))
out = sh.attention(q, q, q, config=sh.AttentionConfig(sliding_window=16)).attention_outputs
assert out.shape == (1, 128, 4, 32) and bool(jnp.all(jnp.abs(out - 1) < 1e-5))
print(f"wheel check: splash_hk {sh.__version__} from {location.parent}, {len(modules)} library "
      f"modules and py.typed shipped, no example or bench module, "
      f"{sh.explain(q, q, q).backend} backend ran")
