"""Static configuration: frozen, hashable, so it can be a static argument under jit."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk import platforms

Platform = str  # "auto" or a registered backend's name (`platforms.names()`)


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def static(name: str, value: Any, instead: str = "") -> Any:
  """`value` of the static field `name`: a concrete 0-d array as a Python scalar; a traced value
  is a ValueError saying to pass it static (`instead`: what else the user may do)."""
  if isinstance(value, jax.core.Tracer):
    raise ValueError(
        f"`{name}` is static (kernels and block plans are built from it at trace time) and got a "
        f"traced value ({value.aval}): pass it as a Python value, e.g. a module hyperparameter or "
        f"through jax.jit(..., static_argnums=...) / static_argnames{instead}.")
  if isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(value) == 0:
    return value.item()
  return value


def traced(tree: Any) -> bool:
  """Whether a leaf of `tree` is traced (under jit, vmap, scan): its values are not known now."""
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def staged(tree: Any) -> bool:
  """Whether `tree` is traced or a jit is tracing here (a new constant is then its tracer):
  what the call computes then joins the caller's program."""
  return traced(tree) or isinstance(jnp.zeros((), jnp.int32), jax.core.Tracer)


def known_now(x: Any) -> np.ndarray | None:
  """x's values if they are known now (eager), else None (traced)."""
  return None if traced(x) else np.asarray(x)


