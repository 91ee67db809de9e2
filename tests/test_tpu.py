"""The TPU calls, compiled on the chip (`make tpu-check` on the lent v5e: `pytest -m tpu`), against
the float64 oracle: the cases the rest of the suite checks in interpret mode (the dense splash
kernel, the block-list kernel, the paged kernel), bf16 at FlashAttention's bar, and the precision
f32 inputs get. On a machine without a TPU every test here skips with that reason; CI checks the
same kernels in interpret mode and lowered to Mosaic.

float32 runs under `jax.default_matmul_precision("highest")` (the kernels' f32 products are
bf16 passes by default on a TPU: `test_float32_precision_by_default_and_under_highest` measures
both); the oracle runs on the CPU (float64 has no TPU kernels).
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
import paged_cases
import splash_hk as sh
from splash_hk.backends.tpu import backend as splash_tpu
from splash_hk.backends.tpu import lists as splash_lists
from splash_hk.backends.tpu import paged_kernel as tpu_paged
import bf16_cases
from cases import Case, GRAD_CASES, LIST_CASES, SPLASH_CASES, check_moba, list_attention
from cases import list_case

pytestmark = [pytest.mark.tpu,
              pytest.mark.skipif(jax.default_backend() != "tpu",
                                 reason="needs a TPU: `make tpu-check` runs these compiled on the "
                                        "lent v5e (CPU checks the same kernels in interpret mode)")]
COMPILED = dict(platform="splash", interpret=False, allow_fallback=False)
# float32 on the chip under "highest": its products are exact to f32, its exp and tanh agree with
# float64 to about five digits (measured on the v5e: soft-capped and sink cases 2e-5 to 5e-5
# off where products alone are 2e-6), so outputs are held to 1e-4 and gradients to 3e-4.
CHIP_F32 = harness.Tolerance(out=1e-4, grad=3e-4, sharded_grad=3e-4)


@pytest.fixture(autouse=True)
def oracle_on_the_cpu(monkeypatch):
  """The float64 oracle's jnp gradients on the CPU (a TPU has no float64 kernels); each test
  under "highest" matmul precision, the kernels' f32 products exact to f32."""
  cpu = jax.devices("cpu")[0]
  original = oracle.out_and_vjp

  def on_cpu(*args, **kwargs):
    with jax.default_device(cpu):
      return original(*args, **kwargs)

  monkeypatch.setattr(oracle, "out_and_vjp", on_cpu)
  monkeypatch.setitem(harness.TOLERANCES, np.dtype(np.float32), CHIP_F32)
  with jax.default_matmul_precision("highest"):
    yield


def _out_and_grads_vs_oracle(case: Case, config, q, k, v, extras, grads: bool):
  sinks = extras.get("softmax_aux")
  rest = {n: a for n, a in extras.items() if n != "softmax_aux"}
  f = lambda q, k, v, *s: sh.attention(q, k, v, config=config, softmax_aux=s[0] if s else None,
                                       **rest).attention_outputs
  if not grads:
    out = jax.jit(f)(q, k, v, *(() if sinks is None else (sinks,)))
    np.testing.assert_allclose(np.asarray(out), case.oracle(q, k, v, extras)[0], **harness.tol())
    return
  cot = np.random.default_rng(7).normal(size=(*q.shape[:3], v.shape[-1])).astype(np.float32)
  rules = harness.oracle_rules(config, **rest)
  harness.check_against_oracle(f, q, k, v, cot, sinks=sinks, **rules)


@pytest.mark.parametrize("case", SPLASH_CASES, ids=lambda c: c.name)
def test_the_dense_kernel_compiled_matches_the_oracle(case):
  config = case.config.replace(**COMPILED)
  q, k, v, extras = case.arrays(seed=3)
  assert sh.explain(q, k, v, config=config, **extras).backend == "splash"
  _out_and_grads_vs_oracle(case, config, q, k, v, extras, grads=case.name in GRAD_CASES)


@pytest.mark.parametrize("name", list(bf16_cases.CASES))
def test_bf16_at_most_twice_a_plain_bf16_implementation(name):
  bf16_cases.check_bf16(name, dict(platform="splash", allow_fallback=False), None)


