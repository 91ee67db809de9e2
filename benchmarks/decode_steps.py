"""The steps the TPU decode bench times (`bench_tpu_decode`): a ragged paged step over a pool of
shuffled pages, and the same keys and values in the peer's layout.

A row is a step's shape: `seqs` sequences whose lengths after the step lie in [shortest,
longest], each with `rows` new rows (a decode: 1), except the first `prompts`, which bring
`prompt` new rows (a chunk of a prompt: a mixed step beside decodes, or a prefill alone where
every sequence is one and its length is the chunk); `int8`: the pool quantized (per-token
scales, as `KVCache`), which the peer does not take; `quest`: each sequence reads 1/quest of
its pages, chosen by `sh.sparse.top_k_pages` in the step (the pool keeps page summaries);
`in_order`: pages handed out in order (a fresh allocator's), not shuffled through the pool.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk import quant
import splash_hk as sh


@dataclasses.dataclass(frozen=True)
class Row:
  seqs: int
  shortest: int
  longest: int
  page: int
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  rows: int = 1  # new rows of a decoding sequence (decode: 1; a verification of drafts: more)
  prompts: int = 0  # the first `prompts` sequences bring `prompt` new rows each
  prompt: int = 0
  int8: bool = False  # the pool quantized to int8 with per-token scales
  quest: int = 0  # each sequence reads 1/quest of its pages (Quest's choice); 0: every page
  in_order: bool = False  # pages handed out in order (each sequence's consecutive), not shuffled
  platform: str = "auto"  # the library's choice for the chip; "xla": its fallback, timed

  @property
  def q_lens(self) -> np.ndarray:
    """[S] each sequence's new rows."""
    lens = np.full((self.seqs,), self.rows, np.int32)
    lens[:self.prompts] = self.prompt
    return lens

  def parts(self) -> tuple[Row, Row] | None:
    """A mixed step's parts apart: its prompt chunks alone and its decodes alone (None for a
    step of one kind)."""
    if not 0 < self.prompts < self.seqs:
      return None
    return (dataclasses.replace(self, seqs=self.prompts),
            dataclasses.replace(self, seqs=self.seqs - self.prompts, prompts=0))


ROWS = {"decode_p16": Row(32, 1024, 8192, 16), "decode_p64": Row(32, 1024, 8192, 64),
        "decode_p128": Row(32, 1024, 8192, 128),
        "decode64_p16": Row(64, 512, 4096, 16), "long8_p64": Row(8, 32768, 32768, 64),
        "verify4_p64": Row(32, 1024, 8192, 64, rows=4),
        "mixed_p64": Row(32, 1024, 8192, 64, prompts=2, prompt=512),
        "prefill2k_p64": Row(1, 2048, 2048, 64, prompts=1, prompt=2048),
        "prefill8k_p64": Row(1, 8192, 8192, 64, prompts=1, prompt=8192),
        "int8_p64": Row(32, 1024, 8192, 64, int8=True),
        "quest16_p64": Row(8, 32768, 32768, 64, quest=16),
        "in_order_p16": Row(32, 1024, 8192, 16, in_order=True),
        "in_order_p64": Row(32, 1024, 8192, 64, in_order=True),
        "decode_p64_xla": Row(32, 1024, 8192, 64, platform="xla"),
        "int8_p64_xla": Row(32, 1024, 8192, 64, int8=True, platform="xla")}


def _smoke(row: Row) -> Row:
  """A tiny row of the same kind (interpret mode on a CPU)."""
  small = dict(seqs=min(row.seqs, 3), heads=4, kv_heads=2, prompt=min(row.prompt, 48))
  if row.prompts == row.seqs:  # a prefill: its length is its chunk
    return dataclasses.replace(row, shortest=48, longest=48, **small)
  return dataclasses.replace(row, shortest=40, longest=300, **small)


SMOKE_ROWS = {name: _smoke(r) for name, r in ROWS.items()}


