"""The tests' one harness: a call's values and gradients against the float64 oracle, the meshes
tests run on, and the tolerances by dtype.

`oracle.py` is the definition (float64, written from DESIGN.md, sharing no code with the
library); this file only runs both sides the same way and compares them.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
import numpy as np

import oracle
import pytest
import splash_hk as sh
from splash_hk.backends.native import build as native_build

# Why the native CPU kernel cannot be built here (no C++ compiler, a failed build), or None: the
# tests that need it skip with that reason, as GPU tests skip on a CPU.
NATIVE_MISSING = native_build.unavailable()
needs_native = pytest.mark.skipif(NATIVE_MISSING is not None,
                                  reason=f"the native kernel is unavailable: {NATIVE_MISSING}")


class Tolerance(NamedTuple):
  """How far from the float64 oracle a dtype may land (atol = rtol)."""

  out: float  # outputs: a few ulps of the softmax sums
  grad: float  # gradients: each entry sums T terms more
  sharded_grad: float  # gradients summed across shards (a ring, all-to-alls) in another order


TOLERANCES = {
    np.dtype(np.float32): Tolerance(out=1e-5, grad=5e-5, sharded_grad=1e-4),
    np.dtype(jnp.bfloat16): Tolerance(out=2e-2, grad=5e-2, sharded_grad=5e-2),
}


def tol(kind: str = "out", dtype: Any = np.float32) -> dict[str, float]:
  """`atol` and `rtol` for `kind` ("out", "grad" or "sharded_grad") of `dtype`."""
  value = getattr(TOLERANCES[np.dtype(dtype)], kind)
  return dict(atol=value, rtol=value)


def assert_near(got: Any, want: Any, kind: str = "grad", dtype: Any = np.float32,
                err_msg: str = "") -> None:
  """`got` against the oracle's `want` with `kind`'s tolerance relative to `want`'s largest entry.

  A float32 sum of n terms is off by about eps * sqrt(n) times its largest term, not its own
  size: a small entry of a gradient whose entries reach 70 carries the rounding of 70. So the
  absolute tolerance is `tol * max(1, max |want|)` (the rtol stays `tol`): an elementwise
  tolerance alone would test the machine's float32 rounding, not the library.
  """
  got, want = np.asarray(got), np.asarray(want)
  value = getattr(TOLERANCES[np.dtype(dtype)], kind)
  finite = np.abs(want[np.isfinite(want)])
  largest = float(finite.max()) if finite.size else 0.0
  np.testing.assert_allclose(got, want, atol=value * max(1.0, largest), rtol=value,
                             err_msg=err_msg)


# Every mesh the tests shard over: name -> (shape, axis names), on the 8 virtual CPU devices.
MESHES = {
    "1x8": ((1, 8), ("dp", "tp")),
    "2x4": ((2, 4), ("dp", "tp")),
    "4x2": ((4, 2), ("dp", "tp")),
    "8x1": ((8, 1), ("dp", "tp")),
    "2x2x2": ((2, 2, 2), ("dp", "fsdp", "tp")),
    "sp1": ((1,), ("sp",)),
    "sp2": ((2,), ("sp",)),
    "sp4": ((4,), ("sp",)),
    "sp8": ((8,), ("sp",)),
    "dp2_sp4": ((2, 4), ("dp", "sp")),
    "sp2_tp4": ((2, 4), ("sp", "tp")),
    "dp2_sp2_tp2": ((2, 2, 2), ("dp", "sp", "tp")),
}


# The training binary's sharded runs (test_train, test_multihost) and the single-device run
# they are held to: one set of flags, so that run compiles once (conftest: the subprocesses
# share a compilation cache).
SHARDED_TRAINING_FLAGS = ("--steps=20", "--log_every=20", "--seq_len=32", "--prefix_lm",
                          "--num_heads=8", "--num_layers=1")


def mesh(name: str, explicit: bool = False) -> jax.sharding.Mesh:
  """The mesh `name` of MESHES, on the first devices it needs, with Auto or Explicit axes."""
  shape, names = MESHES[name]
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape),
                       devices=jax.devices()[:int(np.prod(shape))])


def axis_size(name: str, axis: str) -> int:
  """How many devices the mesh `name` puts on `axis` (1 when it has no such axis)."""
  shape, names = MESHES[name]
  return dict(zip(names, shape)).get(axis, 1)


def values_and_grads(f: Callable[..., jax.Array], args: Sequence[Any],
                     cot: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
  """f(*args) and the gradients of sum(f(*args) * cot) for every argument, jitted.

  An argument that is None gets no gradient (and is left out of the list).
  """
  argnums = tuple(i for i, a in enumerate(args) if a is not None)

  def loss(*args):
    out = f(*args)
    return jnp.sum(out * jnp.asarray(cot, out.dtype)), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(*args)
  return np.asarray(out), [jax.tree.map(np.asarray, g) for g in grads]


def oracle_values_and_grads(q, k, v, cot, *, sinks=None, **rules) -> tuple[np.ndarray,
                                                                           list[np.ndarray]]:
  """The float64 oracle's output and gradients (q, k, v and sinks when given) of the same loss."""
  out, grads = oracle.out_and_vjp(q, k, v, cot, sinks=sinks, **rules)
  return out, list(grads)


