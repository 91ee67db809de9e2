"""The block-list kernel (Pallas TPU, `backends/tpu/list_kernel.py`) on chosen blocks: interpret mode
against the float64 oracle (values, gradients, misuse, garbage in unlisted blocks), and lowered
to Mosaic for TPU from this host, forward and backward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import block_oracle
import harness
import oracle
import paged_cases
import splash_hk as sh
from splash_hk import pages
from splash_hk.backends.tpu import backend as splash_tpu
from splash_hk.backends.tpu import list_dkv
from splash_hk.backends.tpu import list_kernel as tpu_lists
from splash_hk.backends.tpu import lists as splash_lists
from splash_hk.backends.tpu import paged as splash_paged
from splash_hk.backends.tpu import paged_kernel as tpu_paged
from cases import LIST_CASES, blocks_case, check_moba, list_attention, list_case, random_choice

TPU = dict(platform="splash", interpret=True, allow_fallback=False)

@pytest.mark.parametrize("name", sorted(LIST_CASES))
def test_values_and_gradients_match_the_oracle(name):
  (q, k, v, sinks), mask, kwargs, rules = list_case(name)
  config = sh.AttentionConfig(logits_soft_cap=rules["soft_cap"], **TPU)
  decision = sh.explain(q, k, v, config=config, mask=mask, softmax_aux=sinks, **kwargs)
  assert decision.backend == "splash" and "block-list kernel" in decision.reason
  cot = np.random.default_rng(1).standard_normal((*q.shape[:3], v.shape[-1])).astype(np.float32)
  harness.check_against_oracle(list_attention(config, mask, kwargs), q, k, v, cot, sinks=sinks,
                               **rules)


@pytest.mark.parametrize("name", sorted(LIST_CASES))
def test_the_kernels_alone_give_the_oracles_values_and_gradients(name, monkeypatch):
  """Without the garbage guard (which would rerun a call on xla if the kernels gave anything not
  finite): the three kernels' own values and gradients, key blocks no list names included
  (zero, not left unwritten)."""
  monkeypatch.setattr(splash_tpu, "_GUARDED_LISTS", splash_lists.attend)
  test_values_and_gradients_match_the_oracle(name)


def test_the_block_oracle_matches_the_dense_oracle():
  """The tests' float64 oracle over each tile's chosen keys (`block_oracle`) against the dense
  one on the same choice (GQA, sinks, segments with padding): values and gradients."""
  rng, size = np.random.default_rng(3), (64, 128)
  q = rng.standard_normal((1, 320, 4, 16))
  k, v, = (rng.standard_normal((1, 320, 2, 16)) for _ in range(2))
  cot, sinks = rng.standard_normal(q.shape), rng.standard_normal(4)
  lists, counts = random_choice(rng, 1, 2, 320, 320, size, 2)
  seg = np.repeat(np.array([0, 1, 1, -1]), 80)[None]
  rules = dict(causal=True, mask=oracle.chosen_blocks(lists, counts, size, 1, 4, 320, 320),
               q_seg=seg, kv_seg=seg)
  want, want_grads = harness.oracle_values_and_grads(q, k, v, cot, sinks=sinks, **rules)
  got, got_grads = block_oracle.chosen_attention(q, k, v, cot, lists, counts, size, sinks, seg)
  np.testing.assert_allclose(got, want, atol=1e-12)
  for g, w in zip(got_grads, want_grads[:3]):
    np.testing.assert_allclose(g, w, atol=1e-12)


@pytest.mark.parametrize("block,top_k", [((128, 128), 3), ((256, 256), 1), ((512, 512), 1)])
def test_moba_choices_with_sinks_segments_and_garbage_match_the_block_oracle(
    block, top_k, monkeypatch):
  """MoBA's own choice (`top_k_blocks`) at T = 1024, GQA 8 / 2, D 128, sinks, two documents and
  padding, NaN in every key block no list of its kv head names: the kernels alone (no garbage
  guard) against the float64 block oracle (interpret mode; the chip runs it at T = 4096 and
  16384, `test_tpu.py`)."""
  monkeypatch.setattr(splash_tpu, "_GUARDED_LISTS", splash_lists.attend)
  check_moba(sh.AttentionConfig(**TPU), 1024, block, top_k)


@pytest.mark.parametrize("block,itemsize,heads", [
    (512, 4, 1),  # measured on a v5e: 18.4 MiB of VMEM with the group of 4, over its 16 MiB
    (512, 2, 1), (256, 4, 4), (128, 4, 4), (128, 2, 4)])
def test_a_program_serves_the_group_where_its_tiles_fit_in_vmem(block, itemsize, heads):
  """Lists serving a group of 4 heads: one program for the group (one copy of a block) where
  its tiles fit the kernel's VMEM budget, else a program a head (f32 tiles of 512 with the
  group did not compile on the chip)."""
  assert splash_lists.program_heads(block, block, 128, 128, itemsize, 4) == heads
  need = splash_lists.vmem_bytes(block, block, 128, 128, itemsize, heads)
  assert need <= tpu_lists.VMEM_BUDGET < 16 * 2 ** 20


def test_a_real_size_matches_the_oracle():
  """T = S = 2048, D 128, GQA 8 / 2, four chosen 128-blocks per tile (a 16 x 16 block grid),
  causal, with sinks: values and gradients against the float64 oracle in interpret mode."""
  case = (1, 2048, 2048, 8, 2, 128, 128, 2, (128, 128), 4, "causal", dict(sinks=True))
  (q, k, v, sinks), mask, kwargs, _, rules = blocks_case(case, seed=5)
  cot = np.random.default_rng(6).standard_normal((*q.shape[:3], v.shape[-1])).astype(np.float32)
  harness.check_against_oracle(list_attention(sh.AttentionConfig(**TPU), mask, kwargs), q, k, v,
                               cot, sinks=sinks, **rules)


@pytest.mark.parametrize("name", sorted(LIST_CASES))
def test_forward_and_backward_lower_to_mosaic(name):
  (q, k, v, sinks), mask, kwargs, rules = list_case(name)
  config = sh.AttentionConfig(logits_soft_cap=rules["soft_cap"], allow_fallback=False)
  f = list_attention(config, mask, kwargs)
  args = (q, k, v) if sinks is None else (q, k, v, sinks)
  loss = lambda *a: jnp.sum(f(*a) ** 2)
  for fn, kernels in ((f, 1), (jax.grad(loss, argnums=tuple(range(len(args)))), 3)):
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert exported.mlir_module().count("tpu_custom_call") == kernels


def test_a_real_size_in_bfloat16_lowers_to_mosaic():
  """T = 8192, D 128, bf16, 8 of 64 key blocks per query tile (MoBA's top-k), GQA: a step."""
  b, t, hq, hkv, d = 1, 8192, 8, 2, 128
  q = jax.ShapeDtypeStruct((b, t, hq, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, hkv, d), jnp.bfloat16)

  def loss(q, k, v):
    choice = sh.sparse.top_k_blocks(q, k, top_k=7, block_size=(128, 128))
    out = sh.attention(q, k, v, mask=choice & sh.masks.Causal(),
                       config=sh.AttentionConfig(allow_fallback=False)).attention_outputs
    return jnp.sum(out.astype(jnp.float32) ** 2)

  exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                               platforms=["tpu"])(q, kv, kv)
  assert exported.mlir_module().count("tpu_custom_call") == 3