@dataclasses.dataclass
class Step:
  q: jax.Array  # [N, Hq, D]
  k: jax.Array  # [N, Hkv, D]
  v: jax.Array
  pool: sh.PagedKVCache
  batch: sh.RaggedBatch
  lens: np.ndarray  # [S] lengths after the write
  top_k: int | None = None  # pages Quest chooses beyond each sequence's last (None: all read)
  platform: str = "auto"  # `AttentionConfig.platform` of the timed step (`Row.platform`)

  def chosen(self, q: jax.Array, pool: sh.PagedKVCache) -> sh.RaggedBatch:
    """The step's batch, with Quest's choice over `pool` where the step makes one."""
    if self.top_k is None:
      return self.batch
    return dataclasses.replace(self.batch, selection=sh.sparse.top_k_pages(
        q, pool, self.batch, top_k=self.top_k))

  @property
  def tokens_read(self) -> int:
    """The tokens a step reads: every sequence's after the write, or its chosen pages'."""
    if self.top_k is None:
      return int(self.lens.sum())
    page = self.pool.page_size
    return int(np.minimum(self.lens, (self.top_k + 1) * page).sum())

  @property
  def bytes_read(self) -> int:
    """Each token read's keys and values, once (an int8 pool's scales too)."""
    per_token = 0
    for half in (self.pool.key, self.pool.value):
      if isinstance(half, quant.Quantized):
        per_token += half.values.shape[1] * (half.values.shape[3] * half.values.dtype.itemsize
                                             + half.scale.dtype.itemsize)
      else:
        per_token += half.shape[1] * half.shape[3] * half.dtype.itemsize
    return self.tokens_read * per_token


def _table(rng: np.random.Generator, lens: np.ndarray, page: int,
           in_order: bool = False) -> tuple[np.ndarray, int]:
  """Each sequence's pages shuffled through a pool ([S, width]; `in_order`: handed out in
  order) and the pool's pages (one spare)."""
  need = -(-lens // page)
  order = rng.permutation(int(need.sum()) + 1)
  order = np.sort(order) if in_order else order
  table = np.zeros((len(lens), int(need.max())), np.int32)
  at = 0
  for s, n in enumerate(need):
    table[s, :n] = order[at:at + n]
    at += n
  return table, int(need.sum()) + 1


def make_step(row: Row, seed: int = 0) -> Step:
  """A step over shuffled pages of random bf16 keys and values (int8 with `row.int8`)."""
  rng = np.random.default_rng(seed)
  q_lens = row.q_lens
  lens = np.maximum(rng.integers(row.shortest, row.longest + 1, row.seqs), q_lens)  # after
  lens = lens.astype(np.int32)
  table, pages = _table(rng, lens, row.page, row.in_order)
  keys = jax.random.split(jax.random.key(seed), 5)
  shape = (pages, row.kv_heads, row.page, row.head_dim)
  key, value = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys[:2])
  if row.int8:
    key, value = quant.quantize(key, jnp.int8), quant.quantize(value, jnp.int8)
  n = int(q_lens.sum())
  q = jax.random.normal(keys[2], (n, row.heads, row.head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (n, row.kv_heads, row.head_dim), jnp.bfloat16)
          for kk in keys[3:])
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  batch = sh.RaggedBatch(jnp.asarray(cu), jnp.asarray(lens - q_lens), jnp.asarray(table),
                         jnp.asarray(row.seqs, jnp.int32))
  pool, top_k = sh.PagedKVCache(key, value), None
  if row.quest:  # the bounds of every slot (the bench's pages are full of its tokens)
    held = jnp.asarray(quant.tile(key, jnp.float32), jnp.float32)  # [P, Hkv, page, D]
    pool = pool.replace(key_min=jnp.min(held, axis=2), key_max=jnp.max(held, axis=2))
    top_k = max(table.shape[1] // row.quest - 1, 1)  # and the last page: 1/quest of them
  return Step(q, k, v, pool, batch, lens, top_k, row.platform)


def peer_inputs(step: Step) -> tuple[jax.Array, ...]:
  """JAX's ragged paged attention's arguments for the step: the pool with the new tokens
  written, k and v heads interleaved ([P, page, 2 * Hkv, D]), lengths after the write, the page
  table, row offsets and the sequence count."""
  p, hkv, page, d = step.pool.key.shape
  table = step.batch.page_table
  cu = np.asarray(step.batch.cu_q_lens)
  q_lens = np.diff(cu)
  seq = np.repeat(np.arange(len(q_lens)), q_lens)  # [N]
  pos = jnp.asarray(step.lens[seq] - q_lens[seq] + np.arange(cu[-1]) - cu[:-1][seq])  # [N]
  write = lambda pool, new: pool.at[table[seq, pos // page], :, pos % page].set(new)
  k, v = write(step.pool.key, step.k), write(step.pool.value, step.v)  # [P, Hkv, page, D]
  kv = jnp.stack([k, v], axis=2).transpose(0, 3, 1, 2, 4).reshape(p, page, 2 * hkv, d)
  return (step.q, kv, jnp.asarray(step.lens), table, step.batch.cu_q_lens,
          jnp.asarray([table.shape[0]], jnp.int32))
