"""The xla path's tiles, spelled once: its backend tiles with them, `shard_work` counts with them.

(The TPU kernel's tiles are its own: `splash_hk.backends.tpu.tiles`.)
Why these sizes (figures in docs/guide/performance.md; the bench's `--tiles` measures them):
512-row query blocks keep XLA's batched dots on both cores of a small CPU, where
256-row ones ran on about one; 256-key blocks halve the masked diagonal of causal
masks for the same work, and 512 x 512 blocks' logits outgrow the cache. On a TPU a call of a
few query rows (decode) reads its keys in one long block: each loop step costs more than its
work. A sliding
window narrower than 512 gets query blocks about its span, so few keys outside it
are computed. A sequence shard takes 256-row query blocks: its devices already share
the cores, and a ring step holds half the working set.
"""

from __future__ import annotations

import jax

from splash_hk.config import AttentionConfig
from splash_hk.masks import _objects
from splash_hk.masks._chosen import Blocks
from splash_hk.types import Facts

Tiles = tuple[int, int, int, int]  # (block_q, block_kv, block_q_bwd, block_kv_bwd)
FEW_ROWS = 8  # a call of at most this many query rows (decode, a verification of drafts) ...
FEW_ROWS_KEYS = 16384  # ... reads its keys in blocks of this many: one block for most caches
MIN_CHOSEN_ROWS = 128  # query rows of a chosen call's tiles (block plan) and work items (gathered)


def default_tiles(config: AttentionConfig) -> Tiles:
  """The xla path's default tiles for `config`: (block_q, block_kv, block_q_bwd, block_kv_bwd)."""
  fwd_q, fwd_kv, bwd_q, bwd_kv = 512, 256, 512, 256
  if config.window is not None:
    span = config.window[0] + config.window[1] + 1
    fwd_q = bwd_q = max(128, min(512, 1 << (span.bit_length() - 1)))
  return fwd_q, fwd_kv, bwd_q, bwd_kv


def on_tpu() -> bool:
  """Whether this process computes on a TPU, where a loop step costs more than reading a long
  block (`few_rows_keys`); on a CPU the opposite holds (one block of 8192 keys at T = 1 took
  2x the 256-key blocks' time)."""
  return jax.default_backend() == "tpu"


def few_rows_keys(facts: Facts, default: int) -> int:
  """A call of a few rows (decode): its key block as long as the keys its rows may see, up to
  `FEW_ROWS_KEYS` (a loop step costs more than reading a long block; measured on a TPU, T = 1
  over 32 caches of 8192 keys: one block 2.1 ms, as jax.nn's xla; blocks of 1024 keys 5.6 ms).
  A window or a chunk bounds the span (blocks outside it are skipped, as before); a rule config
  cannot say keeps `default`."""
  rules = _objects.as_rules(facts.rule)
  if rules is None:
    return default
  span = rules["chunk_size"] or (sum(rules["window"]) + 1 if rules["window"] else None)
  if span is None:
    return FEW_ROWS_KEYS
  return max(default, min(FEW_ROWS_KEYS, -(-(span + facts.query_len) // default) * default))


def chosen_tiles(facts: Facts) -> tuple[int, int] | None:
  """A call whose rule holds key blocks chosen by data (`masks.Blocks`): tiles of its blocks, so
  work follows the choice block for block (query tiles of at least 128 rows: a choice per token
  shares a tile with its neighbours', the element mask telling them apart). None otherwise."""
  parts = () if facts.rule is None else facts.rule.parts()
  sizes = [part.block_size for part in parts if isinstance(part, Blocks)]
  if not sizes:
    return None
  bq, bk = sizes[0]
  return bq * max(1, MIN_CHOSEN_ROWS // bq), bk


def tiles_for(facts: Facts) -> Tiles:
  """A call's xla tiles: `config.block_sizes` where set, else the defaults (a choice's own blocks:
  `chosen_tiles`), with 256-row query blocks for a query cut into sequence slices, and blocks
  within one chunk (T / 2n) in a load-balanced sequence (sliced or whole, as under Ulysses)."""
  fwd_q, fwd_kv, bwd_q, bwd_kv = default_tiles(facts.config)
  chosen = chosen_tiles(facts)
  if chosen is not None:
    fwd_q, fwd_kv = bwd_q, bwd_kv = chosen
  if facts.query_slices > 1:
    fwd_q, bwd_q = min(fwd_q, 256), min(bwd_q, 256)
  if facts.query_len <= FEW_ROWS and chosen is None and on_tpu():
    fwd_kv = few_rows_keys(facts, fwd_kv)

  defaults = (fwd_q, fwd_kv, bwd_q, bwd_kv)
  if facts.load_balanced and facts.sequence_shards > 1:
    chunk = facts.query_len // (2 * facts.sequence_shards)
    defaults = (min(fwd_q, chunk), min(fwd_kv, chunk), min(bwd_q, chunk), min(bwd_kv, chunk))
  return facts.config.block_sizes.resolve(*defaults)
