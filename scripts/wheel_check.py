"""Run by `make wheel-check` in a fresh venv holding only the built wheel and its requirements."""

import importlib.resources
import pathlib

import jax.numpy as jnp

import splash_hk as sh

location = pathlib.Path(sh.__file__).resolve()
assert "site-packages" in location.parts, f"splash_hk imported from {location}, not the wheel"
assert importlib.resources.files("splash_hk").joinpath("py.typed").is_file(), "py.typed is missing"
q = jnp.ones((1, 128, 4, 32))
out = sh.attention(q, q, q, config=sh.AttentionConfig(sliding_window=16)).attention_outputs
assert out.shape == (1, 128, 4, 32) and bool(jnp.all(jnp.abs(out - 1) < 1e-5))
print(f"wheel check: splash_hk {sh.__version__} from {location.parent}, py.typed shipped, "
      f"{sh.explain(q, q, q).backend} backend ran")
