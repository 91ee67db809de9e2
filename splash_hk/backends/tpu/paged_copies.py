"""The paged kernel's copies (`paged_kernel`): a block's run of pages from the pool in HBM into
a VMEM buffer, started a working step ahead and waited for where it is used (two buffers, a
slot each). A page's slab [Hb, page, X] is a copy; where the list holds every entry of the block
and its pages are consecutive in the pool (an allocator handing out pages in order), the n pages
are one copy a buffer instead: a copy's issue, not its bytes, bounds a step at small pages."""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp


class Copies(NamedTuple):
  """A block's copies into one buffer slot."""

  pages: list[tuple[Any, Any]]  # each page's (condition: the list holds it, copy)
  full: Any  # the list holds every entry of the block
  run: Any  # ... and their pages are consecutive in the pool (None: one page a block)
  runs: list[Any]  # then: one copy a buffer (keys, values) of all n pages ([]: one page)


def block_copies(spec: Any, refs: Any, t: Any, h: Any, j: Any, slot: Any) -> Copies:
  """The copies of (tile t, list head h)'s block j (`spec`: the kernel's `paged_kernel.Spec`)
  into buffer `slot`: each page's, only entries the list holds are copied; and the block's
  pages as one copy a buffer, for when they are consecutive."""
  seq_ref, blocks_ref, count_ref, key_hbm, value_hbm, kbuf, vbuf, sems = refs
  at = seq_ref[t] * spec.list_heads + h
  count = count_ref[at]
  heads = pl.ds(h * spec.block_heads, spec.block_heads)
  pairs = ((key_hbm, kbuf), (value_hbm, vbuf))
  found, pages = [], []
  for i in range(spec.pages_per_block):
    entry = j * spec.pages_per_block + i
    pages.append(jnp.clip(blocks_ref[at * spec.entries + jnp.minimum(entry, spec.entries - 1)],
                          0, spec.num_pages - 1))
    found += [(entry < count, pltpu.make_async_copy(hbm.at[pages[i], heads], buf.at[slot, i],
                                                    sems.at[slot, c]))
              for c, (hbm, buf) in enumerate(pairs)]
  full = (j + 1) * spec.pages_per_block <= count
  if spec.pages_per_block == 1:
    return Copies(found, full, None, [])
  run = pages[1] == pages[0] + 1
  for before, after in zip(pages[1:], pages[2:]):
    run = run & (after == before + 1)
  first = pl.ds(jnp.minimum(pages[0], spec.num_pages - spec.pages_per_block),
                spec.pages_per_block)  # (a run's first page: the same)
  runs = [pltpu.make_async_copy(hbm.at[first, heads], buf.at[slot], sems.at[slot, c])
          for c, (hbm, buf) in enumerate(pairs)]
  return Copies(found, full, run, runs)


def start(copies: Copies) -> None:
  """A block's copies started: where the list holds every entry, all at once (a branch a copy
  cost a grid step about as much as its copies), one a buffer where its pages are consecutive;
  else each listed page's."""
  every = copies.full
  if copies.runs:  # n > 1 pages a block: a run may join them
    every = copies.full & ~copies.run

    @pl.when(copies.full & copies.run)
    def _():
      for copy in copies.runs:
        copy.start()

  @pl.when(every)
  def _():
    for _, copy in copies.pages:
      copy.start()

  @pl.when(~copies.full)
  def _():
    for holds, copy in copies.pages:
      pl.when(holds)(copy.start)


def wait(copies: Copies, buffers: tuple[Any, Any], sems: Any, slot: Any) -> None:
  """A block's copies waited for: where the list holds every entry, once a buffer (a copy of
  the whole buffer onto itself stands for its pages' copies, or its run's, on the semaphore),
  else each under its condition."""

  @pl.when(copies.full)
  def _():
    for c, buf in enumerate(buffers):
      pltpu.make_async_copy(buf.at[slot], buf.at[slot], sems.at[slot, c]).wait()

  @pl.when(~copies.full)
  def _():
    for holds, copy in copies.pages:
      pl.when(holds)(copy.wait)
