"""A paged step with nothing cached before it on the TPU paged backend (`backends/tpu/fresh.py`:
the dense kernel over the step's new rows, packed as documents) in interpret mode against the
float64 oracle: prompts of several sequences with padding rows, the rules it reads, sinks, soft
cap, an int8 pool; the paged kernel where a sequence has history or the call asks for what the
dense kernel does not give (a chunk's absolute positions, the lse)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import paged_cases
import splash_hk as sh
from splash_hk.backends.tpu import fresh

INTERPRET = dict(platform="splash", interpret=True, allow_fallback=False)
PROMPTS = dict(kv_lens=(0, 0, 0), q_lens=(40, 7, 130), page=16, pages_per_seq=12, num_pages=40,
               pad_rows=3)


@pytest.fixture
def dense(monkeypatch):
  """The steps that ran on the dense kernel (counted as traced), at the test's small sizes."""
  monkeypatch.setattr(fresh, "MIN_ROWS", 16)
  calls = []
  attend = fresh.attend
  monkeypatch.setattr(fresh, "attend", lambda *a: (calls.append(a[1]), attend(*a))[1])
  return calls


def _run(step, config, **named):
  return jax.jit(lambda *a: sh.paged_attention(*a, config=config, **named))(
      step.q, step.k, step.v, step.cache, step.batch)


@pytest.mark.parametrize("rule", ["causal", "soft_cap"])
def test_prompts_with_nothing_cached_run_on_the_dense_kernel_and_match_the_oracle(dense, rule):
  step = paged_cases.step(seed=41, hq=8, **PROMPTS)
  config, rules = paged_cases.RULES[rule]
  sinks = np.linspace(-1.0, 1.0, 8).astype(np.float32) if rule == "causal" else None
  out, cache = _run(step, config.replace(**INTERPRET), softmax_aux=sinks)
  assert len(dense) == 1
  want = paged_cases.attend(step, sinks=sinks, **rules)
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
  assert np.isnan(np.asarray(cache.key)).any()  # the free slots as they were: written, not wiped


@pytest.mark.parametrize("rule", ["window", "bidirectional"])
def test_one_prompt_with_padding_rows_after_it_matches_the_oracle(dense, rule):
  """One sequence a step: under a rule that sees back only, its segment ids say nothing and are
  left out (the padding rows after it are never seen); a bidirectional one keeps them."""
  step = paged_cases.step(seed=45, kv_lens=(0,), q_lens=(200,), max_seqs=1, page=16,
                          pages_per_seq=14, num_pages=20, pad_rows=6, hq=8)
  config, rules = paged_cases.RULES[rule]
  out, _ = _run(step, config.replace(**INTERPRET))
  assert len(dense) == 1
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step, **rules),
                             **harness.tol())


def test_prompts_with_heads_sharded_over_the_head_axis(dense):
  """tp = 2 over 8 query and 4 kv heads, kv-head sinks sharded with their heads: each shard's
  dense call is its own heads'."""
  step = paged_cases.step(seed=46, hq=8, hkv=4, **PROMPTS)
  sinks = np.random.default_rng(47).normal(size=(4, 1)).astype(np.float32)
  out, cache = jax.jit(lambda q, k, v, c, b, s: sh.paged_attention(
      q, k, v, c, b, softmax_aux=s, config=sh.AttentionConfig(**INTERPRET),
      mesh=harness.mesh("4x2")))(step.q, step.k, step.v, step.cache, step.batch, sinks)
  assert len(dense) == 1 and out.sharding.spec[1] == "tp"
  want = paged_cases.attend(step, sinks=np.repeat(sinks, 2, 0))
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())


def test_a_visible_nan_in_a_prompt_shows_only_where_the_oracle_has_it(dense):
  """A new value row of the third prompt holds NaN in one column of kv head 0: its own and later
  rows show NaN there, in that kv head's query heads only; garbage in the free slots and the
  padding rows changes nothing."""
  step = paged_cases.step(seed=48, hq=8, **PROMPTS)
  row = 40 + 7 + 50  # the third sequence's row 50
  step.v[row, 0, 3] = np.nan
  step.history_v[2][50, 0, 3] = np.nan  # the oracle's history holds it as written
  out = np.asarray(_run(step, sh.AttentionConfig(**INTERPRET))[0])
  assert len(dense) == 1
  assert np.isnan(out[row:row + 80, :4, 3]).all() and not np.isnan(out[:row]).any()
  np.testing.assert_allclose(out, paged_cases.attend(step), **harness.tol())


def test_prompts_over_an_int8_pool_attend_their_rows_as_stored(dense):
  step = paged_cases.quantized_step("int8", 42, hq=8, **{**PROMPTS, "page": 32,
                                                          "pages_per_seq": 6})
  out, _ = _run(step, sh.AttentionConfig(**INTERPRET))
  assert len(dense) == 1
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step), **harness.tol())


@pytest.mark.parametrize("case", ["history", "chunk", "residuals"])
def test_what_the_dense_kernel_cannot_serve_runs_on_the_paged_kernel(dense, case):
  """A sequence with history (the run-time choice picks the paged kernel), a chunk (it reads
  positions in each sequence) or the lse asked for (the dense kernel returns none)."""
  kv_lens = (0, 5, 0) if case == "history" else (0, 0, 0)
  step = paged_cases.step(seed=43, hq=8, **{**PROMPTS, "kv_lens": kv_lens})
  config, rules = paged_cases.RULES["chunk" if case == "chunk" else "causal"]
  got = _run(step, config.replace(**INTERPRET), return_residuals=case == "residuals")
  assert len(dense) == (1 if case == "history" else 0)  # traced, then not taken at run time
  np.testing.assert_allclose(np.asarray(got[0]), paged_cases.attend(step, **rules),
                             **harness.tol())
  if case == "residuals":
    live = np.arange(len(step.q)) < sum(step.q_lens)
    assert np.isfinite(np.asarray(got[2])[live]).all()


def test_whether_a_step_has_nothing_cached_is_read_from_its_lengths():
  step = paged_cases.step(seed=44, **{**PROMPTS, "kv_lens": (0, 0, 3)})
  layout, lists = sh.paged._plan(step.batch, sh.nodes.Static(sh.paged.paged_facts(
      step.q, step.k, step.v, step.cache, step.batch, config=sh.AttentionConfig(), mask=None,
      bias=None, softmax_aux=None)))
  x = lambda layout: sh.pages.PagedInputs(query=step.q, cache=step.cache, layout=layout,
                                           lists=lists, rule=None, bias=None, sinks=None,
                                           heads=None)
  assert not bool(fresh.fresh(x(layout)))
  rows = np.diff(np.asarray(step.batch.cu_q_lens))  # [max_seqs]: each sequence's new rows
  assert bool(fresh.fresh(x(layout._replace(kv_len_after=jnp.asarray(rows)))))
