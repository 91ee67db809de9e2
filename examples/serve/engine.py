"""The model side of serving: one jitted step over the page pools, the serving loop and its
timings, the same requests as static batches with `KVCache` (the comparison), and the check
that an output is the greedy decode with a full forward (what every served output must be).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import splash_hk as sh
from examples.serve.allocator import PageAllocator
from examples.serve.scheduler import Plan, Refused, Request, Scheduler, SchedulerConfig, Stats
from examples.train import model as model_lib

BUCKET_GROWTH = 4  # a step's token axis is padded to 16, 64, 256, ... (one compile each)
STATIC_ROUND = 64  # static batches: prompt and capacity rounded up to this (one compile each)


@dataclasses.dataclass
class Served:
  """What a run produced and how long it took (times in seconds, from the run's start)."""

  outputs: dict[int, list[int]]  # request id -> its generated tokens
  seconds: float
  first_token: list[float]  # per request: its first token's time after its arrival
  token_gaps: list[float]  # between consecutive tokens of a request
  kv_bytes: int  # the KV the run holds: the page pools, or the static batch's caches
  steps: int
  stats: Stats | None = None  # continuous batching only
  num_pages: int = 0  # continuous batching: the pool's pages per layer
  peak_bytes: int = 0  # continuous batching: the pages in use at the peak
  cancelled: list[int] = dataclasses.field(default_factory=list)  # request ids
  failed: list[int] = dataclasses.field(default_factory=list)  # non-finite activations
  refused: dict[int, str] = dataclasses.field(default_factory=dict)  # id -> reason
  free_at_end: int = 0  # pages free in the pool after the run (all of them: nothing leaked)

  @property
  def tokens(self) -> int:
    return sum(map(len, self.outputs.values()))


def _nbytes(tree: Any) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def token_buckets(step_tokens: int) -> list[int]:
  """The padded sizes of a step's token axis: 16, 64, ... and step_tokens itself."""
  sizes = [16]
  while sizes[-1] * BUCKET_GROWTH < step_tokens:
    sizes.append(sizes[-1] * BUCKET_GROWTH)
  return sorted(set([s for s in sizes if s < step_tokens] + [step_tokens]))


class PagedEngine:
  """The model's serving step over `num_pages` pages per layer (pools donated each step)."""

  def __init__(self, config: model_lib.ModelConfig, params: Any, sched: SchedulerConfig,
               num_pages: int, kv_dtype: Any = jnp.float32, page_top_k: int | None = None,
               drafts: int | None = None):
    """`drafts`: the most drafted tokens a sequence verifies in a step (default
    `sched.speculate`; 0: no draft trees, none of their programs compiled)."""
    self.drafts = sched.speculate if drafts is None else drafts
    forward = hk.without_apply_rng(hk.transform(
        lambda tokens, positions, caches, batch: model_lib.Transformer(config)(
            tokens, positions, caches, batch=batch, page_top_k=page_top_k)))

    def step(params, tokens, positions, caches, batch, verify):
      logits, caches = forward.apply(params, tokens, positions, caches, batch)  # [N, V]
      finite = jnp.all(jnp.isfinite(logits), axis=-1)  # [N]: a NaN in a row's activations
      sampled = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [N]
      if batch.tree is not None:  # verified drafts: each sequence keeps its accepted rows
        path, lens = accepted_paths(tokens, sampled, batch, verify, self.drafts + 1)
        caches = [sh.accept_drafts(cache, batch, path, lens) for cache in caches]
      return sampled, finite, caches  # [N], [N]

    self._step = jax.jit(step, donate_argnums=(3,))
    self._copy = jax.jit(_copy_pages, donate_argnums=(0,))
    self.params, self.sched, self.num_pages = params, sched, num_pages
    self.caches = hk.transform(lambda: model_lib.Transformer(config).init_paged_caches(
        num_pages, sched.page_size, kv_dtype, page_summaries=page_top_k is not None)).apply(
            {}, None)
    self.buckets = token_buckets(sched.step_tokens)

  @property
  def pool_bytes(self) -> int:
    return _nbytes(self.caches)

  def warm_up(self, cascades: tuple[bool, ...] | None = None) -> None:
    """Compiles every bucket (with and/or without a cascade's grouping: `cascades`, default
    the engine's; with speculation, with and without draft trees) and the page copy with calls
    that write nothing."""
    c = self.sched
    groups = (np.zeros((c.max_seqs, c.pages_per_seq), np.int32), np.zeros(c.max_seqs, np.int32),
              np.full(c.max_seqs, -1, np.int32))
    for cascade in cascades or (c.cascade,):
      for tree in (None, np.zeros(0, np.int32)) if self.drafts else (None,):
        empty = Plan(tokens=np.zeros(0, np.int32), positions=np.zeros(0, np.int32),
                     cu_q_lens=np.zeros(c.max_seqs + 1, np.int32),
                     kv_lens=np.zeros(c.max_seqs, np.int32),
                     page_table=np.zeros((c.max_seqs, c.pages_per_seq), np.int32),
                     num_seqs=0, copies=[], work=[], samples=[],
                     prefix=groups if cascade else None, tree=tree)
        jax.block_until_ready(self.run(empty, self.buckets[0])[0])  # pools learn their layers
        for size in self.buckets:
          jax.block_until_ready(self.run(empty, size)[0])
    self._copy_shared([])  # every destination past the pool: nothing is copied

  def _copy_shared(self, copies: list[tuple[int, int]]) -> None:
    """Each (src, dst) page copied in every layer's pool, as one program for any count."""
    src = np.zeros(self.sched.max_seqs, np.int32)
    dst = np.full(self.sched.max_seqs, self.num_pages, np.int32)  # past the pool: dropped
    for i, (a, b) in enumerate(copies):
      src[i], dst[i] = a, b
    self.caches = self._copy(self.caches, src, dst)

  def run(self, plan: Plan, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Copies the plan's pages, runs its step; the sampled token of each row ([n]) and whether
    its logits were finite ([n])."""
    n = len(plan.tokens)
    size = size or next(b for b in self.buckets if b >= n)
    pad = lambda a: np.pad(a, (0, size - n))
    deepest = max((d.depth(r) for d in plan.drafts.values() for r in range(d.rows)), default=0)
    if deepest > self.drafts:
      raise ValueError(f"the plan drafts {deepest} tokens deep and this engine verifies up to "
                       f"{self.drafts}: build it with drafts={deepest} or more.")
    if plan.copies:
      self._copy_shared(plan.copies)
    verify = np.zeros(self.sched.max_seqs, np.bool_)  # sequences verifying drafts
    verify[list(plan.drafts)] = True
    sampled, finite, self.caches = self._step(self.params, pad(plan.tokens),
                                              pad(plan.positions), self.caches,
                                              self._batch(plan, size), verify)
    return np.asarray(sampled)[:n], np.asarray(finite)[:n]

  def _batch(self, plan: Plan, size: int) -> sh.RaggedBatch:
    """The plan's `RaggedBatch` over a token axis of `size` (padding rows: roots)."""
    prefix = None if plan.prefix is None else sh.SharedPrefix(*plan.prefix)
    tree = None if plan.tree is None else np.pad(plan.tree, (0, size - len(plan.tree)),
                                                 constant_values=-1)
    return sh.RaggedBatch(cu_q_lens=plan.cu_q_lens, kv_lens=plan.kv_lens,
                          page_table=plan.page_table, num_seqs=np.int32(plan.num_seqs),
                          prefix=prefix, tree=tree)


def _copy_pages(caches: list[sh.PagedKVCache], src: jax.Array, dst: jax.Array):
  """Page src[i] copied to page dst[i] in every layer's pool (dst past the pool: no copy): its
  keys, values, scales and key bounds, every one of a pool's leaves being per page."""
  return jax.tree.map(lambda a: a.at[dst].set(a[src], mode="drop"), caches)


def accepted_paths(tokens: jax.Array, sampled: jax.Array, batch: sh.RaggedBatch,
                   verify: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  """`drafts.accepted` on the device: (path [max_seqs, width], path_lens [max_seqs]) of the
  sequences that `verify` [max_seqs] (others: none). A row is kept when its token is the greedy
  choice after its parent (`sampled`), and so is every ancestor's (pointer jumping)."""
  n, max_seqs = tokens.shape[0], batch.max_seqs
  rows = jnp.arange(n, dtype=jnp.int32)
  cu = batch.cu_q_lens.astype(jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu[1:], rows, side="right"), 0, max_seqs - 1)  # [N]
  inside = rows < cu[jnp.reshape(batch.num_seqs, ())]
  up = jnp.where(inside & (batch.tree >= 0), cu[seq] + batch.tree, -1)  # [N] global parents
  kept = jnp.where(up >= 0, tokens == sampled[jnp.clip(up, 0, n - 1)], True)
  for _ in range(max(1, (n - 1).bit_length())):
    kept = kept & jnp.where(up >= 0, kept[jnp.clip(up, 0, n - 1)], True)
    up = jnp.where(up >= 0, up[jnp.clip(up, 0, n - 1)], -1)
  kept = kept & inside & verify[seq]
  before = jnp.cumsum(kept) - kept  # [N]: kept rows before each
  rank = before - before[cu[seq]]  # its place on its sequence's path
  at = jnp.where(kept & (rank < width), seq, max_seqs)  # else: dropped
  path = jnp.zeros((max_seqs, width), jnp.int32).at[at, rank].set(rows - cu[seq], mode="drop")
  lens = jnp.zeros((max_seqs,), jnp.int32).at[at].add(1, mode="drop")
  return path, lens


def serve(engine: PagedEngine, requests: list[Request], *, prefix_sharing: bool,
          prefill_chunk: int | None = None, num_pages: int | None = None,
          log_every: int = 0, cancels: dict[int, int] | None = None,
          check: bool = False, cascade: bool | None = None,
          speculate: int | None = None) -> Served:
  """Serves `requests` (each arriving at its step) with continuous batching to the end.

  `prefill_chunk` and `num_pages` (the first pages of the engine's pool) change the
  scheduling without compiling again. `cancels`: request id -> the step before which it is
  cancelled (wherever it is then; nothing if it has finished). A refused request is logged and
  listed in the result, the others served. `check`: the scheduler's invariants after every
  step. `cascade` (default: the engine's): plans group the sequences that share their first
  pages (`splash_hk.SharedPrefix`), so each shared prefix is read once a step. `speculate`
  (default: the engine's; at most it): drafted tokens a decoding sequence verifies a step."""
  if speculate is not None and not 0 <= speculate <= engine.drafts:
    raise ValueError(f"speculate={speculate}: the engine verifies up to {engine.drafts} drafts "
                     "a sequence.")
  sched = dataclasses.replace(engine.sched, prefix_sharing=prefix_sharing,
                              prefill_chunk=prefill_chunk or engine.sched.prefill_chunk,
                              cascade=engine.sched.cascade if cascade is None else cascade,
                              speculate=engine.sched.speculate if speculate is None else speculate)
  scheduler = Scheduler(sched, PageAllocator(num_pages or engine.num_pages))
  pending = sorted(requests, key=lambda r: (r.arrival, r.id))
  cancelling = sorted((step, rid) for rid, step in (cancels or {}).items())
  arrived, first, last, gaps = {}, [], {}, []
  step, started = 0, time.perf_counter()
  while pending or not scheduler.idle:
    while pending and pending[0].arrival <= step:
      request = pending.pop(0)
      try:
        scheduler.add(request)
      except Refused as e:
        logging.warning("%s", e)
      arrived[request.id] = time.perf_counter()
    while cancelling and cancelling[0][0] <= step:
      scheduler.cancel(cancelling.pop(0)[1])
    plan = scheduler.schedule()
    if plan is None:  # nothing runs: the next request has not arrived yet
      if not pending:
        raise RuntimeError(f"no request can run with {len(scheduler.waiting)} waiting: the "
                           "pool cannot hold the first chunk of the oldest.")
      step = pending[0].arrival
      continue
    sampled, finite = engine.run(plan)
    now = time.perf_counter()
    for seq in scheduler.complete(plan, sampled, finite):
      rid = seq.request.id
      if len(seq.generated) == 1:
        first.append(now - arrived[rid])
      elif rid in last:
        gaps.append(now - last[rid])
      last[rid] = now
    if check:
      scheduler.check()
    step += 1
    if log_every and step % log_every == 0:
      _log_progress(scheduler, len(requests), now - started)
  seconds = time.perf_counter() - started
  per_page, pages = engine.pool_bytes // engine.num_pages, scheduler.allocator.num_pages
  ids = lambda seqs: [s.request.id for s in seqs]
  return Served(outputs={s.request.id: s.generated for s in scheduler.finished}, seconds=seconds,
                first_token=first, token_gaps=gaps, kv_bytes=pages * per_page,
                steps=scheduler.stats.steps, stats=scheduler.stats, num_pages=pages,
                peak_bytes=scheduler.stats.peak_pages * per_page,
                cancelled=ids(scheduler.cancelled), failed=ids(scheduler.failed),
                refused=dict(scheduler.refused), free_at_end=scheduler.allocator.num_free)


def _log_progress(scheduler: Scheduler, total: int, seconds: float) -> None:
  made = sum(len(s.generated) for s in scheduler.finished + scheduler.running)
  logging.info("step %d: %d/%d requests done, %.0f tokens/s, pages %d/%d in use, %d running, "
               "%d waiting", scheduler.stats.steps, len(scheduler.finished), total,
               made / seconds, scheduler.allocator.in_use, scheduler.allocator.num_pages,
               len(scheduler.running), len(scheduler.waiting))


def _round(n: int, multiple: int = STATIC_ROUND) -> int:
  return -(-n // multiple) * multiple


def static_batches(requests: list[Request], batch_size: int) -> list[list[Request]]:
  """The requests in arrival order, `batch_size` at a time."""
  ordered = sorted(requests, key=lambda r: (r.arrival, r.id))
  return [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]


def static_shapes(batch: list[Request]) -> tuple[int, int]:
  """(padded prompt length, cache capacity) of a static batch."""
  return (_round(max(len(r.prompt) for r in batch)),
          _round(max(len(r.prompt) + r.max_new_tokens for r in batch)))


def static_slots(requests: list[Request], batch_size: int) -> int:
  """Cache slots per layer the largest static batch reserves."""
  return batch_size * max(static_shapes(b)[1] for b in static_batches(requests, batch_size))


class StaticEngine:
  """The same model decoding fixed batches with `KVCache`: each row reserves the batch's
  longest length; the batch prefills together, then decodes until its longest output ends."""

  def __init__(self, config: model_lib.ModelConfig, params: Any, batch_size: int):
    forward = hk.without_apply_rng(hk.transform(
        lambda tokens, positions, caches, lengths: model_lib.Transformer(config)(
            tokens, positions, caches, lengths=lengths)))

    def step(params, tokens, positions, caches, lengths):
      logits, caches = forward.apply(params, tokens, positions, caches, lengths)  # [B, T, V]
      return jnp.argmax(logits, axis=-1).astype(jnp.int32), caches  # [B, T]

    self._step = jax.jit(step, donate_argnums=(3,))
    self._zeros = lambda capacity: hk.transform(lambda: model_lib.Transformer(config).init_caches(
        batch_size, capacity)).apply({}, None)
    self.params, self.batch_size = params, batch_size

  def warm_up(self, batches: list[list[Request]]) -> None:
    """Compiles each batch shape's prefill and decode with calls that append nothing."""
    for prompt, capacity in sorted({static_shapes(b) for b in batches}):
      caches, none = self._zeros(capacity), np.zeros(self.batch_size, np.int32)
      for width in (prompt, 1):
        tokens = np.zeros((self.batch_size, width), np.int32)
        out, caches = self._step(self.params, tokens, tokens, caches, none)
        jax.block_until_ready(out)

  def decode(self, batch: list[Request], emit: Callable[[int, int], None]) -> int:
    """Prefills then decodes one batch, calling emit(request index, token) for each token;
    returns the KV bytes it held."""
    prompt_width, capacity = static_shapes(batch)
    b = self.batch_size
    lengths = np.zeros(b, np.int32)
    lengths[:len(batch)] = [len(r.prompt) for r in batch]
    wanted = np.zeros(b, np.int32)
    wanted[:len(batch)] = [r.max_new_tokens for r in batch]
    tokens = np.zeros((b, prompt_width), np.int32)
    for i, r in enumerate(batch):
      tokens[i, :len(r.prompt)] = r.prompt
    positions = np.broadcast_to(np.arange(prompt_width, dtype=np.int32), tokens.shape)
    caches = self._zeros(capacity)
    kv_bytes = _nbytes(caches)
    out, caches = self._step(self.params, tokens, positions, caches, lengths)
    token = np.asarray(out)[np.arange(b), np.maximum(lengths - 1, 0)]  # [B]
    made = np.zeros(b, np.int32)
    while True:
      active = made < wanted  # [B]
      for i in np.flatnonzero(active):
        emit(i, int(token[i]))
      made += active
      active = made < wanted
      if not active.any():
        return kv_bytes
      out, caches = self._step(self.params, token[:, None], lengths[:, None], caches,
                               active.astype(np.int32))
      lengths = lengths + active
      token = np.asarray(out)[:, 0]


def serve_static(engine: StaticEngine, requests: list[Request]) -> Served:
  """Serves `requests` in order as static batches (all of them available from the start)."""
  batches = static_batches(requests, engine.batch_size)
  outputs: dict[int, list[int]] = {r.id: [] for r in requests}
  first, gaps, kv_bytes, started = [], [], 0, time.perf_counter()
  last: dict[int, float] = {}
  for batch in batches:
    def emit(i: int, token: int, batch=batch) -> None:
      rid, now = batch[i].id, time.perf_counter()
      (gaps.append(now - last[rid]) if outputs[rid] else first.append(now - started))
      outputs[rid].append(token)
      last[rid] = now
    kv_bytes = max(kv_bytes, engine.decode(batch, emit))
  return Served(outputs=outputs, seconds=time.perf_counter() - started, first_token=first,
                token_gaps=gaps, kv_bytes=kv_bytes, steps=0)


def greedy_mismatches(config: model_lib.ModelConfig, params: Any, requests: list[Request],
                      outputs: dict[int, list[int]], rows: int = 16) -> list[int]:
  """The requests whose output is not the greedy decode of their prompt alone with a full
  forward (or not max_new_tokens long).

  One forward over prompt + output decides it: in a causal model the logits at a position
  depend only on the tokens up to it, so the output is the greedy decode exactly when the
  argmax at each of its positions (from the prompt's last) is the output's next token.
  Requests run `rows` at a time by length, right-padded (rows are independent)."""
  forward = jax.jit(hk.without_apply_rng(hk.transform(
      lambda tokens: jnp.argmax(model_lib.Transformer(config)(tokens), axis=-1))).apply)
  by_length = sorted(requests, key=lambda r: len(r.prompt) + r.max_new_tokens)
  wrong = []
  for i in range(0, len(by_length), rows):
    group = by_length[i:i + rows]
    tokens = np.zeros((len(group), _round(max(len(r.prompt) + r.max_new_tokens for r in group),
                                          128)), np.int32)
    for j, r in enumerate(group):
      out = outputs[r.id][:r.max_new_tokens]
      tokens[j, :len(r.prompt) + len(out)] = list(r.prompt) + out
    predicted = np.asarray(forward(params, tokens))  # [R, width]: the next token at each
    for j, r in enumerate(group):
      start = len(r.prompt) - 1
      if (len(outputs[r.id]) != r.max_new_tokens or outputs[r.id] !=
          predicted[j, start:start + r.max_new_tokens].tolist()):
        wrong.append(r.id)
  return sorted(wrong)
