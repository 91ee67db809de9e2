"""The bfloat16 cases and their check, FlashAttention's bar: error against float64 (from the same
bf16 inputs) at most 2x that of a plain bf16 implementation, `jax.nn.dot_product_attention(
implementation="xla")`, for the forward and for dq, dk, dv. Run on xla, splash (interpret) and
under a mesh by test_bf16.py, compiled on a TPU by test_tpu.py.
"""

import jax
import jax.numpy as jnp
import numpy as np

import splash_hk as sh
import harness
import oracle

B, T, HQ, HKV, D = 2, 512, 8, 2, 64
WINDOW = (128, 0)


def _packed_documents():
  """Per-row documents and trailing padding (-1): [B, T]."""
  seg = np.full((B, T), -1, np.int32)
  for b, bounds in enumerate([(0, 100, 300, 480), (0, 256, 400, 500)]):
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[b, lo:hi] = i
  return seg


CASES = {  # name: (AttentionConfig fields, jax.nn keywords, our keywords, oracle keywords)
    "causal_gqa": ({}, dict(is_causal=True), {}, {}),
    "window": (dict(sliding_window=WINDOW), dict(is_causal=True, local_window_size=WINDOW), {},
               dict(window=WINDOW)),
    "packed_padding": ({}, "mask", "q_segment_ids", "q_seg"),
}


def _keywords(name):
  fields, nn, ours, rules = CASES[name]
  if nn != "mask":
    return fields, nn, ours, rules
  seg = _packed_documents()
  visible = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
  mask = visible & np.tril(np.ones((T, T), bool))
  return fields, dict(mask=mask[:, None]), {ours: seg}, {rules: seg}


def _out_and_grads(f, q, k, v, cot):
  out, grads = harness.values_and_grads(f, (q, k, v), cot)
  return (out, *grads)


def check_bf16(name, changes, mesh_name, shape=(B, T, HQ, HKV, D)):
  """Case `name` on the platform `changes` say (under a mesh), held to the bar (also compiled
  on a TPU: tests/test_tpu.py); `shape` (B, T, Hq, Hkv, D) for the cases without segments."""
  batch, length, hq, hkv, dim = shape
  assert CASES[name][1] != "mask" or (batch, length) == (B, T), "packed documents are B x T"
  fields, nn, ours, rules = _keywords(name)
  mesh = None if mesh_name is None else harness.mesh(mesh_name, explicit=True)
  config = sh.AttentionConfig(**fields, **changes)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(batch, length, h, dim)), jnp.bfloat16)
             for h in (hq, hkv, hkv))
  cot = rng.normal(size=(batch, length, hq, dim))
  if "q_seg" in rules:
    cot = np.where(rules["q_seg"][:, :, None, None] >= 0, cot, 0)  # jax.nn gives padding mean(v)
  ours_f = lambda q, k, v: sh.attention(q, k, v, config=config, mesh=mesh,
                                        **ours).attention_outputs
  theirs_f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **nn)
  got = _out_and_grads(ours_f, q, k, v, cot)
  plain = _out_and_grads(theirs_f, q, k, v, cot)
  f64 = lambda a: np.asarray(a, np.float64)
  want_out, want_grads = oracle.out_and_vjp(f64(q), f64(k), f64(v), cot, **rules)
  live = np.ones((batch, length), bool) if "q_seg" not in rules else rules["q_seg"] >= 0
  for what, g, p, w in zip(("out", "dq", "dk", "dv"), got, plain, (want_out, *want_grads)):
    assert g.dtype == jnp.bfloat16, what
    rows = live if what in ("out", "dq") else np.ones((batch, length), bool)
    ours_err = np.abs(f64(g) - w)[rows].max()
    plain_err = np.abs(f64(p) - w)[rows].max()
    assert ours_err <= 2 * plain_err, (what, ours_err, plain_err)
