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


class Refs(NamedTuple):
  """What the copies read and write: the scalar prefetch they index by, the pool in HBM and the
  two-slot VMEM buffers (a quantized pool's block scales beside: else None)."""

  seq: Any  # [W] each tile's sequence
  blocks: Any  # [max_seqs * Hl * K] the lists' pages
  count: Any  # [max_seqs * Hl] the lists' lengths
  key_hbm: Any
  value_hbm: Any
  kbuf: Any  # [2, n, Hb, page, D]
  vbuf: Any  # [2, n, Hb, page, Dv]
  sems: Any  # DMA semaphores [2, 3]: a slot's keys, values and scales
  scale_hbm: Any = None  # [max_seqs, Hl, NB, 2 Hb, E] f32 (`paged.block_scales`)
  sbuf: Any = None  # [2, 2 Hb, E] f32


class Copies(NamedTuple):
  """A block's copies into one buffer slot."""

  pages: list[tuple[Any, Any]]  # each page's (condition: the list holds it, copy)
  full: Any  # the list holds every entry of the block
  run: Any  # ... and their pages are consecutive in the pool (None: one page a block)
  runs: list[Any]  # then: one copy a buffer (keys, values) of all n pages ([]: one page)
  scales: Any = None  # the block's scales' copy (a quantized pool), whatever the list holds


def block_copies(spec: Any, refs: Refs, t: Any, h: Any, j: Any, slot: Any) -> Copies:
  """The copies of (tile t, list head h)'s block j (`spec`: the kernel's `paged_kernel.Spec`)
  into buffer `slot`: each page's, only entries the list holds are copied; and the block's
  pages as one copy a buffer, for when they are consecutive."""
  at = refs.seq[t] * spec.list_heads + h
  count = refs.count[at]
  heads = pl.ds(h * spec.block_heads, spec.block_heads)
  pairs = ((refs.key_hbm, refs.kbuf), (refs.value_hbm, refs.vbuf))
  found, pages = [], []
  for i in range(spec.pages_per_block):
    entry = j * spec.pages_per_block + i
    pages.append(jnp.clip(refs.blocks[at * spec.entries + jnp.minimum(entry, spec.entries - 1)],
                          0, spec.num_pages - 1))
    found += [(entry < count, pltpu.make_async_copy(hbm.at[pages[i], heads], buf.at[slot, i],
                                                    refs.sems.at[slot, c]))
              for c, (hbm, buf) in enumerate(pairs)]
  full = (j + 1) * spec.pages_per_block <= count
  scales = None if refs.sbuf is None else pltpu.make_async_copy(
      refs.scale_hbm.at[refs.seq[t], h, j], refs.sbuf.at[slot], refs.sems.at[slot, 2])
  if spec.pages_per_block == 1:
    return Copies(found, full, None, [], scales)
  run = pages[1] == pages[0] + 1
  for before, after in zip(pages[1:], pages[2:]):
    run = run & (after == before + 1)
  first = pl.ds(jnp.minimum(pages[0], spec.num_pages - spec.pages_per_block),
                spec.pages_per_block)  # (a run's first page: the same)
  runs = [pltpu.make_async_copy(hbm.at[first, heads], buf.at[slot], refs.sems.at[slot, c])
          for c, (hbm, buf) in enumerate(pairs)]
  return Copies(found, full, run, runs, scales)


def start(copies: Copies) -> None:
  """A block's copies started: where the list holds every entry, all at once (a branch a copy
  cost a step about as much as its copies), one a buffer where its pages are consecutive;
  else each listed page's."""
  if copies.scales is not None:
    copies.scales.start()
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


def wait(copies: Copies, refs: Refs, slot: Any) -> None:
  """A block's copies waited for: where the list holds every entry, once a buffer (a copy of
  the whole buffer onto itself stands for its pages' copies, or its run's, on the semaphore),
  else each under its condition."""
  if copies.scales is not None:
    copies.scales.wait()

  @pl.when(copies.full)
  def _():
    for c, buf in enumerate((refs.kbuf, refs.vbuf)):
      pltpu.make_async_copy(buf.at[slot], buf.at[slot], refs.sems.at[slot, c]).wait()

  @pl.when(~copies.full)
  def _():
    for holds, copy in copies.pages:
      pl.when(holds)(copy.wait)
