"""The serving binary (examples/serve/): its page allocator, its scheduler over the demo model
against greedy decoding with a full forward, prefix sharing's savings, and the binary itself."""

import dataclasses
import re
import subprocess
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from examples.serve import engine as engine_lib
from examples.serve import workload as workload_lib
from examples.serve.allocator import OutOfPages, PageAllocator
from examples.serve.scheduler import Plan, Request, Scheduler, SchedulerConfig
from examples.train import model as model_lib
from examples.train import recall
import processes

TASK = recall.RecallTask.for_seq_len(31)
PAGE = 16
SCHED = SchedulerConfig(page_size=PAGE, max_seqs=16, step_tokens=128, prefill_chunk=64,
                        pages_per_seq=22)  # 352 tokens: prompts up to 300 and 40 new, or a prefix


def test_allocator_counts_holders_and_keeps_freed_pages_findable_until_reused():
  pages = PageAllocator(3)
  a, b = pages.allocate(), pages.allocate()
  pages.register(a, (1, 2))
  assert pages.find((1, 2)) == a and pages.share((1, 2)) == a and pages.refs(a) == 2
  pages.release(a)
  pages.release(a)  # the last holder: free, still findable
  assert pages.num_free == 2 and pages.find((1, 2)) == a
  assert pages.share((1, 2)) == a and pages.num_free == 1  # taken back from the free list
  pages.release(a)
  c = pages.allocate()  # the never-used page goes first (oldest freed first)
  assert c not in (a, b) and pages.find((1, 2)) == a
  assert pages.allocate() == a and pages.find((1, 2)) is None  # reused: forgotten
  with pytest.raises(OutOfPages):
    pages.allocate()
  pages.release(b)
  with pytest.raises(ValueError, match="not held"):
    pages.release(b)
  assert pages.allocated == 4


def test_a_request_the_pool_cannot_hold_is_refused_with_what_to_change():
  scheduler = Scheduler(dataclasses.replace(SCHED, pages_per_seq=4), PageAllocator(8))
  with pytest.raises(ValueError, match="needs 70 tokens.*--num_pages"):
    scheduler.add(Request(0, tuple(range(60)), 10))
  with pytest.raises(ValueError, match="max_new_tokens >= 1"):
    scheduler.add(Request(1, (1, 2), 0))


@pytest.fixture(scope="session")  # kept while other files' tests run between its users
def served_model():
  """A random ALiBi demo model (positions past the task's 31), its engine (compiled once: the
  runs below change only host-side scheduling) and 64 requests of prompts 5..300 tokens and
  1..40 new tokens, some sharing prefixes of whole pages (one exactly a page multiple: its last
  page is copied before it is written) or of pages and a part."""
  config = model_lib.ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len,
                                 num_kv_heads=2, num_sinks=1, position_bias="alibi",
                                 attention_config=sh.AttentionConfig(causal=True))
  params = jax.jit(hk.transform(lambda t: model_lib.Transformer(config)(t)).init)(
      jax.random.PRNGKey(3), jnp.zeros((1, 8), jnp.int32))
  requests = workload_lib.requests(workload_lib.Workload(num_requests=64, seed=5), TASK)
  base = requests[1].prompt if len(requests[1].prompt) > 3 * PAGE else requests[2].prompt
  for i, cut, extra in ((10, 2 * PAGE, ()), (11, 2 * PAGE, (1, 2, 3)), (12, 3 * PAGE + 5, (4,)),
                        (13, len(base), ())):
    requests[i] = dataclasses.replace(requests[i], prompt=base[:cut] + extra)
  engine = engine_lib.PagedEngine(config, params, SCHED, num_pages=200)
  engine.warm_up()
  return config, params, requests, engine


# (arrival rate per step, prefill chunk, pages the allocator may use, prefix sharing)
RUNS = {"all_at_once": (0.0, 64, 200, True), "arriving_small_pool": (1.5, 16, 40, True),
        "no_sharing_long_chunks": (0.7, 128, 120, False)}


@pytest.mark.xdist_group("served_model")  # one worker builds the fixture (make test: loadgroup)
@pytest.mark.parametrize("run", RUNS)
def test_every_served_output_equals_greedy_decoding_with_a_full_forward(served_model, run):
  config, params, requests, engine = served_model
  rate, chunk, pages, sharing = RUNS[run]
  rng = np.random.default_rng(len(run))
  arrivals = np.cumsum(rng.exponential(1 / rate, len(requests))).astype(int) if rate else [0] * 64
  order = rng.permutation(len(requests))  # arrival order is not id order
  timed = [dataclasses.replace(requests[i], arrival=int(a)) for i, a in zip(order, arrivals)]
  served = engine_lib.serve(engine, timed, prefix_sharing=sharing, prefill_chunk=chunk,
                            num_pages=pages)
  wrong = engine_lib.greedy_mismatches(config, params, requests, served.outputs)
  assert not wrong, f"requests {wrong} are not the greedy decode of a full forward"
  stats = served.stats
  assert stats.peak_pages <= pages
  if run == "arriving_small_pool":
    assert stats.preemptions > 0, stats
  if sharing:
    assert stats.shared_pages >= 5 and stats.copies >= 1, stats
  else:
    assert stats.shared_pages == stats.copies == 0, stats


