"""Invisible means absent, visible NaN shows: on every backend, under a mesh, through the KV cache.

Garbage (NaN, Inf, finite values near the float limit) where no query looks --
keys/values at padding, padded query rows, unused cache slots -- changes no
output and no gradient: each equals the result with zeros there. A NaN that a
row does see makes exactly that row NaN, as the float64 oracle computes it.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from splash_hk import inputs
from splash_hk.backends import guard
from splash_hk.backends.tpu import backend as splash_tpu
from splash_hk.types import Extras, KernelOutput
from cases import Case
import harness
import oracle

SPLASH = dict(platform="splash", interpret=True, allow_fallback=False)
BACKENDS = {
    "xla": (dict(platform="xla", allow_fallback=False), 24),
    "reference": (dict(platform="reference", allow_fallback=False), 24),
    "splash": (SPLASH, 128),
}


def _padded_case(length: int, **kw) -> tuple[Case, tuple]:
  case = Case("garbage", batch=2, query_len=length, kv_len=length, num_heads=4, num_kv_heads=2,
              head_dim=32, window=(length // 2, 0), segments="packed", sinks="heads_n", **kw)
  return case, case.arrays(seed=11)


def _with_garbage(q, k, v, extras, fill):
  """q rows and k/v entries at padding (negative segment ids) replaced by `fill`."""
  pad = extras["q_segment_ids"] < 0  # [B, T] (T == S: kv ids default to q's)
  put = lambda a: np.where(pad[:, :, None, None], np.asarray(fill, a.dtype), a)
  return put(q), put(k), put(v)


def _out_and_grads(config, q, k, v, extras, mesh=None):
  """[out, dq, dk, dv, dsinks] of sum(out * cot), jitted."""
  rest = {n: a for n, a in extras.items() if n != "softmax_aux"}
  f = lambda q, k, v, sinks: sh.attention(q, k, v, config=config, softmax_aux=sinks, mesh=mesh,
                                          **rest).attention_outputs
  out, grads = harness.values_and_grads(f, (q, k, v, extras["softmax_aux"]), _cot(q))
  return [out, *grads]


def _oracle_out_and_grads(case, q, k, v, extras):
  """What `_out_and_grads` must give, from the float64 oracle (same cotangent)."""
  rest = {n: a for n, a in extras.items() if n != "softmax_aux"}
  out, grads = harness.oracle_values_and_grads(q, k, v, _cot(q), sinks=extras["softmax_aux"],
                                               **harness.oracle_rules(case.config, **rest))
  return [out, *grads]


def _cot(q):
  return np.random.default_rng(1).normal(size=q.shape).astype(np.float32)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("fill", [np.nan, np.inf, 3e38], ids=["nan", "inf", "near_float_max"])
def test_garbage_at_padding_changes_no_output_and_no_gradient(backend, fill):
  changes, length = BACKENDS[backend]
  case, (q, k, v, extras) = _padded_case(length)
  config = case.config.replace(**changes)
  want = _oracle_out_and_grads(case, *_with_garbage(q, k, v, extras, 0.0), extras)
  dirty = _out_and_grads(config, *_with_garbage(q, k, v, extras, fill), extras)
  pad = extras["q_segment_ids"] < 0
  for name, w, d in zip(("out", "dq", "dk", "dv", "dsinks"), want, dirty):
    assert np.all(np.isfinite(d)), name
    if name in ("out", "dq", "dk", "dv"):
      assert np.all(d[pad] == 0), name  # padded rows output 0 and get no gradient
    np.testing.assert_allclose(d, w, err_msg=name, **harness.tol("out" if name == "out" else "grad"))


def _nan_rows(case, q, k, v, extras, config):
  out = jax.jit(functools.partial(sh.attention, config=config))(q, k, v, **extras)
  out = np.asarray(out.attention_outputs)
  expected, _ = case.oracle(q, k, v, extras)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
  finite = ~np.isnan(expected)
  np.testing.assert_allclose(out[finite], expected[finite], **harness.tol())
  return np.isnan(out).any(axis=(2, 3))  # [B, T]: which rows are NaN


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_nan_reaches_exactly_the_rows_that_see_it(backend):
  changes, length = BACKENDS[backend]
  case = Case("nan", batch=1, query_len=length, kv_len=length, num_heads=2, num_kv_heads=1,
              head_dim=32, window=(length // 4, 0))
  q, k, v, extras = case.arrays(seed=12)
  config = case.config.replace(**changes)
  j = length // 2
  v[0, j, 0, 3] = np.nan  # a visible value: rows j .. j + length/4 see it
  rows = _nan_rows(case, q, k, v, extras, config)
  assert rows[0].tolist() == [j <= i <= j + length // 4 for i in range(length)]
  v[0, j, 0, 3] = 0.0
  k[0, j, 0, 5] = np.nan  # a visible key
  np.testing.assert_array_equal(_nan_rows(case, q, k, v, extras, config), rows)
  k[0, j, 0, 5] = 0.0
  q[0, 3, 1, 0] = np.nan  # a query: its own row only
  assert _nan_rows(case, q, k, v, extras, config)[0].tolist() == [i == 3 for i in range(length)]


def test_garbage_at_padding_under_a_mesh():
  case = Case("mesh", batch=2, query_len=16, kv_len=16, num_heads=8, num_kv_heads=2, head_dim=16,
              window=(8, 0), segments="packed", sinks="heads_n")
  q, k, v, extras = case.arrays(seed=13)
  mesh = harness.mesh("2x4", explicit=True)
  want = _oracle_out_and_grads(case, *_with_garbage(q, k, v, extras, 0.0), extras)
  dirty = _out_and_grads(case.config, *_with_garbage(q, k, v, extras, np.nan), extras, mesh=mesh)
  for name, w, d in zip(("out", "dq", "dk", "dv", "dsinks"), want, dirty):
    harness.assert_near(d, w, "grad", err_msg=name)


def test_unused_cache_slots_holding_garbage_change_nothing():
  mha = lambda: sh.MultiHeadAttention(4, 8, num_kv_heads=2, w_init=hk.initializers.VarianceScaling(1.0))
  step = hk.without_apply_rng(hk.transform(lambda x, cache: mha()(x, kv_cache=cache)))
  x = np.random.default_rng(14).normal(size=(2, 5, 16)).astype(np.float32)
  params = step.init(jax.random.PRNGKey(0), x, sh.KVCache.zeros(2, 12, 2, 8))
  step = jax.jit(step.apply)
  want = oracle.mha(params, x, num_heads=4, num_kv_heads=2, key_size=8, value_size=8)
  for fill in (0.0, np.nan, np.inf):
    cache = sh.KVCache(jnp.full((2, 12, 2, 8), fill), jnp.full((2, 12, 2, 8), fill),
                       jnp.zeros((2,), jnp.int32))
    prefill, cache = step(params, x[:, :4], cache)  # prefill 4 tokens into 12 slots
    decode, cache = step(params, x[:, 4:], cache)  # decode the 5th
    got = np.concatenate([np.asarray(prefill), np.asarray(decode)], axis=1)
    np.testing.assert_allclose(got, want, **harness.tol(), err_msg=f"fill {fill}")


def _kept_or_recomputed(x):
  """log(x) where every entry is finite (x > 0), else |x| (`guard.kept_unless`)."""
  out = jnp.log(x)  # [B, T, H, D]
  return guard.kept_unless(jnp.all(jnp.isfinite(out)), out, lambda: jnp.abs(x))


def test_the_guard_keeps_a_finite_result_in_place_and_recomputes_garbage():
  x = np.random.default_rng(15).uniform(0.5, 2.0, size=(1, 256, 4, 128)).astype(np.float32)
  run = jax.jit(_kept_or_recomputed)
  np.testing.assert_allclose(run(x), np.log(x), rtol=1e-6)
  x[0, 7, 1, 3] = -1.0  # log(-1) = NaN: the whole result is recomputed
  np.testing.assert_array_equal(run(x), np.abs(x))
  hlo = run.lower(x).compile().as_text()
  copies = [line for line in hlo.splitlines() if " copy(" in line and "[1,256,4,128]" in line]
  assert not copies, "the kept result is copied (a lax.cond returning it costs a full pass)"


def _splash_primal_or_seven(q, k, v, extras, config) -> tuple[np.ndarray, bool]:
  """The TPU guard's call, not differentiated, with a recompute that outputs 7 everywhere, and
  whether the kernel ran (a callback in it)."""
  x, facts = inputs.normalise(q, k, v, config=config, extras=Extras(**extras))
  ran = []

  def kernel(y, f):
    jax.debug.callback(lambda: ran.append(True))
    return splash_tpu.attend_head_major(y, f)

  sevens = lambda y, f: KernelOutput(jnp.full((*y.query.shape[:3], y.value.shape[-1]), 7.0))
  guarded = guard.guard_head_major(kernel, sevens)
  out = np.asarray(jax.jit(lambda x: guarded(x, facts).out)(x))
  return out, bool(ran)


def test_the_splash_primal_checks_values_before_its_kernel_runs():
  """Not differentiated, the TPU guard asks whether v is finite before the kernel runs
  (`guard.guard_head_major`): garbage in q and k where no query looks reaches only logits the
  kernel replaces by its mask value, so the kernel's output stands (the oracle's); with garbage
  in v the kernel does not run, the recompute does."""
  case, (q, k, v, extras) = _padded_case(128)
  config = case.config.replace(**SPLASH)
  want, _ = case.oracle(*_with_garbage(q, k, v, extras, 0.0), extras)
  dirty_q, dirty_k, _ = _with_garbage(q, k, v, extras, np.nan)
  got, ran = _splash_primal_or_seven(dirty_q, dirty_k, v, extras, config)
  np.testing.assert_allclose(got, want, **harness.tol())
  assert ran
  _, _, dirty_v = _with_garbage(q, k, v, extras, np.inf)
  got, ran = _splash_primal_or_seven(q, k, dirty_v, extras, config)
  assert np.all(got == 7.0) and not ran


def test_the_block_list_primal_checks_values_before_its_kernel_runs():
  """Chosen blocks (every block listed: the rule is the case's), not differentiated: garbage in
  q and k at padding reaches only logits the block-list kernel replaces by -inf, so the kernel
  runs and its output is the oracle's; with garbage in v it does not run (`values_finite`),
  the exact path does."""
  from splash_hk.backends.tpu import lists as splash_lists  # pylint: disable=import-outside-toplevel
  from splash_hk.backends.xla import backend as xla  # pylint: disable=import-outside-toplevel
  case, (q, k, v, extras) = _padded_case(128)
  blocks = (sh.masks.Blocks(np.tile(np.arange(2, dtype=np.int32), (2, 2, 2, 1)),
                            np.full((2, 2, 2), 2, np.int32), (64, 64))
            & sh.masks.Causal() & sh.masks.SlidingWindow((64, 0)))  # the case's rule
  want, _ = case.oracle(*_with_garbage(q, k, v, extras, 0.0), extras)
  ran = []

  def kernel(y, f):
    jax.debug.callback(lambda: ran.append(True))
    return splash_lists.attend(y, f)

  guarded = guard.guard_garbage(kernel, xla.attend, check_first=guard.values_finite)
  config = case.config.replace(**SPLASH, sliding_window=None)

  def run(q, k, v):
    x, facts = inputs.normalise(q, k, v, config=config, extras=Extras(mask=blocks, **extras))
    return np.asarray(jax.jit(lambda x: guarded(x, facts).out)(x))

  dirty_q, dirty_k, dirty_v = _with_garbage(q, k, v, extras, np.nan)
  np.testing.assert_allclose(run(dirty_q, dirty_k, v), want, **harness.tol())
  assert ran
  ran.clear()
  np.testing.assert_allclose(run(q, k, dirty_v), want, **harness.tol())
  assert not ran
