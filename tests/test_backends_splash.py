"""The TPU splash path, run on CPU in interpret mode, against the float64 oracle.

Tolerances are JAX's own splash tests': f32 outputs 3e-3, gradients 2e-2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from splash_hk.masks import _rules
from splash_hk.backends.tpu import backend as splash_tpu
from splash_hk.backends.tpu import documents as splash_documents
from splash_hk.backends.tpu import plan as splash_plan
from splash_hk.backends.tpu import tiles as tiles_lib
import harness
from cases import Case, GRAD_CASES, SPLASH_CASES

SPLASH = dict(platform="splash", interpret=True, allow_fallback=False)

def _grads_vs_oracle(case, config, q, k, v, extras, mesh=None, axes=sh.MeshAxes()):
  sinks = extras.get("softmax_aux")
  rest = {n: a for n, a in extras.items() if n != "softmax_aux"}
  cot = np.random.default_rng(7).normal(size=(*q.shape[:3], v.shape[-1])).astype(np.float32)
  argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)

  def ours(q, k, v, s):
    out = sh.attention(q, k, v, config=config, softmax_aux=s, mesh=mesh, axes=axes,
                       **rest).attention_outputs
    return jnp.sum(out * cot)

  got = jax.jit(jax.grad(ours, argnums=argnums))(q, k, v, sinks)
  with jax.enable_x64(True):
    def theirs(q, k, v, s):
      ex = dict(rest, softmax_aux=s) if s is not None else rest
      return jnp.sum(case.oracle(q, k, v, ex, xp=jnp)[0] * cot)
    f64 = lambda a: None if a is None else jnp.asarray(a, jnp.float64)
    want = jax.grad(theirs, argnums=argnums)(f64(q), f64(k), f64(v), f64(sinks))
  for name, g, w in zip("qkvs", got, want):
    harness.assert_near(np.asarray(g), np.asarray(w), "grad", err_msg=name)


@pytest.mark.parametrize("case", SPLASH_CASES, ids=lambda c: c.name)
def test_splash_interpret_matches_oracle(case):
  config = case.config.replace(**SPLASH)
  q, k, v, extras = case.arrays(seed=3)
  assert sh.explain(q, k, v, config=config, **extras).backend == "splash"
  out = jax.jit(functools.partial(sh.attention, config=config))(q, k, v, **extras)
  expected, _ = case.oracle(q, k, v, extras)
  np.testing.assert_allclose(np.asarray(out.attention_outputs), expected, **harness.tol())
  if case.name in GRAD_CASES:
    _grads_vs_oracle(case, config, q, k, v, extras)


def test_splash_under_a_2x4_mesh():
  case = Case("mesh", batch=2, query_len=200, kv_len=200, num_heads=8, num_kv_heads=2,
              head_dim=32, window=(64, 0), sinks="heads_n", segments="packed")
  config = case.config.replace(**SPLASH)
  mesh = harness.mesh("2x4", explicit=True)
  q, k, v, extras = case.arrays(seed=4)
  assert sh.explain(q, k, v, config=config, mesh=mesh, **extras).backend == "splash"
  out = jax.jit(lambda q, k, v: sh.attention(q, k, v, config=config, mesh=mesh, **extras))(q, k, v)
  np.testing.assert_allclose(np.asarray(out.attention_outputs), case.oracle(q, k, v, extras)[0],
                             **harness.tol())
  _grads_vs_oracle(case, config, q, k, v, extras, mesh=mesh)


def test_fully_masked_rows_are_zero():
  # Queries of segment 1 have no key of segment 1: their rows see nothing.
  q, k, v = (np.random.default_rng(5).normal(size=(1, 128, 2, 32)).astype(np.float32)
             for _ in range(3))
  q_seg = np.zeros((1, 128), np.int32)
  q_seg[:, 64:] = 1
  out = sh.attention(q, k, v, config=sh.AttentionConfig(**SPLASH), q_segment_ids=q_seg,
                     kv_segment_ids=np.zeros((1, 128), np.int32)).attention_outputs
  assert np.all(np.asarray(out)[:, 64:] == 0) and np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(query_len=1), "decode"),
    (dict(query_len=64, kv_len=64), "shorter than one 128-row"),
    (dict(mask=True), "Dense part"),
    (dict(positions=True), "explicit q_positions"),
])
def test_splash_falls_back_with_a_reason(kwargs, needle):
  q_len = kwargs.get("query_len", 128)
  q = jax.ShapeDtypeStruct((1, q_len, 2, 32), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, kwargs.get("kv_len", 256), 2, 32), jnp.float32)
  extras = {}
  if kwargs.get("mask"):
    extras["mask"] = jax.ShapeDtypeStruct((1, 1, q_len, kv.shape[1]), jnp.bool_)
  if kwargs.get("positions"):
    extras["q_positions"] = jax.ShapeDtypeStruct((1, q_len), jnp.int32)
  d = sh.explain(q, kv, kv, config=sh.AttentionConfig(platform="splash", interpret=True), **extras)
  assert d.fallback and d.backend == "xla" and needle in d.reason
  with pytest.raises(ValueError, match=needle):
    sh.explain(q, kv, kv, config=sh.AttentionConfig(**SPLASH), **extras)


def test_splash_is_auto_on_tpu_and_needs_tpu_or_interpret():
  q = jax.ShapeDtypeStruct((1, 256, 2, 32), jnp.float32)
  d = sh.fallback.select_backend(sh.AttentionConfig(), query_shape=q.shape, key_shape=q.shape,
                                 hardware="tpu")
  assert d == sh.Decision("splash", d.reason) and not d.fallback
  d = sh.fallback.select_backend(sh.AttentionConfig(platform="splash"), query_shape=q.shape,
                                 key_shape=q.shape, hardware="cpu")
  assert d.fallback and "interpret=True" in d.reason
  d = sh.fallback.select_backend(
      sh.AttentionConfig(platform="splash", interpret=True, block_sizes=sh.BlockSizes(block_q=64)),
      query_shape=q.shape, key_shape=q.shape, hardware="cpu")
  assert d.fallback and "multiples of 128" in d.reason


SEQUENCE_AXES = sh.MeshAxes(batch="dp", heads="tp", sequence="sp")


@pytest.mark.parametrize("case,grads", [
    (Case("seq_window_sinks_segments", batch=2, query_len=256, kv_len=256, num_heads=4,
          num_kv_heads=2, head_dim=32, window=(100, 0), sinks="heads_n", segments="packed"), True),
    (Case("seq_prefill_chunk_padded", batch=2, query_len=400, kv_len=528, num_heads=4,
          num_kv_heads=1, head_dim=32, causal=False, chunk=96), False),
], ids=["window_sinks_segments_grads", "prefill_chunk_padded"])
def test_splash_with_a_sharded_query_sequence(case, grads):
  # Each query slice has its own static mask (row 0 of slice 1 sits at T/2 + S - T).
  config = case.config.replace(**SPLASH)
  mesh = harness.mesh("dp2_sp2_tp2", explicit=True)
  q, k, v, extras = case.arrays(seed=6)
  assert sh.explain(q, k, v, config=config, mesh=mesh, axes=SEQUENCE_AXES, **extras
                    ).backend == "splash"
  out = jax.jit(lambda q, k, v: sh.attention(q, k, v, config=config, mesh=mesh,
                                             axes=SEQUENCE_AXES, **extras))(q, k, v)
  np.testing.assert_allclose(np.asarray(out.attention_outputs), case.oracle(q, k, v, extras)[0],
                             **harness.tol())
  if grads:
    _grads_vs_oracle(case, config, q, k, v, extras, mesh=mesh, axes=SEQUENCE_AXES)


def test_splash_sequence_shards_shorter_than_a_block_fall_back():
  mesh = harness.mesh("dp2_sp2_tp2", explicit=True)
  q = jax.ShapeDtypeStruct((2, 200, 4, 32), jnp.float32)
  d = sh.explain(q, q, q, config=sh.AttentionConfig(platform="splash", interpret=True), mesh=mesh,
                 axes=SEQUENCE_AXES)
  assert d.backend == "xla" and "in 2 sequence shards" in d.reason


def test_kernels_are_built_once_per_static_shape():
  splash_tpu.build_kernel.cache_clear()
  config = sh.AttentionConfig(**SPLASH)
  q = np.ones((1, 128, 2, 32), np.float32)
  for i in range(3):
    jax.jit(lambda q: sh.attention(q, q, q, config=config).attention_outputs)(q + i)
  sh.attention(q, q, q, config=config)
  assert splash_tpu.build_kernel.cache_info().misses == 1


@pytest.mark.parametrize("t,s,block,expected", [
    (128, 128, 128, ((128, 128, 128, 128), 128, 128)),
    (200, 200, 128, ((128, 128, 128, 128), 256, 256)),
    (200, 1000, 512, ((256, 512, 256, 512), 256, 1024)),
    (1000, 1000, 512, ((512, 512, 512, 512), 1024, 1024)),
])
def test_padded_layout_clamps_blocks(t, s, block, expected):
  tiles = tiles_lib.Tiles(block, block, block, block, block, block, True)
  got, t_pad, s_pad = tiles_lib.padded_layout(t, s, tiles)
  assert (got.blocks, t_pad, s_pad) == expected
  assert got.block_kv % got.block_kv_compute == 0 and got.block_kv_bwd % got.block_kv_compute_bwd == 0


def _first_four(q, k):
  return (k < 4) | (q < 0)


def _from_128(q, k):
  return (k >= 128) | (q < 0)


M = sh.masks
PLAN_CASES = [  # (rule, padded (T, S), query offset, load-balanced (length, shards), blocks)
    (M.Causal(), (384, 640), 256, None, (128, 128)),
    (M.Causal() & M.SlidingWindow((200, 0)), (1024, 1024), 0, None, (128, 256)),
    (M.Chunked(300), (768, 768), 0, None, (128, 128)),
    (M.SlidingWindow((100, 0)) | M.MaskFn(_first_four), (1024, 1024), 0, None, (256, 128)),
    (M.Causal(), (1024, 1024), 0, (1024, 4), (128, 128)),
    (M.Causal(), (256, 1024), 512, (1024, 2), (128, 128)),
    # The first visible block is not block 0, and the grid ends in empty blocks (a wrap).
    (M.Causal() & M.MaskFn(_from_128), (256, 1024), 0, None, (128, 128)),
]


@pytest.mark.parametrize("rule,padded,offset,balanced,blocks", PLAN_CASES)
def test_mask_info_equals_jax_per_block_loop(rule, padded, offset, balanced, blocks):
  # JAX's own MaskInfo (its Python loop over every block pair, evaluating the mask) is the
  # oracle for ours (from the rule's per-block answers): every array, dtype and layout, for
  # the forward/dq and dK/dV grids, shrunk and not.
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_mask as splash_mask, splash_attention_mask_info as info_lib)
  from splash_hk.backends.tpu import plan as splash_plan  # pylint: disable=g-import-not-at-top
  head = splash_tpu.PositionMask(padded, offset, rule, balanced)
  place = (lambda i: i) if balanced is None else (
      lambda i: _rules.load_balanced_position(i, *balanced))
  values = splash_plan.block_mask(rule, place(np.arange(padded[0]) + offset),
                                  place(np.arange(padded[1])), blocks)
  for is_dkv in (False, True):
    for shrink in (True, False):
      want, _ = info_lib._process_mask(  # pylint: disable=protected-access
          splash_mask.MultiHeadMask([head] * 2), blocks, is_dkv, shrink_grid=shrink)
      got = splash_plan.mask_info(values, padded[0], is_dkv=is_dkv, shrink=shrink,
                                  computed=True)
      for name, w, g in zip(want._fields, want, got):
        assert (w is None) == (g is None), name
        if w is not None:
          assert np.asarray(w).dtype == g.dtype, (name, is_dkv, shrink)
          np.testing.assert_array_equal(np.asarray(w), g, err_msg=f"{name} {is_dkv} {shrink}")


def test_horizon_plan_equals_jax_per_block_loop():
  # Each example's traced plan for "query i sees keys [0, h_i]" (splash_horizon) against
  # JAX's loop over the same mask given densely: block values and fetched blocks, forward
  # and dK/dV (not shrunk: a traced plan keeps the whole grid).
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_mask as splash_mask, splash_attention_mask_info as info_lib)
  from splash_hk.backends.tpu import horizon as splash_horizon  # pylint: disable=g-import-not-at-top
  place = np.arange(384)
  h = np.stack([np.maximum(place, np.where(place < 150, 149, -1)),  # a prefix over a block edge
                np.where((place >= 100) & (place < 300), 299, place)])  # a span to the end
  blocks = (128, 256, 128, 128)
  fwd, _, dkv = splash_horizon.mask_infos(jnp.asarray(h, jnp.int32), (384, 512), blocks, True)
  for example in range(2):
    dense = np.arange(512)[None, :] <= h[example][:, None]  # [Tp, Sp]
    for got, shape, is_dkv in ((fwd, blocks[:2], False), (dkv, blocks[2:], True)):
      want, _ = info_lib._process_mask(  # pylint: disable=protected-access
          splash_mask.MultiHeadMask([splash_mask.NumpyMask(dense)]), shape, is_dkv,
          shrink_grid=False)
      for name in ("block_mask", "data_next"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name))[example],
                                      np.asarray(getattr(want, name)), err_msg=name)


def test_splash_backward_with_sinks_and_bfloat16_inputs():
  """JAX's splash kernel hands the sinks' cotangent back in bfloat16; float32 sinks still get
  their gradient (it failed to trace: lax.div of bfloat16 by float32)."""
  case = next(c for c in SPLASH_CASES if c.name == "sinks_kv_n_gqa")
  config = case.config.replace(**SPLASH)
  q, k, v, extras = case.arrays(seed=5)
  sinks = extras.pop("softmax_aux")
  cot = np.random.default_rng(6).normal(size=(*q.shape[:3], v.shape[-1])).astype(np.float32)
  bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)

  def loss(q, k, v, s):
    out = sh.attention(q, k, v, config=config, softmax_aux=s, **extras).attention_outputs
    return jnp.sum(out.astype(jnp.float32) * cot)

  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(bf16(q), bf16(k), bf16(v), sinks)
  round_trip = lambda a: np.asarray(bf16(a), np.float32)  # the oracle sees the bf16 inputs
  _, want = harness.oracle_values_and_grads(round_trip(q), round_trip(k), round_trip(v), cot,
                                            sinks=sinks, **harness.oracle_rules(case.config))
  assert got[3].dtype == jnp.float32
  for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
    harness.assert_near(np.asarray(g, np.float32), w, "grad", jnp.bfloat16, err_msg=name)


def test_the_bf16_backward_with_sinks_lowers_to_mosaic_for_tpu():
  """The splash call with bf16 q/k/v and sinks, forward and backward, exported for TPU from this
  host: Mosaic accepts it (its kernels are `tpu_custom_call`s), as interpret mode checks its
  numbers (`test_splash_backward_with_sinks_and_bfloat16_inputs`)."""
  from splash_hk import inputs, kernel  # pylint: disable=g-import-not-at-top
  from splash_hk.types import Extras  # pylint: disable=g-import-not-at-top
  config = sh.AttentionConfig(platform="splash")

  def loss(q, k, v, sinks):
    x, facts = inputs.normalise(q, k, v, config=config, extras=Extras(softmax_aux=sinks))
    return jnp.sum(kernel.run("splash", x, facts).out.astype(jnp.float32) ** 2)

  shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in
            ((1, 512, 4, 128), (1, 512, 2, 128), (1, 512, 2, 128))]
  shapes.append(jax.ShapeDtypeStruct((4,), jnp.float32))
  exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))),
                               platforms=["tpu"])(*shapes)
  assert exported.platforms == ("tpu",)
  assert exported.mlir_module().count("tpu_custom_call") >= 2  # the forward and the backward


def _kernel_dots(jaxpr, inside=False, found=None):
  """(operand dtypes, precision) of every product inside a Pallas kernel of `jaxpr`."""
  found = [] if found is None else found
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general" and inside:
      found.append((tuple(str(v.aval.dtype) for v in eqn.invars), eqn.params["precision"]))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jax.extend.core.Jaxpr):
          _kernel_dots(sub, inside or eqn.primitive.name == "pallas_call", found)
  return found


@pytest.mark.parametrize("mask", [None, "blocks"], ids=["dense", "block_list"])
def test_bf16_kernels_are_traced_at_the_default_precision_under_a_callers_highest(mask):
  """Mosaic refuses a bf16 product asked for at fp32 ("Bad lhs type", seen on the v5e when a
  test ran bf16 calls under "highest"): the kernels, backward too, take the default for bf16
  (exact in their f32 accumulators anyway) and the caller's precision for f32."""
  chosen = None if mask is None else sh.masks.Blocks(np.zeros((1, 1, 2, 1), np.int32),
                                                     np.ones((1, 1, 2), np.int32), (128, 128))
  for dtype, want in ((jnp.bfloat16, jax.lax.Precision.DEFAULT),
                      (jnp.float32, jax.lax.Precision.HIGHEST)):
    q = jnp.ones((1, 256, 2, 128), dtype)
    loss = lambda q: jnp.sum(sh.attention(q, q, q, config=sh.AttentionConfig(**SPLASH),
                                          mask=chosen).attention_outputs.astype(jnp.float32))
    with jax.default_matmul_precision("highest"):
      dots = _kernel_dots(jax.make_jaxpr(jax.grad(loss))(q).jaxpr)
    narrow = {precision for dtypes, precision in dots if "bfloat16" in dtypes}
    assert dots and narrow <= {(jax.lax.Precision.DEFAULT,) * 2}, (dtype, narrow)
    if dtype == jnp.float32:
      assert any(p == (want, want) for _, p in dots), dots


