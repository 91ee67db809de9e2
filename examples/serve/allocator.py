"""Pages of the pool: a free list, reference counts, and full prompt pages kept by content.

A page is either held (reference count > 0: one or more sequences list it) or free. A full
page whose tokens are known is registered under its content (every token of the sequence up
to the page's end: its keys and values depend on nothing else in a causal model). A sequence
that starts with the same tokens takes the registered page instead of computing it, and a
freed registered page stays findable until the free list hands it out again (oldest freed
first), as vLLM's prefix cache keeps it.
"""

from __future__ import annotations

import collections

Content = tuple[int, ...]  # a sequence's tokens from 0 to the end of one of its pages


class OutOfPages(Exception):
  """The free list is empty."""


class PageAllocator:
  """Physical pages 0..num_pages-1 of a `PagedKVCache` pool."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
        range(num_pages))  # oldest freed first
    self._refs = [0] * num_pages
    self._content: dict[int, Content] = {}  # registered page -> its content
    self._page: dict[Content, int] = {}  # content -> registered page
    self.allocated = 0  # pages handed out fresh from the free list, over the whole run

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def in_use(self) -> int:
    return self.num_pages - len(self._free)

  def refs(self, page: int) -> int:
    return self._refs[page]

  def is_free(self, page: int) -> bool:
    return page in self._free

  def registrations(self) -> tuple[dict[int, Content], dict[Content, int]]:
    """(page -> content, content -> page) of the registered pages (for checks)."""
    return self._content, self._page

  def allocate(self) -> int:
    """A page of its own for one sequence (its registered content, if any, forgotten)."""
    if not self._free:
      raise OutOfPages()
    page, _ = self._free.popitem(last=False)
    self._forget(page)
    self._refs[page] = 1
    self.allocated += 1
    return page

  def find(self, content: Content) -> int | None:
    """The registered page holding `content`, or None (nothing changes)."""
    return self._page.get(content)

  def share(self, content: Content) -> int:
    """The registered page holding `content`, now also held by the caller."""
    page = self._page[content]
    if self._refs[page] == 0:
      del self._free[page]
    self._refs[page] += 1
    return page

  def release(self, page: int) -> None:
    """One holder lets go; the last one returns the page to the free list."""
    if self._refs[page] <= 0:
      raise ValueError(f"page {page} released but not held.")
    self._refs[page] -= 1
    if self._refs[page] == 0:
      self._free[page] = None

  def register(self, page: int, content: Content) -> None:
    """Marks a held full page as holding `content` (a later equal prefix shares it)."""
    if content in self._page or page in self._content:
      return  # the same content computed twice (the other copy stays registered)
    self._content[page] = content
    self._page[content] = page

  def registered(self, page: int) -> bool:
    return page in self._content

  def unregister(self, page: int) -> None:
    """Before a holder writes into the page: its content is no longer what was registered."""
    self._forget(page)

  def _forget(self, page: int) -> None:
    content = self._content.pop(page, None)
    if content is not None:
      del self._page[content]
