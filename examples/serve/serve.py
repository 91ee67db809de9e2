r"""Serves the demo model with continuous batching over a paged KV cache.

  python -m examples.serve                        # trains briefly, serves 64 requests, compares
  python -m examples.serve --checkpoint_dir=/tmp/ckpt --position_bias=alibi
  python -m examples.serve --shared_prefix_len=256 --num_requests=32 --recall_fraction=0

Requests (random-token prompts of mixed lengths, and recall prompts whose first answer is
scored) arrive all at once or at --arrival_rate per step. Each step runs one
`paged_attention` call per layer over a flat batch that mixes prefill chunks and one decode
token per running request (examples/serve/scheduler.py). The model is the training binary's
(every training flag applies): restored from --checkpoint_dir, training until --steps first
when the checkpoint has fewer. Without a checkpoint it trains from scratch, as `make demo`
does; the serving default is --position_bias=alibi, so prompts may pass --seq_len.

The summary's last lines compare the same requests served as static batches with `KVCache`
(--compare_static) and, with --check, each output against greedy decoding with a full forward.
"""

from __future__ import annotations

import dataclasses

import sys

from absl import app
from absl import flags
from absl import logging
import jax.numpy as jnp
import numpy as np

from examples.serve import engine as engine_lib
from examples.serve import workload as workload_lib
from examples.serve.scheduler import SchedulerConfig
from examples.train import train

_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests to serve.")
_PROMPT_LENS = flags.DEFINE_list("prompt_lens", ["5", "300"],
                                 "Random-token prompts: lengths uniform in [lo, hi].")
_NEW_TOKENS = flags.DEFINE_list("new_tokens", ["1", "40"],
                                "Tokens each request generates: uniform in [lo, hi].")
_RECALL_FRACTION = flags.DEFINE_float(
    "recall_fraction", 0.5, "Of the requests: recall prompts (the task's lengths), whose first "
    "generated token is scored against the answer.")
_SHARED_PREFIX_LEN = flags.DEFINE_integer(
    "shared_prefix_len", 0, "Random tokens in front of every prompt (a system prompt).")
_ARRIVAL_RATE = flags.DEFINE_float("arrival_rate", 0.0,
                                   "Requests arriving per step (Poisson); 0: all at once.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Slots per page.")
_NUM_PAGES = flags.DEFINE_integer(
    "num_pages", None, "Pages per layer's pool (default: --pool_fraction of the slots the "
    "static batches reserve, or what the longest request needs if more).")
_POOL_FRACTION = flags.DEFINE_float(
    "pool_fraction", 0.5, "Without --num_pages: the pool as a fraction of the slots static "
    "batches of --max_seqs reserve (0.3: preemption storms).")
_CANCEL_FRACTION = flags.DEFINE_float(
    "cancel_fraction", 0.0, "Of the requests: cancelled at a random step of their life.")
_MAX_SEQS = flags.DEFINE_integer("max_seqs", 32, "Requests one step serves.")
_STEP_TOKENS = flags.DEFINE_integer("step_tokens", 256, "Tokens one step computes.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 64,
                                      "Prompt tokens a request computes in one step.")
_PREFIX_SHARING = flags.DEFINE_bool(
    "prefix_sharing", True, "Reuse the pool's full pages of an equal prompt prefix.")
_CASCADE = flags.DEFINE_bool(
    "cascade", False, "Group the sequences that share their first pages in each step, so a "
    "shared prefix is read once a step (splash_hk.SharedPrefix). Off by default: on this CPU "
    "its gain on the demo workloads spread from a loss to 1.7x over runs (docs/guide/caches.md).")
_COMPARE_CASCADE = flags.DEFINE_bool(
    "compare_cascade", False, "Also serve the requests without --cascade and print the ratio.")
_COMPARE_STATIC = flags.DEFINE_bool(
    "compare_static", True, "Also serve the requests as static batches of --max_seqs with KVCache.")
_CHECK = flags.DEFINE_bool("check", False, "Check every finished output against greedy decoding "
                           "of its prompt with a full forward, and the scheduler's invariants "
                           "after every step.")
KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8,
             "fp8": jnp.float8_e4m3fn}
_KV_DTYPE = flags.DEFINE_enum(
    "kv_dtype", "float32", list(KV_DTYPES), "What the page pools store keys and values in; int8 "
    "and fp8 (float8_e4m3fn) are quantized as written, with a float32 scale per token and kv "
    "head. Other than float32, the requests are also served with float32 pools and the greedy "
    "agreement printed. The static comparison keeps float32 caches.")
_PAGE_TOP_K = flags.DEFINE_integer(
    "page_top_k", 0, "Quest: each layer's decode reads only each sequence's last page and the "
    "K pages its queries can score highest (per kv head, from each page's key bounds); 0: "
    "every page. The requests are also served reading every page, and the greedy agreement "
    "and both runs' tokens/s printed.")