def _documents(batch: int, length: int, cuts: list[list[int]]) -> np.ndarray:
  """[B, T] segment ids: example b's documents start at cuts[b] (ids 0, 1, ...); -1 after the
  last cut given as a negative number (padding)."""
  ids = np.zeros((batch, length), np.int32)
  for row, starts in enumerate(cuts):
    for n, start in enumerate(starts):
      ids[row, abs(start):] = -1 if start < 0 else n + 1
  return ids


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "apart"])
@pytest.mark.parametrize("window", [None, 96], ids=["causal", "window"])
def test_packed_documents_skip_the_blocks_between_them_and_match_the_oracle(fused, window):
  # Tiles of 128 over 640 padded rows: documents of ~128-300 tokens leave most pairs apart.
  case = Case("docs", batch=2, query_len=600, kv_len=600, num_heads=4, num_kv_heads=2,
              head_dim=32, window=None if window is None else (window, 0), sinks="heads")
  q, k, v, extras = case.arrays(seed=21)
  extras["q_segment_ids"] = _documents(2, 600, [[130, 260, 520], [300, 301, -590]])
  tiles = sh.BlockSizes(block_q=128, block_kv=128)
  config = case.config.replace(**SPLASH, block_sizes=tiles, fused_backward=fused)
  out = jax.jit(functools.partial(sh.attention, config=config))(q, k, v, **extras)
  np.testing.assert_allclose(np.asarray(out.attention_outputs), case.oracle(q, k, v, extras)[0],
                             **harness.tol())
  _grads_vs_oracle(case, config, q, k, v, extras)