@pytest.mark.xdist_group("served_model")
def test_a_step_copies_its_shared_pages_before_it_runs(served_model):
  # Copy-on-write on the device: a step's (source, destination) pages are copied in every
  # layer's pool, keys and values, and nothing else changes. (The greedy check above compares
  # tokens, which a missed copy need not flip.)
  engine = served_model[3]
  src, dst = 3, 7
  engine.caches = [c.replace(key=c.key.at[src].set(1.0 + i), value=c.value.at[src].set(-1.0 - i))
                   for i, c in enumerate(engine.caches)]
  before = [(np.asarray(c.key), np.asarray(c.value)) for c in engine.caches]
  max_seqs, pages_per_seq = engine.sched.max_seqs, engine.sched.pages_per_seq
  plan = Plan(tokens=np.zeros(0, np.int32), positions=np.zeros(0, np.int32),
              cu_q_lens=np.zeros(max_seqs + 1, np.int32), kv_lens=np.zeros(max_seqs, np.int32),
              page_table=np.zeros((max_seqs, pages_per_seq), np.int32), num_seqs=0,
              copies=[(src, dst)], work=[], samples=[])
  engine.run(plan)
  for (key, value), c in zip(before, engine.caches):
    want_key, want_value = key.copy(), value.copy()
    want_key[dst], want_value[dst] = key[src], value[src]
    np.testing.assert_array_equal(np.asarray(c.key), want_key)
    np.testing.assert_array_equal(np.asarray(c.value), want_value)


@pytest.mark.xdist_group("served_model")
def test_sharing_a_prefix_cuts_pages_and_prefill_by_three(served_model):
  """32 requests behind one 256-token system prompt."""
  config, params, _, engine = served_model
  work = workload_lib.Workload(num_requests=32, prompt_lens=(5, 40), new_tokens=(1, 8),
                               recall_fraction=0.25, shared_prefix_len=256, seed=9)
  requests = workload_lib.requests(work, TASK)
  runs = {sharing: engine_lib.serve(engine, requests, prefix_sharing=sharing)
          for sharing in (True, False)}
  with_, without = runs[True].stats, runs[False].stats
  assert without.pages_allocated >= 3 * with_.pages_allocated, (with_, without)
  assert without.prefill_tokens >= 3 * with_.prefill_tokens, (with_, without)
  assert with_.skipped_tokens >= 31 * 256 - PAGE, with_
  assert runs[True].outputs == runs[False].outputs
  assert not engine_lib.greedy_mismatches(config, params, requests, runs[True].outputs)


SUMMARY = {
    "served": re.compile(r"^served 12 requests: (\d+) tokens in .* = \d+ tokens/s", re.M),
    "latency": re.compile(r"^time to first token: median \d+ ms, p99 \d+ ms; per-token latency: "
                          r"median \d+ ms, p99 \d+ ms$", re.M),
    "pages": re.compile(r"^pages: peak (\d+) of (\d+) in use", re.M),
    "recall": re.compile(r"^recall answers: (\d+)/(\d+) right$", re.M),
    "static": re.compile(r"^continuous / static: [0-9.]+x tokens/s, ([0-9.]+)x KV bytes$", re.M),
    "check": re.compile(r"^outputs equal to greedy decoding with a full forward: 12/12$", re.M),
}


def test_the_binary_trains_briefly_serves_and_summarises():
  env = processes.env()
  proc = subprocess.run(
      [sys.executable, "-m", "examples.serve", "--steps=30", "--log_every=30", "--num_layers=1",
       "--num_requests=12", "--prompt_lens=5,60", "--new_tokens=1,6", "--max_seqs=4",
       "--step_tokens=32", "--prefill_chunk=16", "--arrival_rate=2", "--check",
       "--log_every_steps=10"], capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  found = {name: pattern.search(proc.stdout) for name, pattern in SUMMARY.items()}
  assert all(found.values()), (found, proc.stdout)
  assert int(found["pages"][1]) <= int(found["pages"][2])
  assert 0 < int(found["recall"][2]) < 12
  assert float(found["static"][1]) <= 0.5
  assert re.search(r"step 10: \d+/12 requests done, \d+ tokens/s, pages \d+/\d+ in use",
                   proc.stderr), proc.stderr[-2000:]


def test_the_binary_refuses_a_workload_past_learned_positions():
  env = processes.env()
  proc = subprocess.run(
      [sys.executable, "-m", "examples.serve", "--position_bias=none", "--shared_prefix_len=40"],
      capture_output=True, text=True, env=env, timeout=120)
  assert proc.returncode == 1
  assert "learned positions stop at 31 tokens" in proc.stderr, proc.stderr[-2000:]