_COMPARE_NATIVE = flags.DEFINE_bool(
    "compare_native", False, "Also serve the requests with the attention on xla (the native CPU "
    "decode kernel off) and print tokens/s with / without it and whether the outputs agree.")
_SPECULATE = flags.DEFINE_integer(
    "speculate", 0, "Speculative decoding: up to this many tokens drafted per decoding sequence "
    "by prompt lookup (the longest suffix of its text found earlier in it), verified in the next "
    "step (0: none).")
_DRAFT_BRANCHES = flags.DEFINE_integer(
    "draft_branches", 1, "With --speculate: candidate continuations drafted, verified as a tree.")
_COMPARE_SPECULATION = flags.DEFINE_bool(
    "compare_speculation", False, "Also serve the requests with --speculate=0: acceptance rate, "
    "tokens/s of both and whether the outputs are identical.")
_SERVE_SEED = flags.DEFINE_integer("serve_seed", 0, "Seed of the requests.")
_LOG_EVERY_STEPS = flags.DEFINE_integer("log_every_steps", 25, "Steps between progress lines.")

flags.FLAGS.set_default("position_bias", "alibi")


def _fail(message: str):
  sys.stderr.write(f"error: {message}\n")
  sys.exit(1)


def _pair(values: list[str], name: str) -> tuple[int, int]:
  if len(values) != 2 or not all(v.strip().isdigit() for v in values):
    _fail(f"--{name} takes two integers lo,hi; got {','.join(values)!r}.")
  return int(values[0]), int(values[1])


def _percentiles(seconds: list[float]) -> str:
  if not seconds:
    return "n/a"
  p50, p99 = np.percentile(np.asarray(seconds) * 1e3, [50, 99])
  return f"median {p50:.0f} ms, p99 {p99:.0f} ms"


