"""Speculative decoding's host side: drafts by prompt lookup, laid out as a tree, and the rows a
step's greedy choices accept.

Prompt lookup (no draft model): the longest suffix of a sequence's text (up to `MAX_NGRAM`
tokens) found earlier in it proposes the tokens that followed it there; `branches` distinct
continuations (from other earlier matches) make a tree of candidates. A step verifies the tree
(row 0 is the sequence's last token, not yet computed; every other row a drafted token under
its parent); the model's greedy token after row r is `sampled[r]`, so the accepted rows are the
path from row 0 down the children whose token is the choice after their parent, and the choice
after the path's last row is the step's own token: the output is greedy decoding's exactly.
"""

from __future__ import annotations

import dataclasses

MAX_NGRAM = 3  # the longest suffix looked up
MIN_NGRAM = 2  # the shortest that drafts (measured: a lone token's match accepts 37% of drafts)


@dataclasses.dataclass(frozen=True)
class Draft:
  """A sequence's rows in a verifying step: `tokens[0]` its last token, then drafted tokens,
  each under `parents[r]` (row 0: -1; a parent always earlier)."""

  tokens: tuple[int, ...]
  parents: tuple[int, ...]

  @property
  def rows(self) -> int:
    return len(self.tokens)

  def cut(self, rows: int) -> Draft:
    """Its first `rows` rows (still a tree: parents come first)."""
    return Draft(self.tokens[:rows], self.parents[:rows])

  def depth(self, row: int) -> int:
    d = 0
    while self.parents[row] >= 0:
      row, d = self.parents[row], d + 1
    return d


class Lookup:
  """A growing text's earlier positions of each token (indexed as the text grows)."""

  def __init__(self):
    self.at: dict[int, list[int]] = {}
    self.indexed = 0

  def continuations(self, text: list[int], most: int, branches: int) -> list[list[int]]:
    """Up to `branches` distinct continuations of up to `most` tokens, each what followed an
    earlier occurrence of the text's suffix: longest match first (`MIN_NGRAM` to `MAX_NGRAM`
    tokens), then the latest."""
    if most < 1 or branches < 1 or len(text) < 2:
      return []
    for i in range(self.indexed, len(text) - 1):  # positions with a token after them
      self.at.setdefault(text[i], []).append(i)
    self.indexed = max(self.indexed, len(text) - 1)
    found: list[list[int]] = []
    ranked = sorted(((self._match(text, i), i) for i in self.at.get(text[-1], ())),
                    reverse=True)
    for match, i in ranked:
      if match < MIN_NGRAM:
        break
      follow = text[i + 1:i + 1 + most]
      if not any(f[:len(follow)] == follow for f in found):
        found.append(follow)
        if len(found) == branches:
          break
    return found

  @staticmethod
  def _match(text: list[int], i: int) -> int:
    """How many tokens up to `MAX_NGRAM` end at position i as the text ends."""
    n = 1
    while n < MAX_NGRAM and i - n >= 0 and text[i - n] == text[-1 - n]:
      n += 1
    return n


def tree(last: int, branches: list[list[int]]) -> Draft:
  """The branches as a trie under the sequence's last token (shared prefixes share rows)."""
  tokens, parents = [last], [-1]
  for branch in branches:
    at = 0
    for token in branch:
      child = next((r for r in range(len(tokens)) if parents[r] == at and tokens[r] == token),
                   None)
      if child is None:
        tokens.append(token)
        parents.append(at)
        child = len(tokens) - 1
      at = child
  return Draft(tuple(tokens), tuple(parents))


def propose(lookup: Lookup, text: list[int], most: int, branches: int) -> Draft:
  """The verifying rows of a sequence whose text is `text` (its last token not yet computed):
  at most `most` drafted tokens on a path, `branches` candidates (`lookup`: the text's)."""
  return tree(text[-1], lookup.continuations(text, most, branches))


def accepted(draft: Draft, sampled: list[int]) -> list[int]:
  """The rows kept (root to leaf, starting at row 0) given the greedy token after each row."""
  path = [0]
  while True:
    choice = sampled[path[-1]]
    child = next((r for r in range(draft.rows)
                  if draft.parents[r] == path[-1] and draft.tokens[r] == choice), None)
    if child is None:
      return path
    path.append(child)