def test_a_misused_choice_gives_nan_rows_under_jit_and_the_others_match():
  (q, k, v, _), _, _, rules = list_case("gqa_shared_partial_blocks")
  lists, counts = random_choice(np.random.default_rng(4), 2, 2, 320, 320, (64, 128), 2)
  counts[1, 0, 2] = 3  # more than K: the misuse rule
  config = sh.AttentionConfig(**TPU)

  @jax.jit
  def f(q, k, v, lists, counts):  # the choice traced: its misuse is seen in the output
    mask = sh.masks.Blocks(lists, counts, (64, 128)) & sh.masks.Causal()
    return sh.attention(q, k, v, mask=mask, config=config).attention_outputs

  out = np.asarray(f(q, k, v, lists, counts))  # [B, T, Hq, Dv]
  bad = np.zeros(out.shape[:3], bool)
  bad[1, 128:192, 0:2] = True  # batch row 1, query tile 2, the group of list head 0
  assert np.isnan(out[bad]).all() and not np.isnan(out[~bad]).any()
  rules["mask"] = oracle.chosen_blocks(lists, np.minimum(counts, 2), (64, 128), 2, 4, 320, 320)
  want, _ = oracle.attention(q, k, v, **rules)
  np.testing.assert_allclose(out[~bad], np.asarray(want)[~bad], **harness.tol())


