"""The TPU kernel for a few query rows over a long fixed cache: a decode, or a short run (a
verification of drafts), of `sh.attention` with keys [B, S, Hkv, D] as the caller holds them.

One program a batch item; a grid step reads a block of `bk` keys of every kv head, [bk, Hkv, D]
(whole tiles of the cache's own layout: the cache is not transposed, which would cost more
than the call), joins them as C = bk * Hkv columns (key, kv head) and meets every query row of
every head at once: R = T * Hq rows (row, query head) against the C columns, a row's pairs with
another kv head's columns masked. A decode is bound by the cache's read, and the Hkv-fold
products fit under it: on the v5e (32 caches of 8192 keys, Hq 32, Hkv 8, D 128, bf16) the
kernel read 0.97-0.98 of the read bandwidth at T = 1 and 4, where jax.nn's xla read 0.97 and
0.58 (docs/guide/performance.md).

Which keys a row sees (its segment, positions and rule) is computed by XLA once a call
(`base.full_mask`, [B, T, S]) and read beside the keys, 2 bytes a (row, key): T / (2 D Hkv) of
the keys' and values' bytes. Blocks no row sees are not read; a block every row sees whole
folds its values unguarded, others zero a non-finite value no row sees (`softmax.poison`).

Glossary: B batch, T query rows (at most `ROWS`), S keys, Hq / Hkv heads, G = Hq / Hkv,
R = T * Hq, bk keys a block, C = bk * Hkv, nk = ceil(S / bk) blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from splash_hk.backends import base
from splash_hk.backends.tpu import list_kernel as tpu_lists
from splash_hk.backends.tpu import softmax
from splash_hk.backends.xla import backend as xla
from splash_hk.masks import _objects
from splash_hk.types import Facts, KernelInputs, KernelOutput

ROWS = 8  # query rows a call (a decode's 1, a verification's few); more run on the dense kernel
LANES, SUBLANES = tpu_lists.LANES, tpu_lists.SUBLANES  # a block's kv heads: whole sublane tiles
LOGITS_BYTES = 2 * 2 ** 20  # a block's logits [R, C] float32 at most
BUFFER_BYTES = 8 * 2 ** 20  # a block's keys and values, double-buffered, at most
MOST_KEYS = 1024  # a block's keys at most (T = 1 and 4 read the same at 512 and 1024)
VMEM_LIMIT = 32 * 2 ** 20


def serves_rows(facts: Facts) -> bool:
  """Whether the call is a few rows over a longer cache: this kernel's, not the dense one's."""
  return facts.query_len <= ROWS < facts.kv_len


def why_not(facts: Facts) -> str | None:
  """Why the decode kernel cannot serve a call of a few rows, or None."""
  kv_heads = facts.key_shape[2]
  if facts.sequence_shards > 1:
    return "the query sequence is sharded (the decode kernel reads whole rows of keys)"
  if facts.bias is not None:
    return "a `bias` was given, and the TPU decode kernel takes none"
  if facts.rule is not None and _objects.as_rules(facts.rule) is None:
    return ("the mask is not the config's rules (causal, window, chunk): the TPU decode "
            "kernel serves those, with segments and positions")
  if kv_heads % SUBLANES:  # 2 kv heads compiled, and read 0.27 of the bandwidth (xla: 0.30)
    return (f"{kv_heads} kv heads: the TPU decode kernel joins a block's kv heads as whole "
            f"tiles of {SUBLANES} rows (a multiple of {SUBLANES} kv heads)")
  dims = (facts.key_shape[3], facts.value_dim)
  if any(d % LANES for d in dims):
    return (f"head dims {dims[0]} / {dims[1]}: the TPU decode kernel reads the cache's tiles "
            f"as they lie for dims that are multiples of {LANES} (others would be copied first)")
  return None


@dataclasses.dataclass(frozen=True)
class Spec:
  """A call's static shape and numbers (hashable: the kernel is built once per spec)."""

  rows: int  # T
  heads: int  # Hq
  kv_heads: int  # Hkv
  block_keys: int  # bk
  blocks: int  # nk
  scale: float
  soft_cap: float | None

  @property
  def columns(self) -> int:  # C
    return self.block_keys * self.kv_heads


