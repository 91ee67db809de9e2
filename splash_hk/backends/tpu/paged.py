"""The TPU backend's paged calls: the block-list kernel over the pool (`tpu_paged`).

A step's rows are cut into tiles of `block_q` rows of one sequence (a static bound of them:
ceil(N / bq) + max_seqs); each tile's list of blocks is its sequence's page-table row (its count
the pages covering the sequence's length after the write), or with a selection its chosen
pages per kv head. Rows the batch does not make live (padding, a misusing
sequence) are no tile's rows; `paged._step` gives them their 0 or NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from splash_hk import pages
from splash_hk import pool
from splash_hk import quant
from splash_hk.backends import base
from splash_hk.backends.tpu import fresh
from splash_hk.backends.tpu import list_kernel as tpu_lists
from splash_hk.backends.tpu import paged_kernel as tpu_paged



# Quantized pools the kernel reads (`quant.storage`): int8 codes, one scale per token and kv head
# or coarser, keys and values both (the codes turned into the query's dtype in VMEM, the scales
# a block). fp8 codes stay on xla: a v5e has no fp8 arithmetic, and Mosaic's fp8 conversion
# there is unchecked (tpu-inference reads fp8 caches from v6e on).
QUANTIZED_STORAGE = ("int8/token",)
CODE_ROWS = tpu_paged.tile_rows(1)  # a VMEM tile's rows of one-byte codes
FLOOR_KEYS = 256  # a prompt chunk's tiles are cut so that a step of this many keys fits


def block_q(facts: pages.PagedFacts) -> int:
  """Query rows per tile: a sequence's share of the step's rows, at most 128, the fewest whose
  G * bq stacked rows fill whole VMEM tiles (a decode row of 4 query heads: bq 2, 8 rows), and
  fewer where a step of `FLOOR_KEYS` keys would pass the VMEM budget (a prompt chunk of 32 query
  heads: at 128 rows a tile, 27 MiB a step of one page of 64)."""
  share = -(-facts.num_tokens // facts.max_seqs)
  groups = facts.num_heads // facts.num_kv_heads
  step = tpu_lists.SUBLANES // math.gcd(tpu_lists.SUBLANES, groups)  # G * bq: whole tiles
  top = min(base.round_up(128, step), base.round_up(max(share, 1), step))
  keys = min(FLOOR_KEYS, facts.pages_per_seq * facts.page_size)
  fits = [bq for bq in range(top, step, -step)
          if _vmem_bytes(facts, bq, keys, 4) <= tpu_lists.VMEM_BUDGET]
  return fits[0] if fits else step


def why_not(facts: pages.PagedFacts, hardware: str) -> str | None:
  """Why the paged block-list kernel cannot serve this paged call, or None."""
  if hardware != "tpu" and not facts.config.interpret:
    return (f"the block-list kernel is a Pallas TPU kernel (this is {hardware}); set "
            "AttentionConfig(interpret=True) to run it in interpret mode")
  if facts.bias is not None:
    return "a `bias` was given, and the paged block-list kernel takes none"
  bad = [s for s in facts.storage if s not in QUANTIZED_STORAGE]
  if facts.quantized and bad:
    return (f"the pool's keys and values are stored as {' and '.join(facts.storage)} (the "
            "paged block-list kernel reads floating pools, or keys and values both "
            f"{' or '.join(QUANTIZED_STORAGE)}: fp8 codes run on xla)")
  if facts.quantized and facts.page_size % CODE_ROWS:
    return (f"int8 pages of {facts.page_size} slots are not whole VMEM tiles of one-byte codes "
            f"({CODE_ROWS} rows): the paged kernel would read one page a step; pages of a "
            f"multiple of {CODE_ROWS} slots run on it")
  if facts.cascade:
    return "the batch has a shared prefix (a cascade), which the paged block-list kernel lacks"
  if facts.tree:
    return "the batch has draft trees (RaggedBatch.tree), which the paged block-list kernel lacks"
  if facts.config.dropout_rate > 0:
    return base.DROPOUT_REFUSAL
  need = step_vmem_bytes(facts, pages_a_step(facts, 4), 4)
  if need > tpu_lists.VMEM_BUDGET:
    return (f"{facts.num_heads} query heads over pages of {facts.page_size} need about "
            f"{need / 2 ** 20:.1f} MiB of VMEM per step, over the kernel's "
            f"{tpu_lists.VMEM_BUDGET / 2 ** 20:.0f} MiB")
  return None


def step_vmem_bytes(facts: pages.PagedFacts, count: int, itemsize: int) -> int:
  """The kernel's VMEM a step of `count` pages, estimated (`paged_kernel.vmem_bytes`)."""
  return _vmem_bytes(facts, block_q(facts), count * facts.page_size, itemsize)


