"""What must hold between any two steps of the scheduler, checked in O(pages + requests).

`check(scheduler)` raises an AssertionError that names the first broken invariant:
- pages: each page is free or held, never both; its reference count equals the number of
  running requests listing it (so no free page is listed); the registry maps pages and
  contents one to one; each page the last step wrote was held by one request;
- requests: every running request's tokens in the cache fit its pages and its page table;
  a request that is not running holds no page; every submitted request is in exactly one of
  waiting, running, finished, cancelled, failed or refused (none lost, none twice).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from examples.serve.scheduler import Scheduler


def _require(holds: bool, invariant: str) -> None:
  if not holds:
    raise AssertionError(f"scheduler invariant broken: {invariant}")


def check(scheduler: Scheduler) -> None:
  """Raises AssertionError naming the first broken invariant of `scheduler`."""
  _check_requests(scheduler)
  _check_pages(scheduler)


def _check_pages(scheduler: Scheduler) -> None:
  pages = scheduler.allocator
  listed = collections.Counter(p for seq in scheduler.running for p in seq.pages)
  for page in range(pages.num_pages):
    refs, free = pages.refs(page), pages.is_free(page)
    _require(refs >= 0, f"page {page} has a negative reference count {refs}")
    _require(free == (refs == 0), f"page {page} is {'free' if free else 'not free'} with "
             f"{refs} holders (a page is either free or held)")
    _require(refs == listed[page], f"page {page} has reference count {refs} but "
             f"{listed[page]} running requests list it")
  _require(pages.num_free + sum(1 for p in listed) == pages.num_pages,
           "free pages and held pages do not add up to the pool")
  by_page, by_content = pages.registrations()
  _require(len(by_page) == len(by_content) and all(by_content.get(c) == p
                                                   for p, c in by_page.items()),
           "the prefix registry does not map pages and contents one to one")
  for page, holders in scheduler.last_writes.items():
    _require(holders == 1, f"page {page} was written by the last step while {holders} requests "
             "held it (a page being written is held by one request)")


def _check_requests(scheduler: Scheduler) -> None:
  c = scheduler.config
  for seq in scheduler.running:
    rid = seq.request.id
    _require(len(seq.pages) <= c.pages_per_seq, f"request {rid} holds {len(seq.pages)} pages, "
             f"more than its page table's {c.pages_per_seq}")
    _require(seq.computed <= len(seq.pages) * c.page_size, f"request {rid} has {seq.computed} "
             f"tokens in the cache but pages for {len(seq.pages) * c.page_size}")
    _require(seq.computed <= len(seq.tokens) and not seq.done,
             f"request {rid} is running with {seq.computed} tokens computed of {len(seq.tokens)}"
             f" and {len(seq.generated)}/{seq.request.max_new_tokens} generated")
  ended = scheduler.finished + scheduler.cancelled + scheduler.failed
  for seq in list(scheduler.waiting) + ended:
    _require(not seq.pages, f"request {seq.request.id} is not running but holds pages "
             f"{seq.pages}")
  places = collections.Counter(seq.request.id for seq in
                               list(scheduler.waiting) + scheduler.running + ended)
  places.update(list(scheduler.refused))
  submitted = collections.Counter(scheduler.submitted)
  lost = sorted(set(submitted) - set(places))
  _require(not lost, f"requests {lost[:8]} were submitted and are in no list (lost)")
  twice = sorted(r for r, n in places.items() if n != submitted[r])
  _require(not twice, f"requests {twice[:8]} are in {[places[r] for r in twice[:8]]} lists "
           "(each must be in exactly one of waiting, running, finished, cancelled, failed, "
           "refused)")
