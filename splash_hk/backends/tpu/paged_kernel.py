"""The block-list kernel over a paged pool (Pallas TPU): a paged step's rows against their pages.

A step's lists of pages (`splash_hk.lists`: each sequence's page-table row, or the pages a
selection chose for each kv head) are read a run of `pages_per_block` entries a loop step (a
block of about 512 keys, whatever the page size): the kernel copies the run's pages from the
pool in HBM into a VMEM block itself, each page's slab [Hb, page, D] whole where it lands (one
contiguous copy a page, only the entries the list holds; a kv head's E keys are its n page tiles
in order: measured 13% faster than copies cut per kv head at pages of 64), and starts the next
block's copies before it waits for the current ones (two buffers, two blocks in flight: a
step's wait and compute hide the next step's reads). The grid is (tile, list head), in order;
a program loops over its list's blocks (as many as the list holds: no grid step for a block
past a short list), and its last block starts the first copies of the next (tile, list head)
with work: the lists sit in scalar prefetch with, for each, the next one that has work.

A program is one tile of `block_q` rows of one sequence for every query head of the block's kv
heads, a kv head's G query heads stacked as G * bq rows of one product. A page-table row serves
every kv head, so a block holds all of them (the pool's layout, head-major [P, Hkv, page, D]:
one copy a page); a selection's lists differ per kv head, so the grid has a step per kv head and
its block holds that head's keys only. Online softmax in VMEM scratch per kv head; keys past the
sequence's length or past the list are invisible and their non-finite values zeroed (free slots
may hold anything); a visible non-finite value shows as NaN in its column of the rows that see
it. The new tokens are written into the pool before this kernel runs. An int8 pool's codes are
copied as bytes and turned into the query's dtype in VMEM; their per-key scales are copied as
one block beside them (`paged.block_scales`), the key scale on the logits' columns, the value
scale on the probabilities'.

Glossary: W tiles (static bound), Hq query heads, Hkv kv heads (G = Hq // Hkv), Hl list heads
(1: a page table; Hkv: a selection), Hb = Hkv // Hl kv heads a block, R = G * bq rows a kv head,
page keys per page, n pages a block (E = n * page keys), K entries a list, NB = ceil(K / n)
blocks a list, D key size, Dv value size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from splash_hk.backends import base
from splash_hk.backends.tpu import list_kernel as tpu_lists
from splash_hk.backends.tpu import softmax
from splash_hk.backends.tpu import paged_copies
from splash_hk.backends.tpu import plan as splash_plan
from splash_hk.masks import _objects
from splash_hk.masks._mask import Mask

LANES, SUBLANES = tpu_lists.LANES, tpu_lists.SUBLANES
# Keys a loop step reads (a run of pages): on a v5e 1024 read 0.845 of the bandwidth at pages
# of 64 and 0.766 at 16 where 512 read 0.818 and 0.694 (a step's issue is the cost it hides).
BLOCK_KEYS = 1024
BUFFER_BUDGET = 8 * 2 ** 20  # VMEM for the two key and value blocks
SCORES_BUDGET = 2 * 2 ** 20  # VMEM for a kv head's logits and probabilities (f32 [R, E] each)
NO_STEP = 2 ** 30  # a key position no length reaches (an entry past its list)
CAUSAL_ONLY = dict(causal=True, window=None, chunk_size=None)  # `_objects.as_rules` of Causal()


@dataclasses.dataclass(frozen=True)
class Spec:
  """What the paged kernel knows statically (hashable)."""

  block_q: int  # bq (G * bq a multiple of 8)
  page_size: int
  num_pages: int  # P
  num_kv_heads: int  # Hkv
  groups: int  # G
  list_heads: int  # Hl: 1 (a page table, every kv head) or Hkv (a list per kv head)
  entries: int  # K
  scale: float
  soft_cap: float | None
  rule: Mask | None  # a position rule (its `visible`), or None: every key of the sequence
  interpret: bool
  pages_per_block: int = 1  # n
  contiguous: bool = False  # entry e's keys are positions e * page ...: a page-table row
  quantized: bool = False  # the pool holds int8 codes, its scales a block beside them

  @property
  def block_heads(self) -> int:  # Hb
    return self.num_kv_heads // self.list_heads

  @property
  def blocks(self) -> int:  # NB
    return -(-self.entries // self.pages_per_block)

  @property
  def block_keys(self) -> int:  # E
    return self.pages_per_block * self.page_size


def tile_rows(itemsize: int) -> int:
  """A VMEM tile's rows of elements of `itemsize` bytes (8 rows of 32-bit words: 16 bf16, 32
  int8): a page a copy lands in must be a whole number of them."""
  return SUBLANES * max(1, 4 // itemsize)


def pages_per_block(page_size: int, entries: int, kv_heads: int, head_dim: int, value_dim: int,
                    itemsize: int, rows: int) -> int:
  """Pages a loop step reads: a run of about `BLOCK_KEYS` keys whose two buffers fit
  `BUFFER_BUDGET` and whose logits for `rows` (R) fit `SCORES_BUDGET`; one where a page is not
  a whole number of VMEM tiles (rows of 8 32-bit words: 16 bf16, 32 int8), which a copy
  cannot start inside."""
  if page_size % tile_rows(itemsize):
    return 1
  buffers = BUFFER_BUDGET // (2 * kv_heads * (head_dim + value_dim) * itemsize * page_size)
  scores = SCORES_BUDGET // (2 * 4 * rows * page_size)
  return max(1, min(BLOCK_KEYS // page_size, buffers, scores, entries))


def _key_positions(spec: Spec, first_ref: Any, at: Any, count: Any, j: Any) -> jax.Array:
  """[8, E] int32: each key slot's position in its sequence (NO_STEP past the list)."""
  shape = (SUBLANES, spec.block_keys)
  col = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  if spec.contiguous:  # a page-table row: block j's keys are positions j * E ...
    held = col < (count - j * spec.pages_per_block) * spec.page_size  # stale rows past it
    return jnp.where(held, j * spec.block_keys + col, NO_STEP)
  pos = jnp.full(shape, NO_STEP, jnp.int32)
  for i in range(spec.pages_per_block):
    entry = j * spec.pages_per_block + i
    first = first_ref[at * spec.entries + jnp.minimum(entry, spec.entries - 1)]
    first = jnp.where(entry < count, first - i * spec.page_size, NO_STEP)
    inside = (col >= i * spec.page_size) & (col < (i + 1) * spec.page_size)
    pos = jnp.where(inside, first + col, pos)
  return pos