def test_garbage_in_unlisted_blocks_changes_nothing():
  """Only listed blocks are read: NaN keys and values in blocks no list names leave the output
  and the gradients as the oracle gives them with those blocks zeroed."""
  (q, k, v, _), mask, _, rules = list_case("window_beside_the_choice")
  listed = rules["mask"].any(axis=(0, 1, 2))  # [S]: keys some list names
  k, v = k.copy(), v.copy()
  k[:, ~listed], v[:, ~listed] = np.nan, np.nan
  assert (~listed).any()
  f = list_attention(sh.AttentionConfig(**TPU), mask, {})
  cot = np.ones((*q.shape[:3], v.shape[-1]), np.float32)
  out, grads = harness.values_and_grads(f, (q, k, v), cot)
  clean = lambda a: np.where(listed[None, :, None, None], a, 0)
  want, want_grads = harness.oracle_values_and_grads(q, clean(k), clean(v), cot, **rules)
  np.testing.assert_allclose(out, want, **harness.tol())
  harness.assert_near(grads[0], want_grads[0])
  for g, w in zip(grads[1:], want_grads[1:]):
    harness.assert_near(g[:, listed], w[:, listed])
    assert not np.asarray(g)[:, ~listed].any()  # no key of theirs is seen: exactly 0


@pytest.mark.parametrize("kwargs,needle", [
    (dict(block_size=(4, 128)), "bq a multiple of 8"),
    (dict(block_size=(128, 64)), "bk of 128"),
    (dict(block_size=(1024, 1024)), "MiB of VMEM"),
    (dict(q_positions=True), "explicit q_positions"),
    (dict(bias=True), "a `bias` was given"),
])
def test_what_it_cannot_serve_falls_back_to_xla_naming_it(kwargs, needle):
  rng = np.random.default_rng(0)
  size = kwargs.get("block_size", (128, 128))
  q, k, v = (rng.standard_normal((1, 2048, 2, 64)).astype(np.float32) for _ in range(3))
  lists, counts = random_choice(rng, 1, 2, 2048, 2048, size, 2)
  extras = {}
  if kwargs.get("q_positions"):
    extras["q_positions"] = np.arange(2048, dtype=np.int32)[None]
  if kwargs.get("bias"):
    extras["bias"] = sh.scores.Alibi(np.ones(2, np.float32))
  decision = sh.explain(q, k, v, mask=sh.masks.Blocks(lists, counts, size) & sh.masks.Causal(),
                        **extras, for_platform="tpu")
  assert decision.backend == "xla" and decision.fallback and needle in decision.reason


