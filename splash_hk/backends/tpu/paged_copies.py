"""The paged kernel's copies (`paged_kernel`): a block's run of pages from the pool in HBM into
a VMEM buffer, a page's slab [Hb, page, X] a copy, started a working step ahead and waited for
where it is used (two buffers, a slot each)."""

from __future__ import annotations

from typing import Any

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp


Copies = tuple[list[tuple[Any, Any]], Any]  # each page's (condition, copy); all listed


def block_copies(spec: Any, refs: Any, t: Any, h: Any, j: Any, slot: Any) -> Copies:
  """The (condition, copy) of each page of (tile t, list head h)'s block j (`spec`: the kernel's
  `paged_kernel.Spec`) into buffer `slot`
  (only entries the list holds are copied), and whether the list holds all of them."""
  seq_ref, blocks_ref, count_ref, key_hbm, value_hbm, kbuf, vbuf, sems = refs
  at = seq_ref[t] * spec.list_heads + h
  count = count_ref[at]
  heads = pl.ds(h * spec.block_heads, spec.block_heads)
  found = []
  for i in range(spec.pages_per_block):
    entry = j * spec.pages_per_block + i
    page = jnp.clip(blocks_ref[at * spec.entries + jnp.minimum(entry, spec.entries - 1)], 0,
                    spec.num_pages - 1)
    found += [(entry < count, pltpu.make_async_copy(hbm.at[page, heads], buf.at[slot, i],
                                                    sems.at[slot, c]))
              for c, (hbm, buf) in enumerate(((key_hbm, kbuf), (value_hbm, vbuf)))]
  return found, (j + 1) * spec.pages_per_block <= count


def start(copies: Copies) -> None:
  """A block's copies started: all at once where the list holds every entry (a branch a copy
  cost a grid step about as much as its copies), else each under its condition."""
  found, full = copies

  @pl.when(full)
  def _():
    for _, copy in found:
      copy.start()

  @pl.when(~full)
  def _():
    for holds, copy in found:
      pl.when(holds)(copy.start)


def wait(copies: Copies, buffers: tuple[Any, Any], sems: Any, slot: Any) -> None:
  """A block's copies waited for: where the list holds every entry, once a buffer (a copy of
  the whole buffer onto itself stands for the sum of its pages' copies on the semaphore), else
  each under its condition."""
  found, full = copies

  @pl.when(full)
  def _():
    for c, buf in enumerate(buffers):
      pltpu.make_async_copy(buf.at[slot], buf.at[slot], sems.at[slot, c]).wait()

  @pl.when(~full)
  def _():
    for holds, copy in found:
      pl.when(holds)(copy.wait)