def _head_block(spec: Spec, buf: Any, slot: Any, hk: int, dtype: Any) -> jax.Array:
  """[E, D]: kv head hk's keys (or values) of the block in buffer `slot` (its n pages in order:
  whole VMEM tiles a page, so joining them moves nothing), as `dtype` (a quantized pool's
  codes: exact in bf16 and f32)."""
  block = buf[slot, :, hk]  # [n, page, D]
  return block.reshape(spec.block_keys, block.shape[-1]).astype(dtype)


def _scales(spec: Spec, scales: Any, hk: int) -> tuple[Any, Any]:
  """kv head hk's key and value scales [1, E] f32 of the block's `scales` [2 Hb, E] (a
  quantized pool), or Nones."""
  if scales is None:
    return None, None
  return scales[hk:hk + 1, :], scales[spec.block_heads + hk:spec.block_heads + hk + 1, :]


def _poison_rows(seen: jax.Array, value_scale: jax.Array, dv: int) -> jax.Array:
  """[R, Dv]: NaN in every column of the rows that see a key whose value scale is not finite
  (so its dequantized value is not: `value_scale` [1, E]), else 0."""
  bad = jnp.where(jnp.isfinite(value_scale), 0.0, 1.0)  # [1, E]
  hits = jnp.max(jnp.where(seen, bad, 0.0), axis=1, keepdims=True)  # [R, 1]
  return jnp.broadcast_to(jnp.where(hits > 0, jnp.nan, 0.0), (seen.shape[0], dv))


