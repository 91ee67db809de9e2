"""The pool's write of new tokens: every row at its page and slot, whatever the form XLA gets.

`pool.put_tiles` (a quantized pool's codes lowered for a TPU, written whole tiles of slots at a
time) is checked against a NumPy oracle on CPU; the TPU program is checked to take that form
(`jax.export` for TPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_cases
import splash_hk as sh
from splash_hk import pool


def _case(rng, pages, heads, size, dim, page, slot, dtype=np.int8):
  buf = rng.integers(-100, 100, (pages, heads, size, dim)).astype(dtype)
  rows = rng.integers(-100, 100, (len(page), heads, dim)).astype(dtype)
  return buf, np.asarray(page, np.int32), np.asarray(slot, np.int32), rows


CASES = {  # pages, Hkv, page size, D, each row's page and slot, the runs of slots they make
    # one row a sequence, each into its own page (a decode step)
    "decode": (9, 2, 64, 128, [3, 0, 7, 5], [17, 63, 0, 40], 4),
    # a prompt's rows filling a page's two groups and the next page's first, beside a decode
    # row into that group: groups shared by many rows
    "prefill": (6, 2, 64, 128, [1] * 64 + [4] * 5 + [4], list(range(64)) + list(range(5)) + [10],
                2),
    # a run across pages starting mid-group, and one of a row
    "across": (6, 2, 64, 128, [2] * 14 + [0] * 40 + [5], list(range(50, 64)) + list(range(40))
               + [7], 2),
    # a group's rows apart: another page's row between them
    "interleaved": (4, 2, 64, 128, [1, 2, 1, 3, 2], [0, 0, 1, 5, 33], 5),
    # a run of 40 slots from slot 30: its three groups, as many as the bound allows
    "tight": (4, 2, 64, 128, [3] * 34 + [1] * 6, list(range(30, 64)) + list(range(6)), 1),
    # rows past the pool and past the page (nothing written), one from the end (the last page)
    "outside": (5, 2, 32, 128, [5, 2, 9, -1, 2], [0, 40, 3, 31, 1], 5),
    # a prompt of 300 rows over five pages between two decode rows: windows over both ends of
    # the rows and inside them
    "long": (12, 2, 64, 128, [7] + [p for p in range(5) for _ in range(64)][10:310] + [9],
             [20] + [s % 64 for s in range(10, 310)] + [63], 3),
    # pages of 16 slots (a group is the page)
    "small_pages": (7, 4, 16, 128, [6, 6, 2, 0], [15, 0, 9, 9], 3),
}


@pytest.mark.parametrize("bounded", [False, True], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("name", CASES)
def test_rows_written_a_tile_of_slots_at_a_time_match_the_oracle(name, bounded):
  pages, heads, size, dim, page, slot, runs = CASES[name]
  buf, page, slot, rows = _case(np.random.default_rng(0), pages, heads, size, dim, page, slot)
  group = min(pool.tile_slots(jnp.int8), size)
  most = pool.groups_touched(len(page), group, runs if bounded else None)
  got = jax.jit(pool.put_tiles, static_argnums=(4, 5))(buf, page, slot, rows, group, most)
  np.testing.assert_array_equal(np.asarray(got), paged_cases.written_rows(buf, page, slot, rows))


DISJOINT = ("decode", "across", "tight", "outside", "long")  # no two runs in one group of slots


@pytest.mark.parametrize("whole_pages", [False, True], ids=["tiles", "pages"])
@pytest.mark.parametrize("dtype", [np.int8, jnp.bfloat16], ids=["int8", "bf16"])
@pytest.mark.parametrize("name", DISJOINT)
def test_disjoint_runs_written_as_windows_of_rows_match_the_oracle(name, dtype, whole_pages):
  """`pool.put_runs` (a ragged step's write on a TPU: each group's rows one window of the rows,
  no row scattered), windows of a tile's slots or of a page, with padding rows past the pool
  after the runs."""
  pages, heads, size, dim, page, slot, runs = CASES[name]
  page, slot = page + [pages, pages + 3], slot + [0, 9]  # padding: written nowhere
  buf, page, slot, rows = _case(np.random.default_rng(4), pages, heads, size, dim, page, slot,
                                dtype)
  group = size if whole_pages else min(pool.tile_slots(dtype), size)
  most = pool.groups_touched(len(page), group, runs + 1)
  got = jax.jit(pool.put_runs, static_argnums=(4, 5))(buf, page, slot, rows, group, most)
  want = paged_cases.written_rows(np.asarray(buf, np.float32), page, slot,
                                  np.asarray(rows, np.float32))
  np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_a_prompt_of_8192_rows_written_as_whole_pages_matches_the_oracle():
  """A paged prefill's write at the size the bench times (8192 rows over 128 shuffled pages of
  64, Hkv 8, D 128, bf16), beside two decode rows, padding rows after: `put_runs` at the group
  `run_group` picks for it (whole pages)."""
  rng = np.random.default_rng(6)
  order = rng.permutation(131)
  page = np.concatenate([np.repeat(order[:128], 64), [order[128], order[129], 131, 131]])
  slot = np.concatenate([np.tile(np.arange(64), 128), [17, 0, 0, 5]])
  buf, page, slot, rows = _case(rng, 131, 8, 64, 128, page, slot, jnp.bfloat16)
  group = pool.run_group(len(page), 3, 64, pool.tile_slots(jnp.bfloat16))
  assert group == 64
  most = pool.groups_touched(len(page), group, 3)
  got = jax.jit(pool.put_runs, static_argnums=(4, 5))(buf, page, slot, rows, group, most)
  want = paged_cases.written_rows(np.asarray(buf, np.float32), page, slot,
                                  np.asarray(rows, np.float32))
  np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_a_small_lookup_by_comparison_matches_indexing():
  """`pool.take`'s TPU form (each index compared with every place) against NumPy's indexing:
  ints and bools, indices of any shape, every place hit."""
  rng = np.random.default_rng(5)
  values = rng.integers(-50, 50, 40).astype(np.int32)
  index = rng.integers(0, 40, (7, 9)).astype(np.int32)
  np.testing.assert_array_equal(np.asarray(pool.take_compared(values, index)), values[index])
  flags = rng.integers(0, 2, 40).astype(bool)
  np.testing.assert_array_equal(np.asarray(pool.take_compared(flags, index)), flags[index])
  np.testing.assert_array_equal(np.asarray(pool.take(values, index)), values[index])


def test_int4_codes_are_written_64_slots_at_a_time_and_match_the_oracle():
  assert pool.tile_slots(jnp.int4) == 64 and pool.tile_slots(jnp.float8_e4m3fn) == 32
  assert pool.tile_slots(jnp.bfloat16) == 16 and pool.tile_slots(jnp.float32) == 1
  rng = np.random.default_rng(1)
  buf = rng.integers(-8, 8, (3, 2, 128, 128)).astype(jnp.int4)
  page, slot = np.asarray([2, 2, 0], np.int32), np.asarray([64, 127, 5], np.int32)
  rows = rng.integers(-8, 8, (3, 2, 128)).astype(jnp.int4)
  got = pool.put_tiles(jnp.asarray(buf), page, slot, jnp.asarray(rows), 64)
  np.testing.assert_array_equal(np.asarray(got, np.int8),
                                paged_cases.written_rows(np.asarray(buf, np.int8), page, slot,
                                        np.asarray(rows, np.int8)))


def _write(cache, k, v, page, slot, runs=None, disjoint=False):
  return pool.write(cache, k, v, page, slot, runs, disjoint)


def _int8_pool(pages=40, heads=8, size=64, dim=128):
  z = lambda: sh.Quantized(jnp.zeros((pages, heads, size, dim), jnp.int8),
                           jnp.ones((pages, heads, size, 1), jnp.float32))
  return sh.PagedKVCache(z(), z())


def _exported(platform, cache, rows, runs=None, disjoint=False):
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  k = jax.ShapeDtypeStruct((rows, cache.num_kv_heads, 128), jnp.bfloat16)
  index = jax.ShapeDtypeStruct((rows,), jnp.int32)
  write = lambda *a: _write(*a, runs=runs, disjoint=disjoint)
  return jax.export.export(jax.jit(write), platforms=[platform])(
      jax.tree.map(spec, cache), k, k, index, index).mlir_module()


def test_an_int8_pools_codes_are_scattered_whole_tiles_on_a_tpu_and_rows_elsewhere():
  tiles = "tensor<4x8x32x128xi8>"  # 4 rows' groups of 32 slots, as the scatter's update
  assert tiles in _exported("tpu", _int8_pool(), 4)
  assert tiles not in _exported("cpu", _int8_pool(), 4)
  # 512 rows in 2 runs fall in at most 512 / 32 + 4 groups: those are read and written
  assert "tensor<20x8x32x128xi8>" in _exported("tpu", _int8_pool(), 512, runs=2)
  # a bfloat16 pool's slot is half a word: 16 slots a tile
  bf16 = sh.PagedKVCache(*(jnp.zeros((40, 8, 64, 128), jnp.bfloat16) for _ in range(2)))
  assert "tensor<4x8x16x128xbf16>" in _exported("tpu", bf16, 4)
  # a write whose groups would read more than half the pool scatters rows on a TPU too
  assert "x8x32x128xi8>" not in _exported("tpu", _int8_pool(pages=3), 64)
  # unless its runs are disjoint (a ragged step's): each group's window of rows, gathered
  assert "tensor<4x32x8x128xi8>" in _exported("tpu", _int8_pool(pages=3), 64, runs=1,
                                              disjoint=True)
  # a long run's windows are whole pages (1024 rows: 16 pages and the two partial ones)
  assert pool.run_group(1024, 1, 64, 16) == 64 and pool.run_group(1054, 32, 64, 16) == 16
  assert "tensor<18x64x8x128xbf16>" in _exported("tpu", bf16, 1024, runs=1, disjoint=True)
  assert "x64x8x128xbf16>" not in _exported("tpu", bf16, 1024, runs=1)


@pytest.mark.parametrize("writes", list(paged_cases.WRITES))
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_steps_write_lands_at_its_slots_and_nowhere_else(kind, writes):
  paged_cases.check_a_write(kind, writes)


def test_a_write_through_the_tpu_form_lands_where_the_cpu_form_does():
  """The write of a step on an int8 pool: each written row's codes and scales equal the oracle's
  quantization, every other slot unchanged (the CPU's program: the TPU's form is checked
  against the oracle above)."""
  cache = _int8_pool(pages=6, heads=2)
  rng = np.random.default_rng(2)
  k, v = (jnp.asarray(rng.normal(size=(3, 2, 128)), jnp.float32) for _ in range(2))
  page, slot = jnp.asarray([4, 4, 0], jnp.int32), jnp.asarray([0, 33, 63], jnp.int32)
  out = jax.jit(_write)(cache, k, v, page, slot)
  want = sh.quantize(k, jnp.int8)
  codes = np.zeros((6, 2, 64, 128), np.int8)
  scales = np.ones((6, 2, 64, 1), np.float32)
  for n in range(3):
    codes[int(page[n]), :, int(slot[n])] = np.asarray(want.values[n])
    scales[int(page[n]), :, int(slot[n])] = np.asarray(want.scale[n])
  np.testing.assert_array_equal(np.asarray(out.key.values), codes)
  np.testing.assert_array_equal(np.asarray(out.key.scale), scales)
