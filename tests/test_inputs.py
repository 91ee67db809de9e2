"""splash_hk.inputs: the one normal form (KernelInputs + Facts) behind attention and explain."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
import harness
from splash_hk import inputs
from splash_hk.types import Extras


def _normalise(q_shape=(2, 3, 4, 8), kv_shape=(2, 5, 2, 8), extras=Extras(), **kwargs):
  q, k = np.ones(q_shape, np.float32), np.ones(kv_shape, np.float32)
  config = kwargs.pop("config", sh.AttentionConfig())
  return inputs.normalise(q, k, k, config=config, extras=extras, **kwargs)


def test_defaults_are_end_aligned_and_layout_stays_bthd():
  x, facts = _normalise()
  np.testing.assert_array_equal(x.q_positions, [[2, 3, 4]] * 2)
  np.testing.assert_array_equal(x.kv_positions, [[0, 1, 2, 3, 4]] * 2)
  assert x.query.shape == (2, 3, 4, 8) and x.key.shape == (2, 5, 2, 8)
  assert x.q_segment_ids is None and x.kv_segment_ids is None and x.sinks is None
  assert facts.mode is sh.Mode.PREFILL and facts.default_positions and facts.scale == 8 ** -0.5
  assert (facts.query_len, facts.kv_len, facts.num_heads, facts.num_kv_heads) == (3, 5, 4, 2)


def test_explicit_positions_and_segments_become_int32():
  seg = np.array([[0, 0, 1], [1, 1, -1]], np.int64)
  x, facts = _normalise((2, 3, 4, 8), (2, 3, 2, 8), Extras(
      kv_segment_ids=seg, q_positions=np.arange(6).reshape(2, 3).astype(np.int16)))
  assert x.q_segment_ids.dtype == x.kv_segment_ids.dtype == x.q_positions.dtype == jnp.int32
  np.testing.assert_array_equal(x.q_segment_ids, seg)  # one side defaults to the other (T == S)
  assert not facts.default_positions and facts.mode is sh.Mode.TRAIN


@pytest.mark.parametrize("aux_shape", [(4,), (4, 3), (2, 3)])
def test_sinks_become_one_row_per_query_head(aux_shape):
  aux = np.arange(np.prod(aux_shape), dtype=np.float32).reshape(aux_shape)
  x, _ = _normalise(extras=Extras(softmax_aux=aux))
  want = aux[:, None] if aux.ndim == 1 else np.repeat(aux, 4 // aux.shape[0], axis=0)
  assert x.sinks.dtype == jnp.float32
  np.testing.assert_array_equal(x.sinks, want)


def test_runtime_dtype_casts_and_config_scale():
  config = sh.AttentionConfig(runtime_dtype=jnp.bfloat16, softmax_scale=0.5)
  x, facts = _normalise(config=config)
  assert x.query.dtype == x.key.dtype == x.value.dtype == jnp.bfloat16 and facts.scale == 0.5


def test_facts_read_only_shapes_and_count_sequence_shards():
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  mesh = harness.mesh("dp2_sp2_tp2", explicit=True)
  axes = sh.MeshAxes(batch="dp", heads="tp", sequence="sp")
  facts = inputs.facts(spec(2, 16, 4, 8), spec(2, 16, 2, 8), spec(2, 16, 2, 8),
                       config=sh.AttentionConfig(), extras=Extras(), mesh=mesh, axes=axes)
  assert facts.sequence_shards == 2 and facts.mode is sh.Mode.TRAIN
  decode = inputs.facts(spec(2, 1, 4, 8), spec(2, 16, 2, 8), spec(2, 16, 2, 8),
                        config=sh.AttentionConfig(), extras=Extras(), mesh=mesh, axes=axes)
  assert decode.sequence_shards == 1 and decode.mode is sh.Mode.DECODE
  assert hash(facts) != hash(decode)  # static: usable as a cache key


def test_equal_windows_make_equal_configs():
  assert sh.AttentionConfig(sliding_window=2) == sh.AttentionConfig(sliding_window=(2, 2))
  assert hash(sh.AttentionConfig(sliding_window=2)) == hash(sh.AttentionConfig(sliding_window=[2, 2]))


@pytest.mark.parametrize("name", ["query", "key", "value", "q_segment_ids", "softmax_aux"])
def test_non_arrays_are_named(name):
  q = np.ones((1, 4, 2, 8), np.float32)
  args = dict(query=q, key=q, value=q)
  extras = {}
  bad = [[0.0] * 8] * 4
  if name in args:
    args[name] = bad
  else:
    extras[name] = bad
  with pytest.raises(ValueError, match=f"`{name}` must be an array"):
    sh.attention(args["query"], args["key"], args["value"], **extras)