def _compute(spec: Spec, seen: jax.Array, q_ref, scales, kbuf, vbuf, slot, m_scr, l_scr,
             acc_scr, guard: bool = True):
  """Every kv head of the block folded into its rows' online softmax. With `guard`, a
  non-finite value (or value scale) is zeroed (0 * NaN must not reach the rows that do not see
  it: free slots and stale buffer rows may hold anything) and NaN added in its column of the
  rows that see it; without (a whole block, `_whole`: every row sees every key) p @ v is the
  oracle's as it is."""
  for hk in range(spec.block_heads):
    q = q_ref[hk]  # [R, D]
    as_ = q.dtype if spec.quantized else kbuf.dtype  # a pool's codes in q's dtype
    k, v = _head_block(spec, kbuf, slot, hk, as_), _head_block(spec, vbuf, slot, hk, as_)
    k_scale, v_scale = _scales(spec, scales, hk)  # [1, E] each, or None
    s, _ = softmax.scores(q, k, spec.scale, spec.soft_cap, k_scale)  # [R, E]
    s = jnp.where(seen, s, -jnp.inf)
    if not guard:
      softmax.online_step(hk, s, v, m_scr, l_scr, acc_scr, v_scale)
      continue
    poison: Any = 0.0  # [R, Dv] NaN where a row sees a non-finite value
    if not spec.quantized:  # int8 codes (`paged.QUANTIZED_STORAGE`) are finite
      finite = jnp.isfinite(v.astype(jnp.float32))  # [E, Dv] (Mosaic tests f32 only)
      poison = softmax.poison(seen, finite)  # [R, Dv]
      v = jnp.where(finite, v, 0).astype(v.dtype)
    if v_scale is not None:
      poison = poison + _poison_rows(seen, v_scale, v.shape[-1])
      v_scale = jnp.where(jnp.isfinite(v_scale), v_scale, 0.0)
    softmax.online_step(hk, s, v, m_scr, l_scr, acc_scr, v_scale)
    acc_scr[hk] = acc_scr[hk] + poison


def _whole(spec: Spec, count: Any, length: Any, low: Any, j: Any) -> Any:
  """Whether block j is whole: every entry listed, every key before the sequence's length and
  seen by every row of the tile (`low`: its first row's position), so its values need no guard
  (`_compute`); None where the kernel does not tell (a selection's pages, a rule but causal).
  The guard's isfinite, select and extra product per kv head were a decode step's largest
  compute."""
  if not spec.contiguous or (spec.rule is not None
                             and _objects.as_rules(spec.rule) != CAUSAL_ONLY):
    return None
  end = (j + 1) * spec.block_keys  # one past the block's last key's position
  whole = ((j + 1) * spec.pages_per_block <= count) & (end <= length)
  return whole if spec.rule is None else whole & (low >= end - 1)


def _kernel(spec: Spec, seq_ref, len_ref, low_ref, blocks_ref, first_ref, count_ref, next_t_ref,
            next_h_ref, q_ref, pos_ref, sink_ref, key_hbm, value_hbm, *rest):
  """A program: tile t's rows against list head h's blocks, a loop over them (no grid step
  for a block past the list: lists of one step differ in length)."""
  scale_hbm, rest = (rest[0], rest[1:]) if spec.quantized else (None, rest)
  o_ref, lse_ref, kbuf, vbuf, *scale_buf, sems, slot_ref, m_scr, l_scr, acc_scr = rest
  sbuf = scale_buf[0] if scale_buf else None  # a quantized pool's block scales
  t, h = pl.program_id(0), pl.program_id(1)
  refs = paged_copies.Refs(seq_ref, blocks_ref, count_ref, key_hbm, value_hbm, kbuf, vbuf, sems,
                           scale_hbm, sbuf)
  copies = lambda tt, hh, jj, to: paged_copies.block_copies(spec, refs, tt, hh, jj, to)

  @pl.when((t == 0) & (h == 0))
  def _():  # the first working step's copies
    slot_ref[0] = 0
    pl.when(next_t_ref[0] >= 0)(lambda: paged_copies.start(copies(
        jnp.maximum(next_t_ref[0], 0), jnp.maximum(next_h_ref[0], 0), 0, 0)))

  softmax.init_state(m_scr, l_scr, acc_scr)
  blocks = _blocks(spec, seq_ref, len_ref, count_ref, t, h)
  after = t * spec.list_heads + h + 1  # the next (tile, list head) with work

  def step(j, carry):
    slot = slot_ref[0]
    more = j + 1 < blocks
    # The next block's copies start before this block's are waited for (into the other
    # buffer, whose block the last step computed on): two blocks in flight, no idle gap.
    pl.when(more)(lambda: paged_copies.start(copies(t, h, j + 1, 1 - slot)))
    pl.when(~more & (next_t_ref[after] >= 0))(lambda: paged_copies.start(copies(
        jnp.maximum(next_t_ref[after], 0), jnp.maximum(next_h_ref[after], 0), 0, 1 - slot)))
    paged_copies.wait(copies(t, h, j, slot), refs, slot)
    slot_ref[0] = 1 - slot
    _block(spec, (seq_ref, len_ref, low_ref, first_ref, count_ref), (q_ref, pos_ref),
           (kbuf, vbuf, sbuf), (m_scr, l_scr, acc_scr), t, h, j, slot)
    return carry

  jax.lax.fori_loop(0, blocks, step, 0)
  for hk in range(spec.block_heads):
    softmax.finish(hk, sink_ref[hk], m_scr, l_scr, acc_scr, o_ref, lse_ref)