def test_bf16_at_a_real_size_with_the_tables_tiles():
  """B2 T4096 Hq8 Hkv2 D128 causal at the default tiles (the table's) against the same bar."""
  bf16_cases.check_bf16("causal_gqa", dict(platform="splash", allow_fallback=False), None,
                       shape=(2, 4096, 8, 2, 128))


@pytest.mark.parametrize("tiles", [None, (256, 256)], ids=["table", "tiles_256"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "apart"])
def test_packed_documents_compiled_skip_their_blocks_and_match_the_oracle(tiles, fused):
  """Documents of 200-900 tokens (and padding) at T 2000: each example's plan skips the block
  pairs its documents keep apart (`backends/tpu/documents.py`), forward and backward."""
  case = Case("docs", batch=2, query_len=2000, kv_len=2000, num_heads=4, num_kv_heads=2,
              head_dim=128, sinks="heads")
  q, k, v, extras = case.arrays(seed=5)
  ids = np.zeros((2, 2000), np.int32)
  for row, starts in enumerate([[200, 1100, 1300], [900, 1000, 1900]]):
    for n, start in enumerate(starts):
      ids[row, start:] = n + 1
  ids[1, 1950:] = -1  # padding
  extras["q_segment_ids"] = ids
  sizes = sh.BlockSizes() if tiles is None else sh.BlockSizes(*tiles)
  config = case.config.replace(**COMPILED, block_sizes=sizes, fused_backward=fused)
  _out_and_grads_vs_oracle(case, config, q, k, v, extras, grads=True)


@pytest.mark.parametrize("name", sorted(LIST_CASES))
def test_the_block_list_kernel_compiled_matches_the_oracle(name):
  (q, k, v, sinks), mask, kwargs, rules = list_case(name)
  config = sh.AttentionConfig(logits_soft_cap=rules["soft_cap"], **COMPILED)
  cot = np.random.default_rng(1).standard_normal((*q.shape[:3], v.shape[-1])).astype(np.float32)
  harness.check_against_oracle(list_attention(config, mask, kwargs), q, k, v,
                               cot, sinks=sinks, **rules)


@pytest.mark.parametrize("name", sorted(LIST_CASES))
def test_the_block_list_kernels_alone_compiled_match_the_oracle(name, monkeypatch):
  """The block-list kernels without the garbage guard (which would rerun a call on xla if they
  gave anything not finite), on the chip: their own values and gradients."""
  monkeypatch.setattr(splash_tpu, "_GUARDED_LISTS", splash_lists.attend)
  test_the_block_list_kernel_compiled_matches_the_oracle(name)


@pytest.mark.parametrize("block,top_k", [((128, 128), 8), ((512, 512), 3)])
@pytest.mark.parametrize("length", [4096, 16384])
def test_moba_choices_at_real_sizes_compiled_match_the_block_oracle(length, block, top_k,
                                                                    monkeypatch):
  """MoBA's choice (own + 8 of 128, own + 3 of 512) at T = 4096 and 16384, GQA 8 / 2, D 128,
  sinks, two documents and padding, NaN in the key blocks no list of their kv head names: the
  block-list kernels alone (no garbage guard) on the chip against the float64 block oracle,
  values and gradients."""
  monkeypatch.setattr(splash_tpu, "_GUARDED_LISTS", splash_lists.attend)
  check_moba(sh.AttentionConfig(**COMPILED), length, block, top_k)


@pytest.mark.parametrize("rule", list(paged_cases.RULES))
def test_the_paged_kernel_compiled_matches_the_oracle(rule):
  config, rules = paged_cases.RULES[rule]
  step = paged_cases.step(seed=1)
  config = dataclasses.replace(config, **COMPILED)
  out, cache = jax.jit(lambda *a: sh.paged_attention(*a, config=config))(
      step.q, step.k, step.v, step.cache, step.batch)
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step, **rules), **harness.tol())
  paged_cases.check_written(step, cache)  # the pool written on the chip too


