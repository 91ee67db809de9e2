"""Who sees whom: the mask objects users write, and `block_map` to see their block plan.

Key j is visible to query i when all of these hold::

  the position rule:  the config's (causal, sliding window, chunk; with a dense
                      `mask` array ANDed in), or one mask object given as `mask`
                      (`Causal()`, `SlidingWindow(w)`, `Chunked(c)`,
                      `Bidirectional(ids)`, `MaskFn(fn)`, `Dense(mask)`,
                      `Blocks(kv_blocks, counts)`: key blocks chosen by data,
                      `Tree(parents)`: draft trees over a call's tokens, `&`, `|`)
  segments:           q_seg[i] == kv_seg[j], and both >= 0 (negative = padding)

The modules beside this one (`_objects`, `_blocks`, `_rules`, `_plan`) are the
library's own: per-pair and per-block rules, positions and the block plan.
"""

from splash_hk.masks._chosen import Blocks
from splash_hk.masks._objects import And
from splash_hk.masks._objects import Bidirectional
from splash_hk.masks._objects import Causal
from splash_hk.masks._objects import Chunked
from splash_hk.masks._objects import Dense
from splash_hk.masks._objects import Mask
from splash_hk.masks._objects import MaskFn
from splash_hk.masks._objects import Or
from splash_hk.masks._objects import SlidingWindow
from splash_hk.masks._plan import block_map
from splash_hk.masks._tree import Tree

__all__ = ("And", "Bidirectional", "Blocks", "Causal", "Chunked", "Dense", "Mask", "MaskFn", "Or",
           "SlidingWindow", "Tree", "block_map")