def _block(spec: Spec, lists: tuple[Any, ...], rows: tuple[Any, Any], bufs: tuple[Any, ...],
           state: tuple[Any, Any, Any], t: Any, h: Any, j: Any, slot: Any) -> None:
  """Block j of (tile t, list head h), its copies in buffer `slot`, folded into the state."""
  seq_ref, len_ref, low_ref, first_ref, count_ref = lists
  q_ref, pos_ref = rows
  kbuf, vbuf, sbuf = bufs
  length, at = len_ref[t], seq_ref[t] * spec.list_heads + h
  count = count_ref[at]
  shape = (spec.groups * spec.block_q, spec.block_keys)
  kv_pos = jnp.broadcast_to(_key_positions(spec, first_ref, at, count, j)[:1], shape)
  q_pos = jnp.broadcast_to(pos_ref[...][:, :1], shape)  # [R, E]
  seen = (kv_pos < length) & (q_pos >= 0)  # [R, E]; q_pos -1: not a row
  if spec.rule is not None:
    seen = seen & spec.rule.visible(q_pos, kv_pos)
  scales = None if sbuf is None else sbuf[slot]  # [2 Hb, E]
  compute = functools.partial(_compute, spec, seen, q_ref, scales, kbuf, vbuf, slot, *state)
  whole = _whole(spec, count, length, low_ref[t], j)
  if whole is None:
    compute()
  else:
    pl.when(whole)(lambda: compute(guard=False))
    pl.when(~whole)(compute)


def _blocks(spec: Spec, seq_ref: Any, len_ref: Any, count_ref: Any, t: Any, h: Any) -> Any:
  """(tile t, list head h)'s blocks: ceil(count / n), 0 for no tile (lax.div: no floor_divide,
  list_kernel._div)."""
  count = count_ref[seq_ref[t] * spec.list_heads + h]
  return jnp.where(len_ref[t] > 0, jax.lax.div(count + spec.pages_per_block - 1,
                                               spec.pages_per_block), 0)


