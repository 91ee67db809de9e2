"""The xla backend's masked blocks: p @ v kept from invisible garbage (DESIGN's "Invisible means
absent": 0 * NaN must not reach a row that does not see the NaN), at the cost of one reduction
of the block's output where the values are clean."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from splash_hk.backends import base


def visible_garbage(p_v: jax.Array, pv: jax.Array, mask: jax.Array, v: jax.Array | None,
                     v_scale: jax.Array | None, in_place: bool) -> jax.Array:
  """p @ v of a masked block, kept from invisible garbage: where `pv` (of the raw values) is
  finite no value it read was non-finite, and it stands; else (a rare case) it is recomputed
  with non-finite values zeroed (0 * NaN must not reach rows that do not see them) and NaN put
  in each value column of the rows that see a non-finite value there.

  `p_v`: the probabilities as multiplied (v's dtype). `v` None: integer values, always finite
  (only their per-token scales, [r, Hkv, 1, 1, bk], already zeroed in `p_v` where not finite,
  are checked). One reduction of the block's output, cheaper than any over its values. The
  branch gets the values as the caller holds them (`in_place`: [r, bk, Hkv, Dv]): given them
  as [r, Hkv, bk, Dv], XLA copied a decode's whole cache into that layout for it.
  """
  def poison(pv, raw):
    bad = jnp.zeros((), jnp.bool_)
    if raw is not None:
      v = jnp.swapaxes(raw, 1, 2) if in_place else raw  # [r, Hkv, bk, Dv]
      pv = jnp.einsum("bkgqs,bksd->bkgqd", p_v, base.finite(v),
                      preferred_element_type=jnp.float32)
      bad = ~jnp.isfinite(v)  # [r, Hkv, bk, Dv]
    if v_scale is not None:  # a non-finite scale spoils its token's whole value
      bad = bad | ~jnp.isfinite(jnp.swapaxes(v_scale[:, :, 0], -1, -2))
    seen = jnp.einsum("bkgqs,bksd->bkgqd", jnp.broadcast_to(mask, pv.shape[:4] + mask.shape[-1:])
                      .astype(jnp.float32), bad.astype(jnp.float32))
    return jnp.where(seen > 0, jnp.nan, pv)

  clean = jnp.all(jnp.isfinite(pv))
  if v_scale is not None:
    clean = clean & jnp.isfinite(jnp.sum(v_scale))
  raw = None if v is None else (jnp.swapaxes(v, 1, 2) if in_place else v)
  return jax.lax.cond(clean, lambda pv, raw: pv, poison, pv, raw)