@pytest.mark.parametrize("rule", ["causal", "window"])
def test_prompts_with_nothing_cached_compiled_run_on_the_dense_kernel(rule, monkeypatch):
  """Three prompts' first chunks (700, 300 and 37 rows, nothing cached), padding rows, sinks,
  bf16, D 128: the dense kernel over the packed rows (`fresh`), on the chip."""
  from splash_hk.backends.tpu import fresh  # pylint: disable=import-outside-toplevel
  calls = []
  attend = fresh.attend
  monkeypatch.setattr(fresh, "attend", lambda *a: (calls.append(a[1]), attend(*a))[1])
  step = paged_cases.step(seed=5, kv_lens=(0, 0, 0), q_lens=(700, 300, 37), pad_rows=5,
                          page=64, pages_per_seq=12, num_pages=40, hq=8, hkv=2, d=128,
                          value_dim=128, dtype=jnp.bfloat16)
  config, rules = {"causal": (sh.AttentionConfig(), {}),
                   "window": (sh.AttentionConfig(sliding_window=(256, 0)),
                              dict(window=(256, 0)))}[rule]
  sinks = np.linspace(-1.0, 1.0, 8).astype(np.float32)
  out, _ = jax.jit(lambda *a: sh.paged_attention(*a, config=config.replace(**COMPILED),
                                                 softmax_aux=sinks))(
      step.q, step.k, step.v, step.cache, step.batch)
  assert len(calls) == 1
  want = paged_cases.attend(step, sinks=sinks, **rules)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, **harness.tol(dtype=jnp.bfloat16))


@pytest.mark.parametrize("new_rows", [7, 9])
def test_a_new_nan_value_compiled_shows_only_in_the_rows_that_see_it(new_rows):
  """Garbage and a visible NaN on the chip: the paged kernel's guarded and whole blocks."""
  paged_cases.check_new_nan(sh.AttentionConfig(**COMPILED), new_rows)


@pytest.mark.parametrize("keys", [512, 1024])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("chosen,window,in_order", [
    (False, paged_cases.RUNS_WINDOW, False), (True, paged_cases.RUNS_WINDOW, False),
    (False, None, False), (False, None, True)],
                         ids=["table", "selection", "table_causal", "in_order_causal"])