def _vmem_bytes(facts: pages.PagedFacts, bq: int, keys: int, itemsize: int) -> int:
  return tpu_paged.vmem_bytes(bq, keys, facts.num_heads, facts.num_kv_heads, facts.head_dim,
                              facts.value_dim, itemsize)


def pages_a_step(facts: pages.PagedFacts, itemsize: int, entries: int | None = None) -> int:
  """Pages the kernel reads a step (`paged_kernel.pages_per_block`), fewer where the step's
  VMEM would pass the kernel's budget (wide tiles beside long runs); at least one."""
  most = tpu_paged.pages_per_block(facts.page_size, entries or facts.pages_per_seq,
                                   facts.num_kv_heads, facts.head_dim, facts.value_dim,
                                   itemsize, facts.num_heads // facts.num_kv_heads * block_q(facts))
  fits = [n for n in range(most, 1, -1)
          if step_vmem_bytes(facts, n, itemsize) <= tpu_lists.VMEM_BUDGET]
  return fits[0] if fits else 1


def most_tiles(num_tokens: int, max_seqs: int, bq: int) -> int:
  """W: the most tiles of `bq` rows a step of `num_tokens` rows over `max_seqs` sequences cuts
  (each sequence with rows wastes at most bq - 1 rows of its last tile)."""
  return (num_tokens + min(max_seqs, num_tokens) * (bq - 1)) // bq


def _tiles(x: pages.PagedInputs, bq: int) -> tuple[jax.Array, ...]:
  """tile_seq [W], tile_len [W] (0: no tile), rows [W, bq] (N: no row) and each row's place
  [N] in the tiles' W * bq rows (-1: in no tile)."""
  layout, table = x.layout, x.lists.table  # each sequence's rows and its page-table row
  n, max_seqs = x.query.shape[0], table.num_owners
  first_row, q_len = table.offset, table.rows  # [max_seqs]: live rows only
  count = -(-q_len // bq)  # [max_seqs] tiles per sequence
  ends = jnp.cumsum(count)  # [max_seqs]
  tau = jnp.arange(most_tiles(n, max_seqs, bq), dtype=jnp.int32)  # [W]
  seq = jnp.clip(pool.search(ends, tau), 0, max_seqs - 1).astype(jnp.int32)
  used = tau < ends[-1]  # [W]
  first = first_row[seq] + (tau - (ends[seq] - count[seq])) * bq  # [W]
  rows = first[:, None] + jnp.arange(bq, dtype=jnp.int32)  # [W, bq]
  ok = (used[:, None] & (rows < (first_row + q_len)[seq][:, None]) & (rows >= 0)
        & (rows < n))
  tile_len = jnp.where(used, layout.kv_len_after[seq], 0).astype(jnp.int32)
  own = layout.seq  # [N] each row's sequence
  within = jnp.arange(n, dtype=jnp.int32) - first_row[own]  # [N]
  place = (ends[own] - count[own]) * bq + within  # tiles before the sequence's, then its rows
  return seq, tile_len, jnp.where(ok, rows, n), jnp.where(
      (within >= 0) & (within < q_len[own]), place, -1)


def block_scales(spec: tpu_paged.Spec, blocks: jax.Array, key_scale: jax.Array,
                 value_scale: jax.Array) -> jax.Array:
  """[max_seqs, Hl, NB, 2 * Hb, E] f32: each list's blocks' key scales (rows :Hb, a block's n
  pages in order along E) and value scales (rows Hb:), gathered from the pool's per-key scales
  [P, Hkv, page] by the lists' pages `blocks` [max_seqs, Hl, K] (an entry past its list reads
  some page's: unseen). A scale row of a block is what the kernel multiplies a block's logits'
  (or probabilities') columns by: 4 bytes a key and kv head, 1/D of the codes."""
  max_seqs, hl, k = blocks.shape
  n, hb = spec.pages_per_block, spec.block_heads
  both = jnp.concatenate([a.reshape(spec.num_pages, hl, hb, spec.page_size)
                          for a in (key_scale, value_scale)], axis=2)  # [P, Hl, 2 Hb, page]
  at = jnp.pad(jnp.clip(blocks, 0, spec.num_pages - 1),
               ((0, 0), (0, 0), (0, spec.blocks * n - k)))  # [max_seqs, Hl, NB * n]
  got = both[at, jnp.arange(hl)[None, :, None]]  # [max_seqs, Hl, NB * n, 2 Hb, page]
  got = got.reshape(max_seqs, hl, spec.blocks, n, 2 * hb, spec.page_size)
  return jnp.swapaxes(got, 3, 4).reshape(max_seqs, hl, spec.blocks, 2 * hb, spec.block_keys)


def attend(x: pages.PagedInputs, facts: pages.PagedFacts,
           dense: fresh.Dense | None = None) -> tuple[jax.Array, jax.Array]:
  """out [N, Hq, Dv] of every live row over its sequence's pages (other rows: 0) and its lse
  [N, Hq] (base's convention): a step with nothing cached on the `dense` kernel where it serves
  the call (`fresh`), else the paged kernel."""
  if dense is None or not fresh.serves(x, facts, dense):
    return _paged(x, facts)
  return jax.lax.cond(fresh.fresh(x), lambda: fresh.attend(x, facts, dense),
                      lambda: _paged(x, facts))


def _paged(x: pages.PagedInputs, facts: pages.PagedFacts) -> tuple[jax.Array, jax.Array]:
  """`attend` on the paged kernel."""
  n, heads, d = x.query.shape
  kv_heads, dv = facts.num_kv_heads, facts.value_dim
  groups, bq = heads // kv_heads, block_q(facts)
  tile_seq, tile_len, rows, place = _tiles(x, bq)  # [W], [W], [W, bq], [N]
  some = rows < n  # [W, bq]
  at = jnp.clip(rows, 0, n - 1)
  q = jnp.where(some[..., None, None], x.query[at], 0)  # [W, bq, Hq, D]
  row_pos = jnp.where(some, x.layout.pos[at], -1)  # [W, bq]
  low = jnp.min(jnp.where(some, row_pos, tpu_paged.NO_STEP), axis=1)  # [W]: first row's
  pos = jnp.tile(row_pos, (1, groups))  # [W, G * bq]
  pos = jnp.broadcast_to(pos[..., None], (*pos.shape, tpu_lists.LANES))  # [W, G * bq, 128]
  sinks = (jnp.full((heads,), -jnp.inf, jnp.float32) if x.sinks is None
           else base.sink_logsumexp(x.sinks))  # [Hq]
  lists = x.lists.table if x.lists.chosen is None else x.lists.chosen  # [max_seqs, Hl, K]
  entries = lists.blocks.shape[2]
  key, key_scale, quantized = quant.per_key(x.cache.key)  # [P, Hkv, page, D], [P, Hkv, page]
  value, value_scale, _ = quant.per_key(x.cache.value)  # [P, Hkv, page, Dv], [P, Hkv, page]
  spec = tpu_paged.Spec(bq, facts.page_size, facts.num_pages, kv_heads, groups,
                        lists.list_heads, entries, facts.scale, facts.config.logits_soft_cap,
                        facts.rule, facts.config.interpret,
                        pages_a_step(facts, key.dtype.itemsize, entries),
                        lists.positional, quantized)
  scales = block_scales(spec, lists.blocks, key_scale, value_scale) if quantized else None
  stacked = (kv_heads, groups * bq)  # a kv head's query heads as rows of one product
  q = jnp.swapaxes(q, 1, 2).reshape(-1, *stacked, d)  # [W, Hkv, G * bq, D]
  sinks = jnp.broadcast_to(jnp.repeat(sinks.reshape(stacked[0], groups), bq, 1)[..., None],
                           (*stacked, tpu_lists.LANES))  # [Hkv, G * bq, 128]
  out, lse = tpu_paged.attend(spec, tile_seq, tile_len, low, lists.blocks, lists.first_key,
                              lists.count, q, pos, key, value, sinks, scales)
  out = jnp.swapaxes(out.reshape(-1, heads, bq, dv), 1, 2)  # [W, bq, Hq, Dv]
  lse = jnp.swapaxes(lse.reshape(-1, heads, bq, tpu_lists.LANES)[..., 0], 1, 2)  # [W, bq, Hq]
  at = jnp.clip(place, 0, None)  # [N]: a gather of each row from its tile (not a scatter)
  out = jnp.where((place >= 0)[:, None, None], out.reshape(-1, heads, dv)[at], 0)
  lse = jnp.where((place >= 0)[:, None], lse.reshape(-1, heads)[at], -jnp.inf)
  return out, lse  # [N, Hq, Dv], [N, Hq]
