"""Continuous batching: which tokens of which requests each step computes, over which pages.

Each step the scheduler
  1. gives every running sequence its next tokens: one to each decoding sequence, then up to
     `prefill_chunk` to each that (re)computes its prompt, oldest first, within `step_tokens`;
     when the pool cannot hold them it preempts the newest running sequence not yet in the
     step (its pages freed, its tokens recomputed when it is admitted again), the sequence
     itself if it is that one;
  2. admits waiting sequences in order while pages, `max_seqs` and the step's tokens allow;
     with prefix sharing, a sequence first takes the registered full pages that hold its
     first tokens, and waits while the next page it needs is being computed by another;
  3. lays the step out as `paged_attention` takes it (`Plan`): flat tokens and positions, a
     `RaggedBatch`'s arrays, the pages to copy before the step (a shared page a sequence is
     about to write), and the rows whose logits give a sequence its next token.
After the step, `complete` appends each sampled token, registers the pages now full, and ends
(and frees) the sequences that have all their tokens; a sequence whose rows came back
non-finite (a NaN in its activations) fails instead: its pages are freed and forgotten, and it
is never scheduled again. `cancel` ends a request at any point (its pages freed at once), and
`check` asserts the invariants of pages and requests (examples/serve/invariants.py).

Every submitted request ends in exactly one of `finished`, `cancelled`, `failed` or `refused`
(refused at submission, with the reason: an empty prompt, no token to generate, a token outside
the vocabulary, more tokens than a page table or the pool holds).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from examples.serve import invariants
from examples.serve.allocator import OutOfPages, PageAllocator
from examples.serve.drafts import Draft, Lookup, accepted, propose


@dataclasses.dataclass(frozen=True)
class Request:
  id: int
  prompt: tuple[int, ...]
  max_new_tokens: int
  arrival: int = 0  # the step at which it arrives
  answer: int | None = None  # a recall prompt's expected first token (scored)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  page_size: int = 16
  max_seqs: int = 32  # sequences in one step
  step_tokens: int = 256  # tokens in one step
  prefill_chunk: int = 64  # prompt tokens a sequence computes in one step
  pages_per_seq: int = 24  # the page table's width: a sequence's longest length / page_size
  prefix_sharing: bool = True
  vocab_size: int | None = None  # prompts with a token outside [0, vocab_size) are refused
  cascade: bool = False  # plans group sequences whose first cached pages are shared (a cascade)
  speculate: int = 0  # drafted tokens a decoding sequence verifies a step (0: none)
  draft_branches: int = 1  # candidate continuations drafted (a tree when more than one)

  def __post_init__(self):
    if min(self.page_size, self.max_seqs, self.prefill_chunk, self.pages_per_seq) < 1:
      raise ValueError(f"page_size, max_seqs, prefill_chunk and pages_per_seq must be >= 1: {self}")
    if self.speculate < 0 or self.draft_branches < 1:
      raise ValueError(f"--speculate must be >= 0 and --draft_branches >= 1, got "
                       f"{self.speculate} and {self.draft_branches}.")
    if self.step_tokens < self.max_seqs:
      raise ValueError(f"--step_tokens ({self.step_tokens}) must be at least --max_seqs "
                       f"({self.max_seqs}): every running sequence decodes each step.")


@dataclasses.dataclass(eq=False)
class Sequence:
  """A request being served: its tokens so far (prompt, then generated) and its pages."""

  request: Request
  tokens: list[int]
  pages: list[int] = dataclasses.field(default_factory=list)  # physical, in logical order
  computed: int = 0  # tokens whose keys and values are in `pages`
  generated: list[int] = dataclasses.field(default_factory=list)
  admitted: int = -1  # admission counter: the newest running sequence has the largest
  lookup: Lookup = dataclasses.field(default_factory=Lookup)  # its text indexed for drafts

  @property
  def done(self) -> bool:
    return len(self.generated) >= self.request.max_new_tokens


class Refused(ValueError):
  """A request the scheduler will never serve, with the reason (nothing of it is kept)."""


@dataclasses.dataclass
class Plan:
  """One step, laid out for the model (arrays unpadded: the engine pads the token axis)."""

  tokens: np.ndarray  # [n] int32, the step's tokens, sequence by sequence
  positions: np.ndarray  # [n] int32
  cu_q_lens: np.ndarray  # [max_seqs + 1] int32
  kv_lens: np.ndarray  # [max_seqs] int32: tokens of each sequence in its pages before the step
  page_table: np.ndarray  # [max_seqs, pages_per_seq] int32
  num_seqs: int
  copies: list[tuple[int, int]]  # (source, destination) pages to copy before the step
  work: list[tuple[Sequence, int]]  # each scheduled sequence and its tokens this step
  samples: list[tuple[Sequence, int]]  # sequences that get a token, and the row that gives it
  prefix: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # cascade: pages, lens, group
  tree: np.ndarray | None = None  # [n] int32 each row's parent in its sequence (drafts), or None
  drafts: dict[int, Draft] = dataclasses.field(default_factory=dict)  # work index -> its rows


@dataclasses.dataclass
class Stats:
  steps: int = 0
  preemptions: int = 0
  prefill_tokens: int = 0  # prompt tokens computed (recomputation included)
  decode_tokens: int = 0
  shared_pages: int = 0  # pages taken from the prefix cache instead of computed
  skipped_tokens: int = 0  # prompt tokens those pages held
  copies: int = 0
  peak_pages: int = 0
  pages_allocated: int = 0  # pages taken from the free list for computing (copies included)
  cancellations: int = 0
  failures: int = 0  # sequences whose activations went non-finite
  refusals: int = 0
  drafted: int = 0  # drafted tokens verified
  accepted: int = 0  # of them, kept


class Scheduler:
  """Requests in, `Plan`s out; `complete` feeds each step's sampled tokens back."""

  def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
    self.config = config
    self.allocator = allocator
    self.waiting: collections.deque[Sequence] = collections.deque()
    self.running: list[Sequence] = []  # admission order
    self.finished: list[Sequence] = []
    self.cancelled: list[Sequence] = []
    self.failed: list[Sequence] = []  # non-finite activations: ended, pages freed
    self.refused: dict[int, str] = {}  # request id -> why it was refused at submission
    self.submitted: list[int] = []  # every request id given to `add`, in order
    self.stats = Stats()
    self.last_writes: dict[int, int] = {}  # the last plan's written pages -> their holders
    self._admissions = itertools.count()

  def add(self, request: Request) -> None:
    """Queues `request`; a request that can never be served is refused (`Refused`, a
    ValueError naming the request and the reason; recorded in `refused`)."""
    self.submitted.append(request.id)
    reason = self._refusal(request)
    if reason is not None:
      self.refused[request.id] = reason
      self.stats.refusals += 1
      raise Refused(f"request {request.id} refused: {reason}")
    self.waiting.append(Sequence(request, list(request.prompt)))

  def _refusal(self, request: Request) -> str | None:
    c, size = self.config, len(request.prompt) + request.max_new_tokens
    if not request.prompt or request.max_new_tokens < 1:
      return "it needs a prompt and max_new_tokens >= 1"
    if c.vocab_size is not None:
      outside = [t for t in request.prompt if not 0 <= t < c.vocab_size]
      if outside:
        return (f"its prompt holds token ids {sorted(set(outside))[:8]} outside the vocabulary "
                f"[0, {c.vocab_size})")
    if size > c.pages_per_seq * c.page_size or -(-size // c.page_size) > self.allocator.num_pages:
      return (f"it needs {size} tokens; the page table holds {c.pages_per_seq * c.page_size} and "
              f"the pool {self.allocator.num_pages} pages of {c.page_size}: raise --num_pages or "
              "shorten the workload")
    return None

  def cancel(self, request_id: int) -> bool:
    """Ends the request `request_id` wherever it is (waiting, prefilling, decoding or
    preempted): its pages return to the pool at once (a shared page when its last holder lets
    go) and it is never scheduled again; listed in `cancelled`. False for a request that is
    unknown, finished, failed or already cancelled."""
    for seq in list(self.waiting) + self.running:
      if seq.request.id == request_id:
        self._end(seq, self.cancelled)
        self.stats.cancellations += 1
        return True
    return False

  def check(self) -> None:
    """Raises an AssertionError naming the first broken invariant (cheap: O(pages + requests);
    run it after every step)."""
    invariants.check(self)

  @property
  def idle(self) -> bool:
    return not self.waiting and not self.running

  def schedule(self) -> Plan | None:
    """The next step's plan (None when nothing can run): every decoding sequence's token
    first (the step holds them all: step_tokens >= max_seqs), then prompt chunks, oldest
    first."""
    budget, work, copies = self.config.step_tokens, [], []
    decoding = [seq for seq in self.running if self._chunk(seq) == 1]
    for seq in decoding + [seq for seq in self.running if seq not in decoding]:
      if seq not in self.running:  # preempted for an older one
        continue
      q = min(budget, self._chunk(seq))
      if q and self._reserve(seq, q, copies, [s for s, _ in work]):
        work.append((seq, q))
        budget -= q
    self._admit(work, copies, budget)
    verifying = self._add_drafts(work, copies) if self.config.speculate else {}
    return self._plan(work, copies, verifying) if work else None

  def _add_drafts(self, work: list[tuple[Sequence, int]],
                  copies: list[tuple[int, int]]) -> dict[int, Draft]:
    """Decoding sequences' drafts in the step's spare tokens and free pages (after every decode
    and prompt chunk; drafts never preempt): id(seq) -> the draft rows it verifies."""
    budget = self.config.step_tokens - sum(q for _, q in work)
    verifying = {}
    for i, (seq, q) in enumerate(work):
      if q != 1 or seq.computed + 1 != len(seq.tokens) or budget < 1:
        continue  # not a decode, or no spare tokens
      draft = self._draft(seq)
      rows = min(draft.rows, 1 + budget, self._room(seq))
      if rows > 1 and self._reserve(seq, rows, copies, [s for s, _ in work]):
        work[i] = (seq, rows)
        budget -= rows - 1
        verifying[id(seq)] = draft.cut(rows)
    return verifying

  def _room(self, seq: Sequence) -> int:
    """Tokens `seq` can compute next without preempting anyone (drafts never preempt)."""
    ps = self.config.page_size
    written = range(seq.computed // ps, len(seq.pages))
    copies = sum(self.allocator.refs(seq.pages[p]) > 1 for p in written)
    return (len(seq.pages) + self.allocator.num_free - copies) * ps - seq.computed

  def _draft(self, seq: Sequence) -> Draft:
    """A decoding sequence's rows: its last token, and drafts (none without speculation, and
    never past the tokens it still generates)."""
    most = min(self.config.speculate, seq.request.max_new_tokens - len(seq.generated) - 1)
    return propose(seq.lookup, seq.tokens, most, self.config.draft_branches)

  def complete(self, plan: Plan, sampled: np.ndarray,
               finite: np.ndarray | None = None) -> list[Sequence]:
    """Feeds back the step's sampled tokens ([n], read at the sample rows); returns the
    sequences that got a token. `finite` ([n] bool): whether each row's logits were finite; a
    sequence with a non-finite row fails (ended, its pages freed and forgotten). Sequences
    cancelled since the plan was made are skipped."""
    ps, prompt = self.config.page_size, lambda s: len(s.request.prompt)
    live = set(map(id, self.running))
    if finite is not None:
      for s, (seq, _) in enumerate(plan.work):
        if id(seq) in live and not np.all(finite[plan.cu_q_lens[s]:plan.cu_q_lens[s + 1]]):
          self._end(seq, self.failed, forget=True)
          self.stats.failures += 1
          live.discard(id(seq))
    samples = list(plan.samples)
    for s, (seq, q) in enumerate(plan.work):
      if id(seq) not in live:
        continue
      if s in plan.drafts:  # a verified draft tree: its accepted rows are computed, kept
        path = self._accept(seq, plan.drafts[s], sampled[plan.cu_q_lens[s]:plan.cu_q_lens[s + 1]])
        q = len(path)
        samples.append((seq, int(plan.cu_q_lens[s]) + path[-1]))  # the token after the path
      start, seq.computed = seq.computed, seq.computed + q
      self.stats.prefill_tokens += max(0, min(seq.computed, prompt(seq)) - start)
      self.stats.decode_tokens += max(0, seq.computed - max(start, prompt(seq)))
      if self.config.prefix_sharing:
        for p in range(start // ps, seq.computed // ps):
          self.allocator.register(seq.pages[p], self._content(seq, p))
    for seq, row in samples:
      if id(seq) not in live:
        continue
      seq.generated.append(int(sampled[row]))
      seq.tokens.append(int(sampled[row]))
      if seq.done:
        self._free(seq)
        self.running.remove(seq)
        self.finished.append(seq)
    self.stats.steps += 1
    self.stats.pages_allocated = self.allocator.allocated
    return [seq for seq, _ in samples if id(seq) in live]

  def _accept(self, seq: Sequence, draft: Draft, sampled: np.ndarray) -> list[int]:
    """Appends the drafted tokens the step's greedy choices accept (`sampled`: the token after
    each of the draft's rows); returns the rows kept (the path from row 0)."""
    path = accepted(draft, sampled.tolist())
    made = [draft.tokens[r] for r in path[1:]]
    seq.tokens += made
    seq.generated += made
    self.stats.drafted += draft.rows - 1
    self.stats.accepted += len(made)
    return path

  def _chunk(self, seq: Sequence) -> int:
    """Tokens `seq` computes next: 1 when decoding, else up to a prefill chunk."""
    return min(self.config.prefill_chunk, len(seq.tokens) - seq.computed)

  def _reserve(self, seq: Sequence, q: int, copies: list[tuple[int, int]],
               scheduled: list[Sequence]) -> bool:
    """Pages for `seq`'s next `q` tokens (a shared page it writes copied first), preempting
    the newest sequences not `scheduled` this step while the pool is short; False if `seq`
    itself was preempted."""
    ps = self.config.page_size
    written = range(seq.computed // ps, len(seq.pages))  # its pages this step writes into
    shared = [p for p in written if self.allocator.refs(seq.pages[p]) > 1]
    need = -(-(seq.computed + q) // ps) - len(seq.pages) + len(shared)
    while self.allocator.num_free < need:
      victim = next(s for s in reversed(self.running) if s not in scheduled)  # at last seq
      self._preempt(victim)
      if victim is seq:
        return False
    for p in written:
      if p in shared:
        fresh = self.allocator.allocate()
        copies.append((seq.pages[p], fresh))
        self.allocator.release(seq.pages[p])
        seq.pages[p] = fresh
      else:
        self.allocator.unregister(seq.pages[p])  # its content changes under it
    while len(seq.pages) * ps < seq.computed + q:
      seq.pages.append(self.allocator.allocate())
    self.stats.copies += len(shared)
    self.stats.peak_pages = max(self.stats.peak_pages, self.allocator.in_use)
    return True

  def _admit(self, work: list[tuple[Sequence, int]], copies: list[tuple[int, int]],
             budget: int) -> None:
    """Admits waiting sequences in order while the pool, max_seqs and `budget` allow."""
    deferred = []
    while self.waiting and budget and len(self.running) < self.config.max_seqs:
      seq = self.waiting.popleft()
      found = self._cached_pages(seq)
      if self._next_page_pending(seq, len(found)):
        deferred.append(seq)
        continue
      if not self._take_shared(seq, budget, found):
        self.waiting.appendleft(seq)
        break
      seq.admitted = next(self._admissions)
      self.running.append(seq)
      q = min(budget, self._chunk(seq))
      if not self._reserve(seq, q, copies, [s for s, _ in work]):  # _take_shared checked the pool
        raise OutOfPages()
      work.append((seq, q))
      budget -= q
    self.waiting.extendleft(reversed(deferred))

  def _take_shared(self, seq: Sequence, budget: int, found: list[int]) -> bool:
    """Takes the registered pages `found` of `seq`'s first tokens when the pool also holds the
    rest of its first step; False (nothing taken) when it does not."""
    ps = self.config.page_size
    computed = min(len(found) * ps, len(seq.tokens) - 1)  # at least one token computes
    q = min(budget, self.config.prefill_chunk, len(seq.tokens) - computed)
    fresh = -(-(computed + q) // ps) - len(found) + (computed < len(found) * ps)
    reusable = sum(self.allocator.refs(p) == 0 for p in found)  # free now, held once taken
    if self.allocator.num_free - reusable < fresh:
      return False
    seq.pages = [self.allocator.share(self._content(seq, i)) for i in range(len(found))]
    seq.computed = computed
    self.stats.shared_pages += len(found)
    self.stats.skipped_tokens += min(computed, len(seq.request.prompt))
    return True

  def _cached_pages(self, seq: Sequence) -> list[int]:
    """The registered pages holding `seq`'s first full pages (none without prefix sharing)."""
    found: list[int] = []
    ps = self.config.page_size
    while self.config.prefix_sharing and (len(found) + 1) * ps <= len(seq.tokens):
      page = self.allocator.find(self._content(seq, len(found)))
      if page is None:
        break
      found.append(page)
    return found

  def _content(self, seq: Sequence, page: int) -> tuple[int, ...]:
    """What logical page `page` of `seq` holds: its tokens from 0 to the page's end."""
    return tuple(seq.tokens[:(page + 1) * self.config.page_size])

  def _next_page_pending(self, seq: Sequence, n: int) -> bool:
    """Whether page `n` of `seq` (its first not in the prefix cache) is being computed by a
    running sequence (then waiting a step or two shares it instead of computing it again)."""
    end = (n + 1) * self.config.page_size
    if not self.config.prefix_sharing or end > len(seq.tokens):
      return False
    return any(other.computed < end <= len(other.tokens) and other.tokens[:end] == seq.tokens[:end]
               for other in self.running)

  def _preempt(self, seq: Sequence) -> None:
    self._free(seq)
    seq.computed = 0
    self.running.remove(seq)
    self.waiting.appendleft(seq)
    self.stats.preemptions += 1

  def _free(self, seq: Sequence, forget: bool = False) -> None:
    """Lets go of `seq`'s pages; `forget`: its own pages' registrations too (their content is
    not to be shared: a failed sequence's)."""
    for page in seq.pages:
      if forget and self.allocator.refs(page) == 1:
        self.allocator.unregister(page)
      self.allocator.release(page)
    seq.pages = []

  def _end(self, seq: Sequence, into: list[Sequence], forget: bool = False) -> None:
    """`seq` leaves the queue or the running set for `into`, its pages freed."""
    self._free(seq, forget)
    if seq in self.running:
      self.running.remove(seq)
    else:
      self.waiting.remove(seq)
    into.append(seq)

  def _plan(self, work: list[tuple[Sequence, int]], copies: list[tuple[int, int]],
            drafts: dict[int, Draft]) -> Plan:
    c = self.config
    cu = np.zeros(c.max_seqs + 1, np.int32)
    kv_lens = np.zeros(c.max_seqs, np.int32)
    table = np.zeros((c.max_seqs, c.pages_per_seq), np.int32)
    tokens, positions, parents, samples, verifying = [], [], [], [], {}
    self.last_writes = {}
    for s, (seq, q) in enumerate(work):
      for p in range(seq.computed // c.page_size, -(-(seq.computed + q) // c.page_size)):
        self.last_writes[seq.pages[p]] = self.allocator.refs(seq.pages[p])
      cu[s + 1], kv_lens[s] = cu[s] + q, seq.computed
      table[s, :len(seq.pages)] = seq.pages
      if id(seq) in drafts:  # a draft tree (cut to the rows the step holds)
        draft = verifying[s] = drafts[id(seq)]
        tokens += draft.tokens
        positions += [seq.computed + draft.depth(r) for r in range(q)]
        parents += draft.parents
        continue
      tokens += seq.tokens[seq.computed:seq.computed + q]
      positions += range(seq.computed, seq.computed + q)
      parents += range(-1, q - 1)
      if seq.computed + q == len(seq.tokens):
        samples.append((seq, int(cu[s + 1]) - 1))
    cu[len(work) + 1:] = cu[len(work)]
    return Plan(tokens=np.asarray(tokens, np.int32), positions=np.asarray(positions, np.int32),
                cu_q_lens=cu, kv_lens=kv_lens, page_table=table, num_seqs=len(work),
                copies=copies, work=work, samples=samples,
                prefix=self._groups(work) if c.cascade else None,
                tree=np.asarray(parents, np.int32) if verifying else None, drafts=verifying)

  def _groups(self, work: list[tuple[Sequence, int]]) -> tuple[np.ndarray, ...]:
    """The step's cascade: sequences whose first cached pages are the same shared pages (held
    by more than one request, all below what the sequence has computed) form a group, as
    `splash_hk.SharedPrefix`'s arrays (pages [max_seqs, pages_per_seq], lens, group)."""
    c = self.config
    pages = np.zeros((c.max_seqs, c.pages_per_seq), np.int32)
    lens = np.zeros(c.max_seqs, np.int32)
    group = np.full(c.max_seqs, -1, np.int32)
    found: dict[tuple[int, ...], int] = {}
    for s, (seq, _) in enumerate(work):
      n = 0
      while (n < len(seq.pages) and (n + 1) * c.page_size <= seq.computed
             and self.allocator.refs(seq.pages[n]) > 1):
        n += 1
      if n:
        g = found.setdefault(tuple(seq.pages[:n]), len(found))
        pages[g, :n], lens[g], group[s] = seq.pages[:n], n * c.page_size, g
    return pages, lens, group