def block_keys(rows: int, heads: int, kv_heads: int, dims: int, itemsize: int,
               keys: int) -> int:
  """bk: the most keys a block (a power of two, 128 to `MOST_KEYS`) whose logits and buffers
  fit their budgets, at most the cache's keys rounded up to 128."""
  bk = MOST_KEYS
  while bk > LANES and (rows * heads * bk * kv_heads * 4 > LOGITS_BYTES
                        or 2 * bk * kv_heads * dims * itemsize > BUFFER_BYTES):
    bk //= 2
  return min(bk, -(-keys // LANES) * LANES)


def _block_keys(facts: Facts, itemsize: int) -> int:
  """`block_keys` of a call whose keys and values take `itemsize` bytes an entry."""
  return block_keys(facts.query_len, facts.query_shape[2], facts.key_shape[2],
                    facts.key_shape[3] + facts.value_dim, itemsize, facts.kv_len)


def describe(facts: Facts) -> str:
  """The decode kernel's blocks for a call (`explain`), at the call's dtype."""
  bk = _block_keys(facts, jnp.dtype(facts.dtype or jnp.float32).itemsize)
  return (f"the TPU decode kernel: {facts.query_len} row(s) of every head against blocks of "
          f"{bk} keys of every kv head")


def _seen(spec: Spec, vis_ref, expand_ref) -> jax.Array:
  """[R, C] bool: row r (row t, query head n) sees column c (key c // Hkv, kv head c % Hkv)
  where its row of the block's visibility [T, bk] does and the column is its kv head's. The
  visibility's keys become columns by products with `expand_ref` [128, 128 * Hkv] (1 where a
  column is the key's): 0 and 1 exactly, on the MXU, which repeats lanes where the VPU cannot."""
  t, c, lanes = spec.rows, spec.columns, expand_ref.shape[0]
  vis = vis_ref[...]  # [T, bk] 0 or 1
  # bf16 0s and 1s: exact at the default precision, which a call under "highest" would not
  # give a bf16 product (Mosaic refuses it: "Bad lhs type")
  dot = lambda a: jax.lax.dot_general(a, expand_ref[...], (((1,), (0,)), ((), ())),
                                      precision=jax.lax.Precision.DEFAULT,
                                      preferred_element_type=jnp.float32)
  parts = [dot(vis[:, i:i + lanes]) for i in range(0, spec.block_keys, lanes)]  # [T, 128 Hkv]
  cols = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)  # [T, C]
  rows = jnp.broadcast_to(cols[:, None, :], (t, spec.heads, c)).reshape(t * spec.heads, c)
  shape = (t * spec.heads, c)
  # lax's rem and div (not jnp's % and //, whose sign Mosaic lowers only knowing the chip)
  head = jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, shape, 0), spec.heads)  # query head
  col = jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, shape, 1), spec.kv_heads)  # kv head
  return (rows > 0.5) & (jax.lax.div(head, spec.heads // spec.kv_heads) == col)


def _expand(kv_heads: int, dtype) -> jax.Array:
  """[128, 128 * Hkv]: 1 where column c is key c // Hkv's (`_seen`), else 0."""
  col = jnp.arange(LANES * kv_heads, dtype=jnp.int32)
  return (col[None, :] // kv_heads == jnp.arange(LANES, dtype=jnp.int32)[:, None]).astype(dtype)


def _kernel(spec: Spec, first_ref, last_ref, whole_ref, q_ref, sink_ref, vis_ref, expand_ref,
            k_ref, v_ref, o_ref, m_scr, l_scr, acc_scr, lse_scr):
  b, j = pl.program_id(0), pl.program_id(1)
  block = first_ref[b] + j

  @pl.when(j == 0)
  def _():
    softmax.init_state(m_scr, l_scr, acc_scr)

  @pl.when(block <= last_ref[b])
  def _():
    k = k_ref[...].reshape(spec.columns, k_ref.shape[-1])  # [C, D]
    v = v_ref[...].reshape(spec.columns, v_ref.shape[-1])  # [C, Dv]
    seen = _seen(spec, vis_ref, expand_ref)  # [R, C]
    s, _ = softmax.scores(q_ref[...], k, spec.scale, spec.soft_cap)  # [R, C]
    s = jnp.where(seen, s, -jnp.inf)

    @pl.when(whole_ref[b * spec.blocks + block] != 0)
    def _():
      softmax.online_step(None, s, v, m_scr, l_scr, acc_scr)

    @pl.when(whole_ref[b * spec.blocks + block] == 0)
    def _():
      finite = jnp.isfinite(v.astype(jnp.float32))  # [C, Dv] (Mosaic tests f32 only)
      softmax.online_step(None, s, jnp.where(finite, v, 0).astype(v.dtype), m_scr, l_scr,
                          acc_scr)
      acc_scr[0] = acc_scr[0] + softmax.poison(seen, finite)

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    softmax.finish(0, sink_ref[...], m_scr, l_scr, acc_scr, o_ref, lse_scr)


def _plan(vis: jax.Array, spec: Spec, keys: int) -> tuple[jax.Array, ...]:
  """From the call's visibility [B, T, S]: each item's first and last block some row sees [B]
  (last < first: none), whether each block is whole [B * nk] (every row sees every key, all
  inside the cache), and the visibility as the kernel reads it [B, T, nk * bk] bfloat16."""
  batch, rows, _ = vis.shape
  padded = spec.blocks * spec.block_keys
  vis = jnp.pad(vis, ((0, 0), (0, 0), (0, padded - keys)))  # [B, T, nk * bk]
  blocks = vis.reshape(batch, rows, spec.blocks, spec.block_keys)  # [B, T, nk, bk]
  seen = blocks.any(axis=(1, 3))  # [B, nk]
  index = jnp.arange(spec.blocks, dtype=jnp.int32)
  first = jnp.min(jnp.where(seen, index, spec.blocks), axis=1).astype(jnp.int32)  # [B]
  last = jnp.max(jnp.where(seen, index, -1), axis=1).astype(jnp.int32)  # [B]
  first = jnp.minimum(first, jnp.maximum(last, 0))
  whole = blocks.all(axis=(1, 3)).reshape(-1).astype(jnp.int32)  # [B * nk]
  return first, last, whole, vis.astype(jnp.bfloat16)


def _call(spec: Spec, plan: tuple[jax.Array, ...], q: jax.Array, sinks: jax.Array,
          k: jax.Array, v: jax.Array, interpret: bool) -> jax.Array:
  """The kernel: q [B, R, D], sinks [R, 1], k [B, S, Hkv, D], v [B, S, Hkv, Dv] -> [B, R, Dv]."""
  batch, r, d = q.shape
  dv, bk, hkv = v.shape[-1], spec.block_keys, spec.kv_heads
  at = lambda b, j, first, last, whole: jnp.minimum(first[b] + j, jnp.maximum(last[b], 0))
  kv = lambda b, j, *refs: (b, at(b, j, *refs), 0, 0)
  grid = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(batch, spec.blocks),
      in_specs=[pl.BlockSpec((None, r, d), lambda b, j, *_: (b, 0, 0)),
                pl.BlockSpec((r, 1), lambda b, j, *_: (0, 0)),
                pl.BlockSpec((None, spec.rows, bk), lambda b, j, *refs: (b, 0, at(b, j, *refs))),
                pl.BlockSpec((LANES, LANES * hkv), lambda b, j, *_: (0, 0)),
                pl.BlockSpec((None, bk, hkv, d), kv), pl.BlockSpec((None, bk, hkv, dv), kv)],
      out_specs=pl.BlockSpec((None, 1, r, dv), lambda b, j, *_: (b, 0, 0, 0)),
      scratch_shapes=[pltpu.VMEM((1, r, LANES), jnp.float32),  # max, sum, acc, lse
                      pltpu.VMEM((1, r, LANES), jnp.float32), pltpu.VMEM((1, r, dv), jnp.float32),
                      pltpu.VMEM((1, r, LANES), jnp.float32)])
  out = pl.pallas_call(
      functools.partial(_kernel, spec), grid_spec=grid,
      out_shape=jax.ShapeDtypeStruct((batch, 1, r, dv), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=VMEM_LIMIT),
      interpret=interpret)(*plan[:3], q, sinks, plan[3], _expand(hkv, jnp.bfloat16), k, v)
  return out[:, 0]  # [B, R, Dv]


def _forward(x: KernelInputs, facts: Facts) -> jax.Array:
  """out [B, T, Hq, Dv] of a short run over the cache."""
  batch, rows, heads, d = x.query.shape
  keys, kv_heads = x.key.shape[1], x.key.shape[2]
  bk = _block_keys(facts, x.key.dtype.itemsize)
  spec = Spec(rows, heads, kv_heads, bk, -(-keys // bk), facts.scale,
              facts.config.logits_soft_cap)
  vis = base.full_mask(x)[:, 0]  # [B, T, S]
  sinks = (jnp.full((heads,), -jnp.inf, jnp.float32) if x.sinks is None
           else base.sink_logsumexp(x.sinks.astype(jnp.float32)))  # [Hq]
  sinks = jnp.tile(sinks, rows)[:, None]  # [R, 1]: row t's heads in order
  q = x.query.reshape(batch, rows * heads, d)  # [B, R, D]
  with base.kernel_precision(q.dtype):
    out = _call(spec, _plan(vis, spec, keys), q, sinks, x.key, x.value,
                facts.config.interpret)  # [B, R, Dv]
  return out.reshape(batch, rows, heads, -1)


def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
  """A short run over a cache on one shard: out [B, T, Hq, Dv]; when differentiated, xla's
  forward and backward instead (the kernel has no backward)."""
  return KernelOutput(*xla.with_xla_gradients(lambda y: (_forward(y, facts),), facts,
                                              fields=1)(x))
