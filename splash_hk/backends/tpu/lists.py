"""The TPU backend's calls on chosen blocks (`masks.Blocks`): the block-list kernel.

The choice's map of block pairs becomes lists of key blocks per (batch row, list head, query
tile) (`xla_lists.tables`, the gathered tiles' own) and each kv head's chosen pairs sorted by key
block for the dK/dV kernel (`pairs`, `list_dkv`);
the inputs go head-major and padded to whole blocks (padding in segments -1 / -2 of its own);
the kernels (`tpu_lists`) run under a custom VJP whose residuals are the output and lse.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from splash_hk.backends import base
from splash_hk.backends.tpu import list_dkv
from splash_hk.backends.tpu import list_kernel as tpu_lists
from splash_hk.backends.xla import lists as xla_lists
from splash_hk.masks import _plan
from splash_hk.types import Facts, KernelInputs, KernelOutput



def vmem_bytes(block_q: int, block_kv: int, head_dim: int, value_dim: int, itemsize: int,
               heads: int = 1) -> int:
  """The largest of the three kernels' VMEM per grid step, estimated, for programs of `heads`
  query heads: the forward / dq's m listed blocks (`list_kernel.STEP_KEYS`) or dK/dV's block,
  the heads' q, dO, out / dq tiles and their lse, delta and softmax state (measured on a v5e,
  before the forward stacked its heads' rows: f32, tiles 512 / 512, 4 heads a program: 18.4
  MiB, over the 16 MiB of scoped VMEM)."""
  width = head_dim + value_dim
  keys = block_kv * tpu_lists.step_blocks(block_q, block_kv, block_q)  # a dq step's (the most)
  stacked = block_kv * tpu_lists.step_blocks(block_q, block_kv, heads * block_q)  # a forward's
  blocks = 2 * itemsize * (heads * block_q * (width + head_dim) + keys * width)
  lanes = (2 * 4 * block_q * (2 * heads + 1) * tpu_lists.LANES
           + 2 * 4 * tpu_lists.SUBLANES * keys)  # lse, delta / softmax state, segment ids
  scratch = 4 * max(heads * block_q * (2 * tpu_lists.LANES + value_dim), block_kv * width)
  scores = max(2 * 4 * heads * block_q * stacked,  # the forward's stacked logits and p in f32
               4 * 4 * block_q * block_kv)  # dq's and dK/dV's s, p, dp, ds of a head
  return blocks + lanes + scratch + scores


def program_heads(block_q: int, block_kv: int, head_dim: int, value_dim: int, itemsize: int,
                  groups: int) -> int:
  """Query heads a forward / dq program serves where lists serve whole groups: the group, one
  copy of a block for all of it, where its tiles fit `list_kernel.VMEM_BUDGET`; else one."""
  need = vmem_bytes(block_q, block_kv, head_dim, value_dim, itemsize, groups)
  return groups if need <= tpu_lists.VMEM_BUDGET else 1


def why_not(facts: Facts) -> str | None:
  """Why the block-list kernel cannot serve a call whose rule holds a choice, or None."""
  found = xla_lists.split_choice(facts.rule)
  if found is None:
    return "the chosen blocks are combined with `|` or with another choice"
  choice, rest = found
  if rest is not None and not rest.is_static():
    return "the rule beside the chosen blocks holds arrays (only position rules join the kernel)"
  if facts.bias is not None:
    return "a `bias` was given, and the block-list kernel takes none"
  if not facts.default_positions:
    return ("explicit q_positions / kv_positions were given (the block-list kernel's rules read "
            "the end-aligned default positions)")
  if facts.query_slices > 1 or facts.load_balanced:
    return "the query sequence is sharded (the block-list kernel runs on whole sequences)"
  bq, bk = choice.block_size
  if bq % tpu_lists.SUBLANES or bk % tpu_lists.LANES:
    return (f"Blocks.block_size {choice.block_size}: the block-list kernel needs bq a multiple "
            f"of {tpu_lists.SUBLANES} and bk of {tpu_lists.LANES} (Mosaic's tiling)")
  need = vmem_bytes(bq, bk, facts.head_dim, facts.value_dim, 4)
  if need > tpu_lists.VMEM_BUDGET:
    return (f"Blocks.block_size {choice.block_size} with head dims {facts.head_dim}/"
            f"{facts.value_dim} needs about {need / 2 ** 20:.1f} MiB of VMEM per step, over "
            f"the kernel's {tpu_lists.VMEM_BUDGET / 2 ** 20:.0f} MiB")
  return None


def _lists(x: KernelInputs) -> tuple[xla_lists.Layout, jax.Array, jax.Array]:
  """The layout, lists [B, L, nq, K] (past a count: a valid block, never read; a block every
  pair of which its tile sees, `FULL` flagged: `list_kernel.block_of`) and counts [B, L, nq]."""
  choice, rest = xla_lists.choice_of(x)
  lay = xla_lists.layout(x, choice)
  lists = xla_lists.tables(choice, lay).lists[:, :, :lay.rows]  # [B, L, nq, K], nk: empty
  counts = jnp.sum(lists < lay.kv_blocks, axis=-1, dtype=jnp.int32)  # [B, L, nq]
  lists = jnp.minimum(lists, lay.kv_blocks - 1)
  blocks = _plan.plan_blocks(x.q_positions, x.kv_positions, x.q_segment_ids, x.kv_segment_ids,
                             lay.block_q, lay.block_kv)
  _, full = _plan.blocks_see(rest, blocks)  # [B|1, nq, nk]: segments, padding and the rule
  b = jnp.arange(lay.batch)[:, None, None, None] % full.shape[0]  # [B, 1, 1, 1]
  flags = full[b, jnp.arange(lay.rows)[:, None], lists]  # [B, L, nq, K]: no [B, L, nq, nk]
  return lay, lists + tpu_lists.FULL * flags, counts


def pairs(lists: jax.Array, counts: jax.Array, kv_blocks: int, groups: int,
          list_group: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each kv head's chosen (key block, head of its group, query tile) triples, sorted by key
  block (then head, then tile), for the dK/dV kernel (`list_dkv`): lists [B, L, nq, K] and
  counts [B, L, nq] (L list heads of `list_group` heads; `groups` heads a kv head; a head here
  is a program head, the query heads one list serves together) -> blocks [B, Hkv, P] and rows
  [B, Hkv, P] (head g, tile r: g * nq + r; plus `FULL` where the list entry has it), P =
  groups * nq * K, and how many there are [B, Hkv]; past the count, the last one again."""
  batch, _, rows, most = lists.shape
  heads = jnp.arange(lists.shape[1] * list_group) // list_group  # each query head's list head
  lists, counts = lists[:, heads], counts[:, heads]  # [B, H, nq, K], [B, H, nq]
  flags = (lists >= tpu_lists.FULL).reshape(batch, -1, groups * rows * most)
  lists = tpu_lists.block_of(lists)
  held = jnp.arange(most) < counts[..., None]  # [B, H, nq, K]
  block = jnp.where(held, lists, kv_blocks).reshape(batch, -1, groups * rows * most)
  row = jnp.broadcast_to(jnp.arange(groups * rows)[:, None], (groups * rows, most))
  order = jnp.argsort(block * (groups * rows) + row.reshape(-1), axis=-1,
                      stable=True)  # [B, Hkv, P]
  count = jnp.sum(block < kv_blocks, axis=-1, dtype=jnp.int32)  # [B, Hkv]
  upto = jnp.minimum(jnp.arange(block.shape[-1]), jnp.maximum(count - 1, 0)[..., None])
  order = jnp.take_along_axis(order, upto, axis=-1)  # past the count: the last pair again
  blocks = jnp.minimum(jnp.take_along_axis(block, order, axis=-1), kv_blocks - 1)
  full = jnp.take_along_axis(flags, order, axis=-1) * tpu_lists.FULL
  return blocks.astype(jnp.int32), (order // most + full).astype(jnp.int32), count


def _spec(x: KernelInputs, facts: Facts, lay: xla_lists.Layout) -> tpu_lists.Spec:
  _, rest = xla_lists.choice_of(x)
  groups = lay.num_heads // lay.num_kv_heads
  whole_groups = lay.group % groups == 0  # each list serves whole groups: a program per kv head
  per_program = (program_heads(lay.block_q, lay.block_kv, facts.head_dim, facts.value_dim,
                               x.query.dtype.itemsize, groups) if whole_groups else 1)
  return tpu_lists.Spec(lay.block_q, lay.block_kv, lay.query_len, lay.kv_len, groups, lay.group,
                        per_program, facts.scale,
                        facts.config.logits_soft_cap, rest, facts.config.interpret)


def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
  """The block-list kernel on one call: KernelInputs -> out [B, T, Hq, Dv]."""
  lay, lists, counts = _lists(x)
  spec = _spec(x, facts, lay)
  t_pad, s_pad = lay.rows * lay.block_q, lay.kv_blocks * lay.block_kv
  q_seg, kv_seg = base.disjoint_padding(*base.segment_ids(x))  # [B, T], [B, S]
  q_seg = jnp.broadcast_to(base.pad_axis(q_seg, 1, t_pad, -1)[..., None],
                           (lay.batch, t_pad, tpu_lists.LANES))  # [B, Tp, 128]
  kv_seg = jnp.broadcast_to(base.pad_axis(kv_seg, 1, s_pad, -2)[:, None],
                            (lay.batch, tpu_lists.SUBLANES, s_pad))  # [B, 8, Sp]
  head_major = lambda a, size: base.pad_axis(base.to_bhtd(a), 2, size)
  q = head_major(x.query, t_pad)  # [B, Hq, Tp, D]
  k, v = head_major(x.key, s_pad), head_major(x.value, s_pad)  # [B, Hkv, Sp, D|Dv]
  sinks = (jnp.full((lay.num_heads, 1), -jnp.inf, jnp.float32) if x.sinks is None
           else x.sinks)  # [Hq, n]
  out = _attend(spec, lists, counts, q_seg, kv_seg, q, k, v, sinks)  # [B, Hq, Tp, Dv]
  return KernelOutput(base.to_bhtd(out[:, :, :lay.query_len]).astype(x.query.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(spec, lists, counts, q_seg, kv_seg, q, k, v, sinks):
  return _forward(spec, lists, counts, q_seg, kv_seg, q, k, v, sinks)[0]


def _forward(spec, lists, counts, q_seg, kv_seg, q, k, v, sinks):
  heads = base.sink_logsumexp(sinks)  # [Hq]
  row = jnp.broadcast_to(heads[None], (tpu_lists.SUBLANES, heads.shape[0]))  # [8, Hq]
  out, lse = tpu_lists.forward(spec, lists, counts, q, k, v, q_seg, kv_seg, row)
  return out, (lists, counts, q_seg, kv_seg, q, k, v, sinks, out, lse)


def _backward(spec, saved, d_out):
  lists, counts, q_seg, kv_seg, q, k, v, sinks, out, lse = saved
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, Hq, Tp]
  lanes = lambda a: jnp.broadcast_to(a[..., None], (*a.shape, tpu_lists.LANES))
  dq = tpu_lists.dq(spec, lists, counts, q, k, v, q_seg, kv_seg, lse, lanes(delta), d_out)
  n = spec.per_program  # query heads a program head: one list, one copy of a block
  pair_blocks, pair_rows, pair_count = pairs(lists, counts, k.shape[2] // spec.block_kv,
                                             spec.groups // n, spec.list_group // n)
  dk, dv = list_dkv.dkv(spec, pair_blocks, pair_rows, pair_count, q, k, v, q_seg, kv_seg, lse,
                        lanes(delta), d_out)
  d_sinks = base.sink_grads(sinks, base.to_bhtd(lse[..., 0]), base.to_bhtd(delta))  # [Hq, n]
  return None, None, None, None, dq, dk, dv, d_sinks.astype(sinks.dtype)


_attend.defvjp(_forward, _backward)