def _config(requests: list[workload_lib.Request], vocab_size: int) -> SchedulerConfig:
  longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
  try:
    return SchedulerConfig(page_size=_PAGE_SIZE.value, max_seqs=_MAX_SEQS.value,
                           step_tokens=_STEP_TOKENS.value, prefill_chunk=_PREFILL_CHUNK.value,
                           pages_per_seq=-(-longest // _PAGE_SIZE.value),
                           prefix_sharing=_PREFIX_SHARING.value, vocab_size=vocab_size,
                           cascade=_CASCADE.value, speculate=_SPECULATE.value,
                           draft_branches=_DRAFT_BRANCHES.value)
  except ValueError as e:
    _fail(str(e))


def _default_pages(requests, sched: SchedulerConfig) -> int:
  """--pool_fraction of the slots static batches of max_seqs reserve (at least the longest
  request)."""
  if not 0 < _POOL_FRACTION.value <= 1:
    _fail(f"--pool_fraction must lie in (0, 1], got {_POOL_FRACTION.value}.")
  static = engine_lib.static_slots(requests, sched.max_seqs)
  return max(int(static * _POOL_FRACTION.value) // sched.page_size, sched.pages_per_seq)


def report(served: engine_lib.Served, requests, static: engine_lib.Served | None,
           mismatches: list[int] | None) -> None:
  """The summary: throughput, latency, pages, sharing, accuracy, and the comparisons."""
  s = served.stats
  print(f"served {len(served.outputs)} requests: {served.tokens} tokens in {served.seconds:.2f} s "
        f"= {served.tokens / served.seconds:.0f} tokens/s ({served.steps} steps)")
  print(f"time to first token: {_percentiles(served.first_token)}; per-token latency: "
        f"{_percentiles(served.token_gaps)}")
  print(f"pages: peak {s.peak_pages} of {served.num_pages} in use, {s.pages_allocated} "
        f"allocated over the run; KV pool "
        f"{served.kv_bytes / 2**20:.2f} MiB (at the peak {served.peak_bytes / 2**20:.2f} MiB in "
        f"use); preemptions {s.preemptions}")
  print(f"prefill: {s.prefill_tokens} prompt tokens computed; prefix sharing: {s.shared_pages} "
        f"pages shared, {s.skipped_tokens} prompt tokens skipped, {s.copies} pages copied")
  print(f"requests: {len(served.outputs)} finished, {len(served.cancelled)} cancelled, "
        f"{len(served.failed)} failed, {len(served.refused)} refused; pool at the end: "
        f"{served.free_at_end}/{served.num_pages} pages free")
  requests = [r for r in requests if r.id in served.outputs]
  scored = [r for r in requests if r.answer is not None]
  right = sum(served.outputs[r.id][0] == r.answer for r in scored)
  print(f"recall answers: {right}/{len(scored)} right")
  if static is not None:
    print(f"static batches (KVCache): {static.tokens} tokens in {static.seconds:.2f} s = "
          f"{static.tokens / static.seconds:.0f} tokens/s; time to first token: "
          f"{_percentiles(static.first_token)}; KV {static.kv_bytes / 2**20:.2f} MiB")
    speedup = (served.tokens / served.seconds) / (static.tokens / static.seconds)
    print(f"continuous / static: {speedup:.2f}x tokens/s, "
          f"{served.kv_bytes / static.kv_bytes:.2f}x KV bytes")
  if s.drafted:
    print(f"speculation: {s.accepted}/{s.drafted} drafted tokens accepted "
          f"({s.accepted / s.drafted:.1%}), {served.tokens / served.steps:.2f} tokens a step")
  if mismatches is not None:
    print(f"outputs equal to greedy decoding with a full forward: "
          f"{len(requests) - len(mismatches)}/{len(requests)}"
          + (f" (not: requests {mismatches})" if mismatches else ""))


def agreement(served: engine_lib.Served, reference: engine_lib.Served, requests) -> None:
  """How far the --kv_dtype run's greedy outputs agree with the float32 pools' run."""
  agree = _agreeing(served, reference, requests, "float32 pools'")
  print(f"--kv_dtype={_KV_DTYPE.value} against float32 pools: {agree}; KV pool "
        f"{served.kv_bytes / reference.kv_bytes:.2f}x the bytes")


def _agreeing(served: engine_lib.Served, reference: engine_lib.Served, requests,
              name: str) -> str:
  """'n/m requests identical, x% of tokens equal; `name` recall answers' of two runs."""
  both = [r.id for r in requests if r.id in served.outputs and r.id in reference.outputs]
  same = sum(served.outputs[i] == reference.outputs[i] for i in both)
  pairs = [(a, b) for i in both for a, b in zip(served.outputs[i], reference.outputs[i])]
  tokens = sum(a == b for a, b in pairs) / max(len(pairs), 1)
  scored = [r for r in requests if r.answer is not None and r.id in reference.outputs]
  right = sum(reference.outputs[r.id][0] == r.answer for r in scored)
  return (f"{same}/{len(both)} requests identical, {tokens:.1%} of tokens equal; {name} "
          f"recall answers: {right}/{len(scored)} right")


def quest_agreement(served: engine_lib.Served, every: engine_lib.Served, requests) -> None:
  """The --page_top_k run against the same requests reading every page."""
  rate = lambda s: s.tokens / s.seconds
  agree = _agreeing(served, every, requests, "the every-page run's")
  print(f"--page_top_k={_PAGE_TOP_K.value} against every page: {agree}; {rate(served):.0f} / "
        f"{rate(every):.0f} tokens/s = {rate(served) / rate(every):.2f}x")


def native_agreement(served: engine_lib.Served, config, params, sched, num_pages: int, requests,
                     cancels) -> None:
  """The run against the same requests served with the attention on xla (no native kernel)."""
  on_xla = dataclasses.replace(
      config, attention_config=config.attention_config.replace(platform="xla"))
  engine = engine_lib.PagedEngine(on_xla, params, sched, num_pages, KV_DTYPES[_KV_DTYPE.value])
  engine.warm_up()
  other = engine_lib.serve(engine, requests, prefix_sharing=sched.prefix_sharing, cancels=cancels)
  rate = lambda s: s.tokens / s.seconds
  agree = _agreeing(served, other, requests, "the xla run's")
  print(f"native decode kernel on / off (platform={config.attention_config.platform} / xla): "
        f"{rate(served):.0f} / {rate(other):.0f} tokens/s = {rate(served) / rate(other):.2f}x; "
        f"{agree}")


def speculation_agreement(served: engine_lib.Served, paged: engine_lib.PagedEngine, requests,
                          cancels) -> None:
  """The run against the same requests served without drafts (--speculate=0)."""
  plain = engine_lib.serve(paged, requests, prefix_sharing=paged.sched.prefix_sharing,
                           cancels=cancels, speculate=0)
  rate = lambda x: x.tokens / x.seconds
  s = served.stats
  agree = _agreeing(served, plain, requests, "the plain run's")
  print(f"--speculate={_SPECULATE.value} --draft_branches={_DRAFT_BRANCHES.value} against "
        f"--speculate=0: {rate(served):.0f} / {rate(plain):.0f} tokens/s = "
        f"{rate(served) / rate(plain):.2f}x; acceptance {s.accepted}/{s.drafted} = "
        f"{s.accepted / max(s.drafted, 1):.1%}; steps {served.steps} / {plain.steps}; {agree}")


def comparisons(served: engine_lib.Served, paged: engine_lib.PagedEngine, config, params,
                sched: SchedulerConfig, num_pages: int, requests, cancels,
                top_k: int | None) -> None:
  """The runs the flags compare the served run with (cascade, chosen pages, float32 pools,
  speculation, the native kernel), each printed."""
  if _COMPARE_CASCADE.value:
    other = engine_lib.serve(paged, requests, prefix_sharing=sched.prefix_sharing,
                             cancels=cancels, cascade=not sched.cascade)
    with_, without = (served, other) if sched.cascade else (other, served)
    print(f"cascade / no cascade: {(with_.tokens / with_.seconds) / (without.tokens / without.seconds):.2f}x "
          f"tokens/s ({with_.tokens / with_.seconds:.0f} / {without.tokens / without.seconds:.0f}); "
          f"outputs equal: {with_.outputs == without.outputs}")
  if top_k is not None:
    every = engine_lib.PagedEngine(config, params, sched, num_pages, KV_DTYPES[_KV_DTYPE.value])
    every.warm_up()
    quest_agreement(served, engine_lib.serve(every, requests, prefix_sharing=sched.prefix_sharing,
                                             cancels=cancels), requests)
  if _KV_DTYPE.value != "float32":
    full = engine_lib.PagedEngine(config, params, sched, num_pages)
    full.warm_up()
    agreement(served, engine_lib.serve(full, requests, prefix_sharing=sched.prefix_sharing,
                                       cancels=cancels), requests)
  if _COMPARE_SPECULATION.value:
    speculation_agreement(served, paged, requests, cancels)
  if _COMPARE_NATIVE.value:
    native_agreement(served, config, params, sched, num_pages, requests, cancels)


def run() -> None:
  axes = train.make_axes(None)
  task, config = train.make_task_and_model(axes)
  if config.prefix_len or config.attention != "splash":
    _fail("serving takes a causal splash model: drop --prefix_lm and --attention=reference.")
  try:
    work = workload_lib.Workload(
        num_requests=_NUM_REQUESTS.value, prompt_lens=_pair(_PROMPT_LENS.value, "prompt_lens"),
        new_tokens=_pair(_NEW_TOKENS.value, "new_tokens"), recall_fraction=_RECALL_FRACTION.value,
        shared_prefix_len=_SHARED_PREFIX_LEN.value, arrival_rate=_ARRIVAL_RATE.value,
        max_len=config.max_len if config.position_bias == "none" else None,
        seed=_SERVE_SEED.value)
  except ValueError as e:
    _fail(str(e))
  requests = workload_lib.requests(work, task)
  fitted = train.fit(None, axes, task, config)
  if fitted is None:
    return
  params = fitted[0].params
  sched = _config(requests, config.vocab_size)
  try:
    cancels = workload_lib.cancellations(requests, _CANCEL_FRACTION.value, _SERVE_SEED.value)
  except ValueError as e:
    _fail(str(e))
  num_pages = _NUM_PAGES.value or _default_pages(requests, sched)
  top_k = _PAGE_TOP_K.value or None
  if _PAGE_TOP_K.value < 0:
    _fail(f"--page_top_k must be >= 0, got {_PAGE_TOP_K.value}.")
  paged = engine_lib.PagedEngine(config, params, sched, num_pages, KV_DTYPES[_KV_DTYPE.value],
                                 page_top_k=top_k)
  paged.warm_up((True, False) if _COMPARE_CASCADE.value else None)
  logging.info("serving %d requests: pool of %d pages of %d slots per layer, steps of %d "
               "tokens (buckets %s), prefill chunks of %d, prefix sharing %s", len(requests),
               num_pages, sched.page_size, sched.step_tokens, paged.buckets, sched.prefill_chunk,
               sched.prefix_sharing)
  try:
    served = engine_lib.serve(paged, requests, prefix_sharing=sched.prefix_sharing,
                              log_every=_LOG_EVERY_STEPS.value, cancels=cancels,
                              check=_CHECK.value)
  except ValueError as e:
    _fail(str(e))
  comparisons(served, paged, config, params, sched, num_pages, requests, cancels, top_k)
  static = None
  if _COMPARE_STATIC.value:
    static_engine = engine_lib.StaticEngine(config, params, sched.max_seqs)
    static_engine.warm_up(engine_lib.static_batches(requests, sched.max_seqs))
    static = engine_lib.serve_static(static_engine, requests)
  finished = [r for r in requests if r.id in served.outputs]
  mismatches = (engine_lib.greedy_mismatches(config, params, finished, served.outputs)
                if _CHECK.value and top_k is None else None)  # a choice of pages may differ
  report(served, requests, static, mismatches)


def main(argv):
  del argv
  run()


if __name__ == "__main__":
  app.run(main)