def test_runs_of_pages_compiled_match_the_oracle(chosen, window, in_order, page, keys,
                                                 monkeypatch):
  """bf16 pools of pages of 16 and 64, histories of 3000 and 5000 tokens: the paged kernel's
  runs of pages (`keys` a grid step, copies started a step ahead, whole blocks unguarded where
  causal with no window, consecutive pages one copy a buffer) on the chip."""
  monkeypatch.setattr(tpu_paged, "BUFFER_BUDGET", tpu_paged.BUFFER_BUDGET * keys
                      // tpu_paged.BLOCK_KEYS)
  monkeypatch.setattr(tpu_paged, "BLOCK_KEYS", keys)
  step, batch, want = paged_cases.runs_of_pages(chosen, page, kv_lens=(3000, 0, 5000, 37),
                                                dtype=jnp.bfloat16, window=window,
                                                in_order=in_order)
  config = sh.AttentionConfig(sliding_window=window, **COMPILED)
  out, _ = jax.jit(lambda *a: sh.paged_attention(*a, config=config))(
      step.q, step.k, step.v, step.cache, batch)
  np.testing.assert_allclose(np.asarray(out, np.float32)[:len(want)], want,
                             **harness.tol(dtype=jnp.bfloat16))


@pytest.mark.parametrize("rows,kv_heads,dtype", [
    (1, 8, jnp.bfloat16), (4, 8, jnp.bfloat16), (8, 8, jnp.bfloat16), (3, 8, jnp.float32),
    (4, 16, jnp.bfloat16)])
def test_the_decode_kernel_compiled_matches_the_oracle(rows, kv_heads, dtype):
  """A few rows over fixed caches of 3000 keys (not whole blocks) filled to their own lengths
  (the rest padding, NaN in its keys and values), explicit positions, sinks and a soft cap, on
  the chip (`backends/tpu/decode.py`)."""
  rng = np.random.default_rng(rows)
  batch, heads, keys = 3, 32, 3000
  q = rng.normal(size=(batch, rows, heads, 128)).astype(np.float32)
  k, v = (rng.normal(size=(batch, keys, kv_heads, 128)).astype(np.float32) for _ in range(2))
  lengths = np.asarray([3000, 41, 1700])
  kv_seg = np.where(np.arange(keys)[None] < lengths[:, None], 0, -1).astype(np.int32)
  k[kv_seg < 0], v[kv_seg < 0] = np.nan, np.nan
  q_pos = (lengths[:, None] - rows + np.arange(rows)[None]).astype(np.int32)
  kv_pos = np.broadcast_to(np.arange(keys, dtype=np.int32), (batch, keys))
  sinks = rng.normal(size=(heads, 1)).astype(np.float32)
  config = sh.AttentionConfig(causal=True, logits_soft_cap=30.0, **COMPILED)
  named = dict(q_segment_ids=np.zeros((batch, rows), np.int32), kv_segment_ids=kv_seg,
               q_positions=q_pos, kv_positions=kv_pos, softmax_aux=sinks)
  cast = lambda a: jnp.asarray(a, dtype)
  assert "TPU decode kernel" in sh.explain(cast(q), cast(k), cast(v), config=config,
                                           **named).reason
  out = jax.jit(lambda q, k, v, n: sh.attention(q, k, v, config=config, **n).attention_outputs)(
      cast(q), cast(k), cast(v), named)
  want = oracle.attention(np.asarray(cast(q), np.float32), np.asarray(cast(k), np.float32),
                          np.asarray(cast(v), np.float32), causal=True, soft_cap=30.0,
                          q_seg=named["q_segment_ids"], kv_seg=kv_seg, q_pos=q_pos,
                          kv_pos=kv_pos, sinks=sinks)[0]
  np.testing.assert_allclose(np.asarray(out, np.float32), want, **harness.tol(dtype=dtype))


@pytest.mark.parametrize("writes", list(paged_cases.WRITES))
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_steps_write_compiled_lands_at_its_slots_and_nowhere_else(kind, writes):
  """The pool's write as the chip runs it (a bf16 or int8 pool's slots written a tile of slots
  at a time: `pool.put_tiles`; a ragged step's disjoint runs as windows of rows:
  `pool.put_runs`), against NumPy's row-by-row write."""
  paged_cases.check_a_write(kind, writes)


@pytest.mark.parametrize("page", [32, 64])
@pytest.mark.parametrize("chosen", [False, True], ids=["table", "selection"])
def test_int8_pools_compiled_match_the_oracle(chosen, page):
  """int8 pools (a scale per token and kv head; free slots' codes and scales NaN), bf16
  queries, histories of 3000 and 5000 tokens: the codes copied as bytes and turned into bf16
  in VMEM, the scales a block beside them, on the chip."""
  step, batch, want = paged_cases.runs_of_pages(chosen, page, kv_lens=(3000, 0, 5000, 37),
                                                dtype=jnp.bfloat16, window=None, kind="int8")
  config = sh.AttentionConfig(**COMPILED)
  out, _ = jax.jit(lambda *a: sh.paged_attention(*a, config=config))(
      step.q, step.k, step.v, step.cache, batch)
  np.testing.assert_allclose(np.asarray(out, np.float32)[:len(want)], want,
                             **harness.tol(dtype=jnp.bfloat16))


def test_float32_precision_by_default_and_under_highest():
  """f32 inputs: bf16 passes by default (about 1e-2 off float64), f32 under "highest" (1e-5):
  what the precision section of the performance guide states."""
  case = Case("precision", batch=1, query_len=1024, kv_len=1024, num_heads=4, num_kv_heads=2,
              head_dim=128)
  q, k, v, extras = case.arrays(seed=4)
  want = case.oracle(q, k, v, extras)[0]
  run = jax.jit(functools.partial(sh.attention, config=case.config.replace(**COMPILED)))
  errors = {}
  for precision in ("default", "highest"):
    with jax.default_matmul_precision(precision):
      errors[precision] = float(np.abs(np.asarray(run(q, k, v).attention_outputs) - want).max())
  print(f"f32 error against float64: default {errors['default']:.2e}, highest "
        f"{errors['highest']:.2e}")
  assert errors["highest"] <= 1e-5 < errors["default"] <= 3e-2, errors
