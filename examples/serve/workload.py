"""Requests to serve: recall prompts (whose first answer is scored) among prompts of random
tokens, of mixed prompt and output lengths, optionally behind one shared prefix."""

from __future__ import annotations

import dataclasses

import numpy as np

from examples.serve.scheduler import Request
from examples.train import recall


@dataclasses.dataclass(frozen=True)
class Workload:
  num_requests: int = 64
  prompt_lens: tuple[int, int] = (5, 300)  # random-token prompts: uniform in [lo, hi]
  new_tokens: tuple[int, int] = (1, 40)  # uniform in [lo, hi]
  recall_fraction: float = 0.5  # of the requests: recall prompts (their lengths are the task's)
  shared_prefix_len: int = 0  # random tokens in front of every prompt
  arrival_rate: float = 0.0  # requests per step (Poisson); 0: all at step 0
  max_len: int | None = None  # the model's longest sequence (learned positions), if any
  seed: int = 0

  def __post_init__(self):
    (plo, phi), (nlo, nhi) = self.prompt_lens, self.new_tokens
    if not (1 <= plo <= phi and 1 <= nlo <= nhi and 0 <= self.recall_fraction <= 1
            and self.num_requests >= 1 and self.arrival_rate >= 0 and self.shared_prefix_len >= 0):
      raise ValueError(f"an empty or negative workload: {self}")
    if self.max_len is not None and self.shared_prefix_len + plo + nlo > self.max_len:
      raise ValueError(f"the model's learned positions stop at {self.max_len} tokens: shorten "
                       "--shared_prefix_len/--min_prompt_len/--min_new_tokens, or serve a model "
                       "trained with --position_bias=alibi or t5.")


def recall_prompt(task: recall.RecallTask, seed: int, index: int,
                  room: int | None = None) -> tuple[list[int], int]:
  """(prompt, answer): the pairs, some queries already answered (fewer when the prompt and
  one answer must fit in `room` tokens), then one more query."""
  example = task.batch(seed, 0, index + 1, rows=slice(index, index + 1))
  full = np.append(example["inputs"][0], example["targets"][0, -1])  # the whole sequence
  most = task.num_pairs - 1 if room is None else min(task.num_pairs - 1,
                                                      (room - 1 - task.prompt_len()) // 2)
  length = task.prompt_len() + 2 * (index % (most + 1))
  return full[:length].tolist(), int(full[length])


def requests(work: Workload, task: recall.RecallTask) -> list[Request]:
  """The workload's requests, in arrival order."""
  rng = np.random.default_rng(work.seed)
  prefix = rng.integers(0, task.vocab_size, work.shared_prefix_len).tolist()
  room = None if work.max_len is None else work.max_len - len(prefix)
  out, step = [], 0.0
  for i in range(work.num_requests):
    answer = None
    if rng.random() < work.recall_fraction and (room is None or room > task.prompt_len()):
      prompt, answer = recall_prompt(task, work.seed + 1, i, room)
    else:
      hi = work.prompt_lens[1] if room is None else min(work.prompt_lens[1], room - 1)
      prompt = rng.integers(0, task.vocab_size, rng.integers(work.prompt_lens[0], hi + 1)).tolist()
    hi = work.new_tokens[1] if room is None else min(work.new_tokens[1], room - len(prompt))
    new = int(rng.integers(min(work.new_tokens[0], hi), hi + 1))
    if work.arrival_rate:
      step += rng.exponential(1 / work.arrival_rate)
    out.append(Request(id=i, prompt=tuple(prefix + prompt), max_new_tokens=new,
                       arrival=int(step), answer=answer))
  return out


def cancellations(requests: list[Request], fraction: float, seed: int = 0) -> dict[int, int]:
  """About `fraction` of the requests, each with a random step at which it is cancelled: from
  its arrival to about when it would end if served at once (a prompt chunk of 64 a step, then
  a token a step), so it may be waiting, prefilling, decoding or preempted then (or, if it
  was served faster, done already: then nothing happens)."""
  if not 0 <= fraction <= 1:
    raise ValueError(f"--cancel_fraction must lie in [0, 1], got {fraction}.")
  rng = np.random.default_rng(seed + 1)
  out = {}
  for r in requests:
    if rng.random() < fraction:
      life = len(r.prompt) // 64 + r.max_new_tokens
      out[r.id] = r.arrival + int(rng.integers(0, life))
  return out