def test_interleaved_ids_keep_every_block_and_match_the_oracle():
  # Two documents taking turns token by token: every block holds both, none may be skipped.
  case = Case("interleaved", batch=1, query_len=256, kv_len=256, num_heads=2, num_kv_heads=2,
              head_dim=32)
  q, k, v, extras = case.arrays(seed=22)
  extras["q_segment_ids"] = (np.arange(256, dtype=np.int32) % 2)[None]
  config = case.config.replace(**SPLASH, block_sizes=sh.BlockSizes(block_q=128, block_kv=128))
  out = jax.jit(functools.partial(sh.attention, config=config))(q, k, v, **extras)
  np.testing.assert_allclose(np.asarray(out.attention_outputs), case.oracle(q, k, v, extras)[0],
                             **harness.tol())


def test_segment_blocks_are_apart_exactly_where_the_id_ranges_are():
  q_ids = jnp.asarray(_documents(1, 512, [[128, 300, -384]]))  # 0 | 1 | 2 | padding
  keep = np.asarray(splash_documents.segment_blocks(q_ids, q_ids, (128, 128)))[0]  # [4, 4]
  # Blocks: [0], [1], [1, 2], [padding]: block 2 meets blocks 1 and 2, padding meets nothing.
  np.testing.assert_array_equal(keep, [[1, 0, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("is_dkv", [False, True], ids=["forward", "dkv"])
@pytest.mark.parametrize("shrink", [False, True], ids=["full_grid", "shrunk"])
def test_a_restricted_plan_runs_exactly_the_kept_pairs_and_fetches_the_next_one(is_dkv, shrink):
  rule = sh.masks.SlidingWindow((300, 0)) if shrink else sh.masks.Causal()
  positions = np.arange(1024)
  values = splash_plan.block_mask(rule, positions, positions, (128, 128))  # [8, 8]
  static = splash_plan.mask_info(values, 1024, is_dkv=is_dkv, shrink=shrink, computed=True)
  keep = np.random.default_rng(23).random((3, 8, 8)) < 0.4  # [B, nq, nk]
  got = splash_documents.restricted(static, jnp.asarray(keep), is_dkv)
  for b in range(3):  # each example's plan, walked step by step in grid order
    block_mask, data_next = (np.asarray(a)[b, 0] for a in (got.block_mask, got.data_next))
    fetched, old = np.asarray(static.data_next)[0], np.asarray(static.block_mask)[0]
    grid = [(i, j) for j in range(old.shape[1]) for i in range(old.shape[0])] if is_dkv else \
           [(i, j) for i in range(old.shape[0]) for j in range(old.shape[1])]
    pair = lambda i, j: (fetched[i, j], j) if is_dkv else (i, fetched[i, j])
    runs = [s for s in grid if old[s] and keep[(b, *pair(*s))]]
    assert sorted(s for s in grid if block_mask[s]) == sorted(runs)
    for s in runs:
      assert block_mask[s] == old[s] and data_next[s] == fetched[s]
    for n, s in enumerate(grid):  # a skipped step fetches the next running step's block
      later = [t for t in grid[n:] + grid[:n] if t in runs]
      if later and not block_mask[s]:
        assert data_next[s] == fetched[later[0]]


def test_a_packed_call_runs_only_the_block_pairs_its_documents_share(monkeypatch):
  seen = []

  def recorded(kernel, seg, tiles):
    kernel = documents_apart(kernel, seg, tiles)
    jax.debug.callback(lambda b: seen.append(np.asarray(b)), kernel.fwd_mask_info.block_mask)
    return kernel

  documents_apart = splash_documents.apart
  monkeypatch.setattr(splash_documents, "apart", recorded)
  case = Case("docs", batch=1, query_len=512, kv_len=512, num_heads=2, num_kv_heads=2,
              head_dim=32)
  q, k, v, extras = case.arrays(seed=24)
  extras["q_segment_ids"] = _documents(1, 512, [[128, 256, 384]])  # four documents of 128
  config = case.config.replace(**SPLASH, block_sizes=sh.BlockSizes(block_q=128, block_kv=128))
  out = jax.jit(functools.partial(sh.attention, config=config))(q, k, v, **extras)
  np.testing.assert_allclose(np.asarray(out.attention_outputs), case.oracle(q, k, v, extras)[0],
                             **harness.tol())
  (block_mask,) = seen  # [B, 1, nq, nk]: the diagonal alone (causal would run 10 of 16)
  np.testing.assert_array_equal(block_mask[0, 0] != 0, np.eye(4, dtype=bool))
