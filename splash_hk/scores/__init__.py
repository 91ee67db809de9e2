"""Scores you can write: additive biases on the scaled logits, as objects that add with `+`.

`l = scale * q.k + bias[b, h, i, j]`, then the soft cap, then masking. A dense
float array passed as `bias` is `Dense(bias)`. Position objects (`Alibi`,
`RelativePosition`, `ScoreFn`) are computed per block from positions, never as a
[T, S] array; gradients reach every array leaf. The modules beside this one
(`_score`, `_objects`) are the library's own.
"""

from splash_hk.scores._objects import Alibi
from splash_hk.scores._objects import Dense
from splash_hk.scores._objects import RelativePosition
from splash_hk.scores._objects import ScoreFn
from splash_hk.scores._objects import alibi_slopes
from splash_hk.scores._objects import t5_buckets
from splash_hk.scores._score import Score
from splash_hk.scores._score import Sum

__all__ = ("Alibi", "Dense", "RelativePosition", "Score", "ScoreFn", "Sum", "alibi_slopes",
           "t5_buckets")
