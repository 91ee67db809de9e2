"""Which calls the xla backend's gathered tiles serve, and their lists of key blocks.

A call whose rule is `masks.Blocks` (alone or `&` position rules) has its choice's map of block
pairs compacted here into per-row lists for `xla_gather`; `Layout` holds the static shapes.
Glossary as in `xla_gather`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from splash_hk.backends import base
from splash_hk.masks._chosen import Blocks
from splash_hk.masks._mask import And, Mask
from splash_hk.masks._objects import Causal
from splash_hk.tiles import MIN_CHOSEN_ROWS
from splash_hk.types import Facts, KernelInputs



def split_choice(rule: Mask | None) -> tuple[Blocks, Mask | None] | None:
  """(the choice by index, the rest of the rule) of a rule `Blocks` or `Blocks & rest` (&
  chains), or None for any other rule; a causal choice's rule joins the rest."""
  if isinstance(rule, Blocks):
    return (rule.choice(), Causal()) if rule.causal else (rule, None)
  if not isinstance(rule, And):
    return None
  for this, other in ((rule.a, rule.b), (rule.b, rule.a)):
    found = split_choice(this)
    if found is not None and not any(isinstance(p, Blocks) for p in other.parts()):
      choice, rest = found
      return choice, other if rest is None else rest & other
  return None


def chooses(facts: Facts) -> bool:
  """Whether the call's rule holds key blocks chosen by data."""
  return facts.rule is not None and any(isinstance(p, Blocks) for p in facts.rule.parts())


def choice_of(x: KernelInputs) -> tuple[Blocks, Mask | None]:
  found = split_choice(x.rule)
  assert found is not None, "the gathered tiles serve only calls `why_not` lets through"
  return found


def why_not(facts: Facts) -> str | None:
  """Why the gathered tiles cannot serve a call whose rule holds a choice (it then runs on the
  block plan, the choice skipping blocks there), or None."""
  found = split_choice(facts.rule)
  if found is None:
    return "the chosen blocks are combined with `|` or with another choice"
  rest = found[1]
  if rest is not None and not rest.is_static():
    return "the rule beside the chosen blocks holds arrays (only position rules join the tiles)"
  dense_bias = facts.bias is not None and bool(facts.bias.array_sides() & {"q", "kv", "qk"})
  for asked, what in ((dense_bias, "a `bias` holding per-token arrays"),
                      (facts.explicit_dropout, "an explicit `dropout_mask`"),
                      (bool(facts.quantized), "quantized inputs"),
                      (facts.query_slices > 1, "a sequence-sharded query"),
                      (facts.load_balanced, "a load-balanced sequence")):
    if asked:
      return f"{what} (served on the block plan)"
  return None


@dataclasses.dataclass(frozen=True)
class Layout:
  """The static shapes of one shard's gathered call."""

  batch: int
  query_len: int  # T (this shard's)
  kv_len: int  # S
  num_heads: int  # Hq
  num_kv_heads: int  # Hkv
  list_heads: int  # L
  block_q: int  # bq
  block_kv: int  # bk
  most: int  # K

  @property
  def rows(self) -> int:  # nq
    return -(-self.query_len // self.block_q)

  @property
  def per_item(self) -> int:  # R
    return max(1, MIN_CHOSEN_ROWS // self.block_q)  # the block plan's rows for a choice, too

  @property
  def items(self) -> int:
    return -(-self.rows // self.per_item)

  @property
  def padded_q(self) -> int:
    return self.items * self.per_item * self.block_q

  @property
  def kv_blocks(self) -> int:  # nk
    return -(-self.kv_len // self.block_kv)

  @property
  def group(self) -> int:  # Gl
    return self.num_heads // self.list_heads


def layout(x: KernelInputs, choice: Blocks) -> Layout:
  batch, query_len, num_heads, _ = x.query.shape
  kv_len, num_kv = x.key.shape[1:3]
  shared = choice.kv_blocks.shape[1] in (1, num_kv) or num_kv == num_heads
  return Layout(batch, query_len, kv_len, num_heads, num_kv, num_kv if shared else num_heads,
                *choice.block_size, choice.kv_blocks.shape[-1])


class Tables(NamedTuple):
  """Each shard row's lists, compacted from the choice's map (a pytree)."""

  lists: jax.Array  # [B, L, nq_all, K] int32: listed blocks, then nk (the empty block)
  rows: jax.Array  # [B, items * R] int32: the choice row of each of this shard's query blocks


def tables(choice: Blocks, lay: Layout) -> Tables:
  """The lists of this shard's batch rows and list heads, from the map `choice.chosen`."""
  chosen = choice.chosen  # [B|1, Hq, nq_all, nk]
  row, r = choice.query_rows(jnp)  # [B, T] global batch row and choice row of each query
  chosen = chosen[row[:, 0]] if chosen.shape[0] > 1 else jnp.broadcast_to(
      chosen, (lay.batch, *chosen.shape[1:]))
  chosen = chosen[:, ::lay.group]  # [B, L, nq_all, nk]: a group's heads share their rows
  place = jnp.where(chosen, jnp.cumsum(chosen, axis=-1) - 1, lay.most)  # [B, L, nq_all, nk]
  b, h, q = (jnp.arange(n)[:, None, None, None] for n in chosen.shape[:3])
  lists = jnp.full((*chosen.shape[:3], lay.most + 1), lay.kv_blocks, jnp.int32)
  lists = lists.at[b, h.reshape(1, -1, 1, 1), q.reshape(1, 1, -1, 1), place].set(
      jnp.broadcast_to(jnp.arange(lay.kv_blocks, dtype=jnp.int32), chosen.shape))
  first = base.pad_axis(r[:, ::lay.block_q], 1, lay.items * lay.per_item)  # [B, items * R]
  return Tables(lists[..., :lay.most], first)