def assert_close(got: tuple[np.ndarray, Sequence[np.ndarray]],
                 want: tuple[np.ndarray, Sequence[np.ndarray]], dtype: Any = np.float32,
                 grad: str = "grad", names: Sequence[str] = ("dq", "dk", "dv", "dsinks")) -> None:
  """(out, grads) against (out, grads) of the oracle, with `dtype`'s tolerances (`grad`: "grad"
  or "sharded_grad")."""
  (out, grads), (want_out, want_grads) = got, want
  np.testing.assert_allclose(np.asarray(out), want_out, err_msg="out", **tol("out", dtype))
  assert len(grads) == len(want_grads), (len(grads), len(want_grads))
  for name, g, w in zip(names, grads, want_grads):
    assert_near(g, w, grad, dtype, err_msg=name)


def oracle_rules(config: Any, **extras: Any) -> dict[str, Any]:
  """`oracle.attention` keywords for what an AttentionConfig and `attention`'s arrays say."""
  names = dict(q_segment_ids="q_seg", kv_segment_ids="kv_seg", q_positions="q_pos",
               kv_positions="kv_pos", mask="mask")
  return dict(causal=config.causal, window=config.window, chunk=config.chunk_size,
              soft_cap=config.logits_soft_cap, scale=config.softmax_scale,
              **{names[n]: a for n, a in extras.items() if n in names})


def check_against_oracle(f: Callable[..., jax.Array], q, k, v, cot, *, sinks=None,
                         grad: str = "grad", **rules) -> None:
  """f(q, k, v[, sinks]) -> out: its values and gradients against the float64 oracle of `rules`
  (keywords of `oracle.attention`), f32 tolerances."""
  args = (q, k, v) if sinks is None else (q, k, v, sinks)
  got = values_and_grads(f, args, cot)
  assert_close(got, oracle_values_and_grads(q, k, v, cot, sinks=sinks, **rules), grad=grad)


def score_case(kind, q_pos, kv_pos, num_heads):
  """(params, fn(params) -> dense [B|1, Hq, T, S] float64 in jnp) for each kind of score
  ("alibi", "t5_bi", "t5_uni", "fn"): the oracle's side of `score_object(kind, params)`."""
  dist = lambda: jnp.abs(q_pos[:, None, :, None] - kv_pos[:, None, None, :])  # [B, 1, T, S]
  rel = lambda: kv_pos[:, None, :] - q_pos[:, :, None]  # [B, T, S]
  if kind == "alibi":
    return (np.asarray(sh.scores.alibi_slopes(num_heads)) * 1.5,
            lambda s: -s[None, :, None, None] * dist())
  if kind.startswith("t5"):
    bidirectional = kind == "t5_bi"
    table = np.random.default_rng(5).normal(size=(32, num_heads)).astype(np.float32)
    bucket = oracle.t5_bucket(np.asarray(rel()), 32, 20, bidirectional, np)  # [B, T, S]
    return table, lambda t: jnp.moveaxis(t[bucket], -1, 1)
  if kind == "fn":
    params = {"w": np.linspace(0.5, 1.0, num_heads).astype(np.float32), "c": np.float32(0.3)}
    head = jnp.arange(num_heads)[None, :, None, None]
    return params, lambda p: p["c"] * jnp.cos(p["w"][head] * dist()) - 0.01 * head
  raise ValueError(kind)


def score_object(kind, params):
  """The library's score object of `kind` holding `params`."""
  if kind == "alibi":
    return sh.scores.Alibi(params)
  if kind.startswith("t5"):
    return sh.scores.RelativePosition(params, max_distance=20, bidirectional=kind == "t5_bi")
  if kind == "fn":
    return sh.scores.ScoreFn(_score_fn, params)
  raise ValueError(kind)


def _score_fn(params, q_pos, kv_pos, head):
  return params["c"] * jnp.cos(params["w"][head] * jnp.abs(q_pos - kv_pos)) - 0.01 * head


def paged_module_steps(num_pages=16, seed=11):
  """Two serving steps over shuffled pages of 4: A (4 tokens) and B (5) prefill; then A decodes
  one, B prefills a chunk of 4 and C starts with 5. (inputs, batch, rows) per step, rows as
  (sequence, first token, tokens) in step order; every sequence's token inputs."""
  rng = np.random.default_rng(seed)
  xs = {name: rng.normal(size=(n, 16)).astype(np.float32) for name, n in zip("ABC", (5, 9, 5))}
  free = list(rng.permutation(num_pages))
  table = np.full((3, 4), -1, np.int32)
  for s in range(3):
    table[s, :3] = [free.pop() for _ in range(3)]
  steps = []
  for rows in ([("A", 0, 4), ("B", 0, 5)], [("A", 4, 1), ("B", 5, 4), ("C", 0, 5)]):
    x = np.concatenate([xs[n][t:t + k] for n, t, k in rows] + [np.zeros((1, 16), np.float32)])
    cu = np.concatenate([[0], np.cumsum([k for *_, k in rows])])
    cu = np.pad(cu, (0, 4 - len(cu)), mode="edge").astype(np.int32)
    kv = np.array([t for _, t, _ in rows] + [0] * (3 - len(rows)), np.int32)
    batch = sh.RaggedBatch(jnp.asarray(cu), jnp.asarray(kv), jnp.asarray(table),
                           jnp.asarray(len(rows), jnp.int32))
    steps.append((x, batch, rows))
  return xs, steps