def vmem_bytes(block_q: int, keys: int, heads: int, kv_heads: int, head_dim: int,
               value_dim: int, itemsize: int) -> int:
  """The kernel's VMEM per loop step, estimated (q and outputs double-buffered, the two key
  and value blocks of `keys` keys, scratch, scores)."""
  rows = heads * block_q
  blocks = 2 * itemsize * rows * (head_dim + value_dim)
  buffers = 2 * itemsize * keys * kv_heads * (head_dim + value_dim)
  lanes = 2 * 4 * rows * LANES * 3  # positions, sinks and lse
  scratch = 4 * rows * (2 * LANES + value_dim)
  return blocks + buffers + lanes + scratch + 2 * 4 * (rows // kv_heads) * keys


def next_working(tile_seq: jax.Array, tile_len: jax.Array, count: jax.Array,
                 list_heads: int) -> tuple[jax.Array, jax.Array]:
  """[W * Hl + 1] each: at 0 the first (tile, list head) with work, at p + 1 the first after
  pair p (tile, head) = divmod(p, Hl); -1 where there is none."""
  work = (tile_len[:, None] > 0) & (count.reshape(-1, list_heads)[tile_seq] > 0)  # [W, Hl]
  at_or_after = splash_plan.next_step(work, jnp)  # [W * Hl], wrapping to the first
  pairs = jnp.arange(work.size)
  after = jnp.roll(at_or_after, -1)  # pair p: the first at or after p + 1, wrapped
  following = jnp.concatenate([jnp.where(work.any(), at_or_after[:1], -1),
                               jnp.where(after > pairs, after, -1)]).astype(jnp.int32)
  return (jnp.where(following < 0, -1, following // list_heads),
          jnp.where(following < 0, -1, following % list_heads))


def attend(spec: Spec, tile_seq: jax.Array, tile_len: jax.Array, tile_low: jax.Array,
           blocks: jax.Array, first_key: jax.Array, count: jax.Array, q: jax.Array,
           pos: jax.Array, key: jax.Array, value: jax.Array, sinks: jax.Array,
           scales: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """q [W, Hkv, R, D] (kv head hk's rows: query head hk * G + r // bq, row r % bq), pos
  [W, R, 128] int32 (row r's position: r % bq's; -1: no row), the pool key [P, Hkv, page, D]
  and value [P, Hkv, page, Dv] (a quantized pool's codes, with `scales`: `block_scales`),
  tile_seq / tile_len / tile_low [W] (each tile's sequence, its length after the write (0: no
  tile) and its first row's position),
  the lists' blocks and first_key [max_seqs, Hl, K] and count [max_seqs, Hl], sinks
  [Hkv, R, 128] f32 -> out [W, Hkv, R, Dv], lse [W, Hkv, R, 128]."""
  tiles, kv_heads, rows, d = q.shape
  dv, hb = value.shape[-1], spec.block_heads
  tile = lambda t, h, *_: (t, h, 0, 0)
  in_specs = [pl.BlockSpec((None, hb, rows, d), tile),
              pl.BlockSpec((None, rows, LANES), lambda t, *_: (t, 0, 0)),
              pl.BlockSpec((hb, rows, LANES), lambda t, h, *_: (h, 0, 0)),
              pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
  in_specs += [pl.BlockSpec(memory_space=pl.ANY)] if spec.quantized else []
  out_specs = [pl.BlockSpec((None, hb, rows, dv), tile),
               pl.BlockSpec((None, hb, rows, LANES), tile)]
  out_shape = [jax.ShapeDtypeStruct((tiles, kv_heads, rows, dv), q.dtype),
               jax.ShapeDtypeStruct((tiles, kv_heads, rows, LANES), jnp.float32)]
  buffers = lambda x: (2, spec.pages_per_block, hb, spec.page_size, x)  # a page a copy
  scales_buf = [pltpu.VMEM((2, 2 * hb, spec.block_keys), jnp.float32)] if spec.quantized else []
  scratch = [pltpu.VMEM(buffers(d), key.dtype), pltpu.VMEM(buffers(dv), value.dtype),
             *scales_buf, pltpu.SemaphoreType.DMA((2, 3)), pltpu.SMEM((1,), jnp.int32),
             pltpu.VMEM((hb, rows, LANES), jnp.float32),
             pltpu.VMEM((hb, rows, LANES), jnp.float32), pltpu.VMEM((hb, rows, dv), jnp.float32)]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=8, grid=(tiles, spec.list_heads), in_specs=in_specs,
      out_specs=out_specs, scratch_shapes=scratch)
  # In order: a step starts the next working step's copies.
  params = pltpu.CompilerParams(dimension_semantics=("arbitrary",) * 2)
  flat = lambda a: a.astype(jnp.int32).reshape(-1)
  next_t, next_h = next_working(tile_seq, tile_len, count, spec.list_heads)
  with base.kernel_precision(q.dtype):
    return pl.pallas_call(functools.partial(_kernel, spec), grid_spec=grid_spec,
                          out_shape=out_shape, compiler_params=params,
                          interpret=spec.interpret)(
                              tile_seq, tile_len, tile_low.astype(jnp.int32), flat(blocks),
                              flat(first_key), flat(count), next_t, next_h, q, pos, sinks, key,
                              value, *([] if scales is None else [scales]))