def test_the_pairs_name_every_chosen_block_and_tile_once_sorted_by_block():
  """Two query heads a kv head with lists of their own: each kv head's (key block, head, tile)
  triples sorted by block, then head, then tile; past the count the last one again."""
  lists = jnp.asarray([[[[2, 0], [1, 1], [0, 3]],  # head 0: tile 0 lists 2; tile 1 lists 1
                        [[3, 3], [2, 2], [0, 0]]]], jnp.int32)  # head 1: tiles 0, 1 list 3, 2
  counts = jnp.asarray([[[1, 1, 2], [1, 1, 0]]], jnp.int32)  # head 0's tile 2 lists 0 and 3
  blocks, rows, count = splash_lists.pairs(lists, counts, 4, groups=2, list_group=1)
  assert blocks.shape == rows.shape == (1, 1, 12) and int(count[0, 0]) == 6
  named = [(int(b), int(r) // 3, int(r) % 3) for b, r in zip(blocks[0, 0], rows[0, 0])]
  assert named[:6] == [(0, 0, 2), (1, 0, 1), (2, 0, 0), (2, 1, 1), (3, 0, 2), (3, 1, 0)]
  assert named[6:] == [named[5]] * 6  # no new copy past the count
  shared, _, shared_count = splash_lists.pairs(lists[:, :1], counts[:, :1], 4, groups=2,
                                               list_group=2)  # one list for both heads
  assert int(shared_count[0, 0]) == 8 and list(np.asarray(shared[0, 0, :8])) == [0, 0, 1, 1,
                                                                                  2, 2, 3, 3]


def test_the_dkv_kernel_computes_named_blocks_and_zeroes_the_others():
  """One kv head whose only pair is (key block 0, query tile 0), another with none: block 0's dK
  and dV are the float64 gradients of its softmax; every other block is 0, not left unwritten
  (NaN in interpret mode, anything on a chip: the garbage guard would rerun the backward)."""
  rng = np.random.default_rng(8)
  bq, bk, d = 8, 128, 32
  spec = tpu_lists.Spec(bq, bk, bq, 2 * bk, 1, 1, 1, 0.5, None, None, True)
  q, do = (rng.standard_normal((1, 2, bq, d)) for _ in range(2))  # [B, H, Tp, D]
  k, v = (rng.standard_normal((1, 2, 2 * bk, d)) for _ in range(2))  # [B, Hkv, Sp, D]
  s = 0.5 * q[0, 0] @ k[0, 0, :bk].T  # [bq, bk]: kv head 0's block 0
  p = np.exp(s - s.max(1, keepdims=True))
  lse = np.log(p.sum(1)) + s.max(1)
  p /= p.sum(1, keepdims=True)
  delta = np.sum(do[0, 0] * (p @ v[0, 0, :bk]), axis=1)
  ds = p * (do[0, 0] @ v[0, 0, :bk].T - delta[:, None])
  lanes = lambda a: np.broadcast_to(a[None, None, :, None], (1, 2, bq, 128)).astype(np.float32)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  pairs = jnp.zeros((1, 2, 2), jnp.int32)
  dk, dv = list_dkv.dkv(spec, pairs, pairs, jnp.asarray([[1, 0]], jnp.int32), f32(q), f32(k),
                        f32(v), jnp.zeros((1, bq, 128), jnp.int32),
                        jnp.zeros((1, 8, 2 * bk), jnp.int32), lanes(lse), lanes(delta), f32(do))
  np.testing.assert_allclose(np.asarray(dv)[0, 0, :bk], p.T @ do[0, 0], **harness.tol())
  np.testing.assert_allclose(np.asarray(dk)[0, 0, :bk], 0.5 * ds.T @ q[0, 0], **harness.tol())
  assert not np.asarray(dk)[0, 0, bk:].any() and not np.asarray(dv)[0, 1].any()


def test_a_paged_step_with_sinks_gqa_and_a_value_size_matches_the_oracle():
  """The paged kernel: a mixed step (decode, prefill, chunked prefill, padding rows) over
  shuffled pages with NaN in every free slot, kv-head sinks, soft cap, Dv != D, a window."""
  step = paged_cases.step(seed=2, value_dim=24)
  sinks = np.random.default_rng(3).normal(size=(paged_cases.HKV, 2)).astype(np.float32)
  config = sh.AttentionConfig(sliding_window=(6, 0), logits_soft_cap=3.0, **TPU)
  run = jax.jit(lambda *a, s: sh.paged_attention(*a, config=config, softmax_aux=s,
                                                 return_residuals=True))
  out, _, lse = run(step.q, step.k, step.v, step.cache, step.batch, s=sinks)
  groups = paged_cases.HQ // paged_cases.HKV
  want = paged_cases.attend(step, sinks=np.repeat(sinks, groups, 0), soft_cap=3.0,
                            window=(6, 0))
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
  rows = sum(step.q_lens)
  assert np.isfinite(np.asarray(lse)[:rows]).all() and (np.asarray(lse)[rows:] == -np.inf).all()


@pytest.mark.parametrize("page_size,dtype", [(16, jnp.bfloat16), (128, jnp.bfloat16),
                                             (64, jnp.int8)])
def test_paged_attention_exported_for_tpu_holds_the_paged_kernel(page_size, dtype):
  """Lowered for a TPU here (Mosaic): bf16 pools, and int8 ones read as codes. A step of 514
  rows also holds the dense kernel, for when nothing is cached (`fresh`); one of a chunk rule
  (which the dense kernel cannot read over packed rows) the paged kernel alone."""
  pool = sh.PagedKVCache.zeros(64, page_size, 2, 128, dtype=dtype)
  batch = sh.RaggedBatch(jnp.asarray([0, 512, 513, 514], jnp.int32), jnp.asarray([0, 900, 40]),
                         jnp.zeros((3, 16), jnp.int32), jnp.asarray(3, jnp.int32))
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  q = jax.ShapeDtypeStruct((514, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((514, 2, 128), jnp.bfloat16)
  args = (q, kv, kv, jax.tree.map(spec, pool), jax.tree.map(spec, batch))
  assert sh.explain_paged(*args, for_platform="tpu").backend == "splash"
  step = lambda *a: sh.paged_attention(*a, config=sh.AttentionConfig(allow_fallback=False))
  exported = jax.export.export(jax.jit(step), platforms=["tpu"])(*args)
  assert exported.mlir_module().count("tpu_custom_call") == 2
  both = jax.export.export(jax.jit(step), platforms=["cpu", "tpu"])(*args)
  assert both.mlir_module().count("tpu_custom_call") == 2
  chunks = lambda *a: sh.paged_attention(*a, config=sh.AttentionConfig(allow_fallback=False,
                                                                       chunk_size=256))
  alone = jax.export.export(jax.jit(chunks), platforms=["tpu"])(*args)
  assert alone.mlir_module().count("tpu_custom_call") == 1


@pytest.mark.parametrize("new_rows", [7, 9])
@pytest.mark.parametrize("platform", ["xla", "splash"])
def test_a_new_nan_value_shows_only_in_the_rows_that_see_it(platform, new_rows):
  """A prefill row's new value holds NaN: its own and later rows see it, the rows before it do
  not (`paged_cases.check_new_nan`)."""
  paged_cases.check_new_nan(sh.AttentionConfig(platform=platform, interpret=True,
                                               allow_fallback=False), new_rows)


def test_a_paged_step_reads_fewer_pages_where_its_vmem_would_pass_the_budget():
  """f32 prefill tiles of 128 rows for 8 query heads over pages of 64: the buffers' budget
  allows 8 pages a step (512 keys), the tiles beside them leave room for 5 (11.8 MiB of the
  kernel's 12; 6 would take 12.9); the call is still served."""
  facts = pages.PagedFacts(config=sh.AttentionConfig(), query_shape=(2048, 8, 128),
                           cache_shape=(64, 8, 64, 128), value_dim=128, max_seqs=1,
                           pages_per_seq=32)
  assert tpu_paged.pages_per_block(64, 32, 8, 128, 128, 4, 128) == 8
  n = splash_paged.pages_a_step(facts, 4)
  assert n == 5
  assert splash_paged.step_vmem_bytes(facts, n, 4) <= tpu_lists.VMEM_BUDGET
  assert splash_paged.step_vmem_bytes(facts, n + 1, 4) > tpu_lists.VMEM_BUDGET
  assert splash_paged.why_not(facts, "tpu") is None


def test_a_prompt_chunk_of_many_heads_gets_tiles_whose_step_fits_the_budget():
  """A chunk of 512 rows of 32 query heads over pages of 64: 128 rows a tile would need 27 MiB
  a step of one page (refused before); the tile is cut to the most rows (a multiple of 2: 4
  heads a kv head) at which a step of `FLOOR_KEYS` keys fits, and the call is served."""
  facts = pages.PagedFacts(config=sh.AttentionConfig(), query_shape=(1024, 32, 128),
                           cache_shape=(400, 8, 64, 128), value_dim=128, max_seqs=2,
                           pages_per_seq=64)
  bq = splash_paged.block_q(facts)
  fits = lambda rows: splash_paged._vmem_bytes(  # pylint: disable=protected-access
      facts, rows, splash_paged.FLOOR_KEYS, 4) <= tpu_lists.VMEM_BUDGET
  assert bq % 2 == 0 and bq < 128 and fits(bq) and not fits(bq + 2)
  assert splash_paged.why_not(facts, "tpu") is None


@pytest.mark.parametrize("chosen,window,in_order", [
    (False, paged_cases.RUNS_WINDOW, False), (True, paged_cases.RUNS_WINDOW, False),
    (False, None, False), (False, paged_cases.RUNS_WINDOW, True), (False, None, True)],
                         ids=["table", "selection", "table_causal", "in_order",
                              "in_order_causal"])
def test_runs_of_pages_a_step_match_the_oracle_at_real_lengths(chosen, window, in_order):
  """Pages of 32 (f32): the kernel reads 32 pages (1024 keys) a step; a history of 1100 tokens
  needs two steps with a partial last one (700: one partial), the rows a window across them,
  the free slots NaN. With a selection each kv head reads its own random pages (any order);
  causal with no window, the blocks every row sees whole run without the values' guard; pages
  handed out in order, a block of consecutive pages is one copy a buffer."""
  assert tpu_paged.pages_per_block(32, 40, paged_cases.HKV, paged_cases.D, paged_cases.D, 4,
                                   32) == 32
  step, batch, want = paged_cases.runs_of_pages(chosen, page=32, kv_lens=(700, 0, 1100, 37),
                                                window=window, in_order=in_order)
  config = sh.AttentionConfig(platform="splash", interpret=True, allow_fallback=False,
                              sliding_window=window)
  out, _ = jax.jit(lambda *a: sh.paged_attention(*a, config=config))(
      step.q, step.k, step.v, step.cache, batch)
  np.testing.assert_allclose(np.asarray(out)[:len(want)], want, **harness.tol())