def require_int(name: str, value: Any, minimum: int = 1, allow_none: bool = False) -> None:
  """Raises ValueError naming `name` unless `value` is an int >= `minimum` (or None if allowed)."""
  if value is None and allow_none:
    return
  static(name, value)
  if not _is_int(value) or value < minimum:
    bound = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    raise ValueError(f"`{name}` must be {bound}{' or None' if allow_none else ''}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the block-sparse kernels; None lets each backend use its tuned default.

  `block_q`/`block_kv` tile the forward pass, `*_bwd` the backward pass;
  `block_kv_compute` (`_bwd`: the backward's dK/dV) is the run of keys the TPU
  kernel computes at once inside a `block_kv` tile (it divides it; unset: the
  whole tile, or the table's). The defaults: XLA path,
  `splash_hk.tiles.default_tiles` (why: docs/guide/performance.md); TPU, the
  table measured on the chip (`splash_hk.backends.tpu.tiles`: the tuning cache
  of `python -m splash_hk.tune`, then the shipped table, then its rule); Triton,
  ejkernel's GPU heuristics (64 forward, 32 backward).
  """

  block_q: int | None = None
  block_kv: int | None = None
  block_q_bwd: int | None = None
  block_kv_bwd: int | None = None
  block_kv_compute: int | None = None
  block_kv_compute_bwd: int | None = None

  def __post_init__(self) -> None:
    for field in dataclasses.fields(self):
      name = f"BlockSizes.{field.name}"
      value = static(name, getattr(self, field.name))
      require_int(name, value, allow_none=True)
      object.__setattr__(self, field.name, value)

  def resolve(self, block_q: int, block_kv: int, block_q_bwd: int | None = None,
              block_kv_bwd: int | None = None) -> tuple[int, int, int, int]:
    """(block_q, block_kv, block_q_bwd, block_kv_bwd) with the given defaults where unset.

    An unset backward tile follows the forward tile when it is set, else its default.
    """
    fwd_q = self.block_q or block_q
    fwd_kv = self.block_kv or block_kv
    bwd_q = self.block_q_bwd or (self.block_q or block_q_bwd or fwd_q)
    bwd_kv = self.block_kv_bwd or (self.block_kv or block_kv_bwd or fwd_kv)
    return fwd_q, fwd_kv, bwd_q, bwd_kv


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """What to compute (mask, scale, soft cap) and how (platform, blocks).

  Attributes:
    causal: key j is visible to query i only if `kv_pos[j] <= q_pos[i]`.
    sliding_window: `w` or `(left, right)`: key j is visible to query i only if
      `q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right`; `w` means `(w, w)` and is
      stored as that pair, so equal windows make equal (and equally hashed) configs.
    chunk_size: chunked attention (Llama-4): visible only within the same
      `pos // chunk_size` chunk.
    logits_soft_cap: `c` maps logits `l` to `c * tanh(l / c)` before masking.
    softmax_scale: logits are `softmax_scale * q.k`; default `D ** -0.5`.
    runtime_dtype: if set, query/key/value are cast to it and the output has it.
    block_sizes: kernel tiles.
    platform: "auto" (the best backend for the hardware) or a backend's name:
      "splash", "triton", "xla", "reference" (`splash_hk.platforms`).
    allow_fallback: if False, any fallback raises ValueError with its reason.
    interpret: run the Pallas splash kernel in interpret mode (CPU).
    fused_backward: ask kernels that have one for their fused backward pass (True) or for
      dq and dK/dV apart (False); None (default): each kernel's measured choice (on TPU the
      tile table's, fused where it measured faster; elsewhere apart).
    dropout_rate: attention dropout on the normalised probabilities, in [0, 1): each
      visible pair kept with probability 1 - rate and scaled by 1 / (1 - rate), decided by
      `splash_hk.dropout_mask`'s hash (a call passes `dropout_rng`); 0 is the program of a
      call without dropout.
    causal_stated: whether `causal` was stated (given to the constructor or to `replace`)
      rather than left at its default: a mask object is the whole rule, and a stated `causal`
      beside one is refused, never ignored. Set by the constructor; not for callers.
  """

  causal: bool = True
  sliding_window: int | tuple[int, int] | None = None  # stored as (left, right)
  chunk_size: int | None = None
  logits_soft_cap: float | None = None
  softmax_scale: float | None = None
  runtime_dtype: Any = None
  block_sizes: BlockSizes = BlockSizes()
  platform: Platform = "auto"
  allow_fallback: bool = True
  interpret: bool = False
  fused_backward: bool | None = None
  dropout_rate: float = 0.0
  causal_stated: bool = dataclasses.field(default=False, repr=False)

  def __post_init__(self) -> None:
    set_ = lambda name, value: object.__setattr__(self, name, value)
    set_("causal_stated", bool(self.causal_stated))
    for name in ("causal", "chunk_size", "logits_soft_cap", "softmax_scale"):
      set_(name, static(name, getattr(self, name), _INSTEAD.get(name, "")))
    if not isinstance(self.causal, bool):
      raise ValueError(f"causal must be a bool, got {self.causal!r}.")
    set_("sliding_window", window_pair(self.sliding_window))
    require_int("chunk_size", self.chunk_size, allow_none=True)
    for name in ("logits_soft_cap", "softmax_scale"):
      value = getattr(self, name)
      if value is None:
        continue
      if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}.")
      set_(name, float(value))
    if self.runtime_dtype is not None:
      dtype = jnp.dtype(self.runtime_dtype)
      if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"runtime_dtype must be a floating dtype, got {dtype}.")
      set_("runtime_dtype", dtype)
    if not isinstance(self.block_sizes, BlockSizes):
      raise ValueError(
          f"block_sizes must be a splash_hk.BlockSizes, got {type(self.block_sizes).__name__}.")
    rate = static("dropout_rate", self.dropout_rate)
    if (not isinstance(rate, (int, float)) or isinstance(rate, bool) or not math.isfinite(rate)
        or not 0 <= rate < 1):
      raise ValueError(f"dropout_rate must be a number in [0, 1), got {rate!r}.")
    set_("dropout_rate", float(rate))
    if self.fused_backward is not None and not isinstance(self.fused_backward, bool):
      raise ValueError(f"fused_backward must be None (the kernel's measured choice) or a bool, "
                       f"got {self.fused_backward!r}.")
    if self.platform not in platforms.names():
      raise ValueError(f"platform must be one of {platforms.names()}, got {self.platform!r}.")

  @property
  def window(self) -> tuple[int, int] | None:
    """The sliding window as (left, right), or None (`sliding_window` is stored normalised)."""
    window = self.sliding_window
    return (window, window) if isinstance(window, int) else window

  def scale(self, head_dim: int) -> float:
    """The logit scale: `softmax_scale`, or `head_dim ** -0.5` when unset."""
    return self.softmax_scale or head_dim**-0.5

  @property
  def rules(self) -> dict[str, Any]:
    """The positional mask rules (causal, window, chunk_size), as keywords of
    `splash_hk.masks._objects.from_rules`, which makes them one mask object."""
    return dict(causal=self.causal, window=self.window, chunk_size=self.chunk_size)

  def replace(self, **changes: Any) -> AttentionConfig:
    """This config with the given fields replaced (and checked again); `causal` given here is
    stated."""
    if "causal" in changes:
      changes.setdefault("causal_stated", True)
    return dataclasses.replace(self, **changes)


def _noting_causal(init: Any) -> Any:
  """The dataclass's `__init__`, noting whether `causal` was given (`causal_stated`); a copy by
  `dataclasses.replace` passes the old note along."""

  @functools.wraps(init)
  def __init__(self, *args: Any, **kwargs: Any) -> None:
    kwargs.setdefault("causal_stated", bool(args) or "causal" in kwargs)
    init(self, *args, **kwargs)

  return __init__


AttentionConfig.__init__ = _noting_causal(AttentionConfig.__init__)  # type: ignore[method-assign]


_INSTEAD = {"softmax_scale": "; for a learnable temperature, multiply the query by it and "
                             "keep softmax_scale fixed"}


def window_pair(window: Any, name: str = "sliding_window",
                allow_none: bool = True) -> tuple[int, int] | None:
  """`w` -> (w, w); (left, right) -> (left, right); None -> None (where allowed). Equal windows
  compare equal."""
  if window is None and allow_none:
    return None
  if isinstance(window, (tuple, list)):
    window = tuple(static(name, w) for w in window)
  else:
    window = static(name, window)
  pair = (window, window) if _is_int(window) else tuple(window) if isinstance(window, (tuple, list)) else ()
  if len(pair) != 2 or not all(_is_int(w) and w >= 0 for w in pair):
    raise ValueError(f"`{name}` must be {'None, ' if allow_none else ''}an int >= 0 or a pair "
                     f"(left, right) of ints >= 0, got {window!r}.")
  return int(pair[0]), int(pair[1])
