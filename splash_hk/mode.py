"""Which kind of call this is, from the sequence lengths alone."""

from splash_hk.types import Mode


def detect_mode(query_len: int, kv_len: int) -> Mode:
  """DECODE for one query token, PREFILL for fewer queries than keys, else TRAIN.

  Args:
    query_len: T, the length of the query sequence axis (never the head axis).
    kv_len: S, the length of the key/value sequence axis.
  """
  if query_len < 1 or kv_len < 1:
    raise ValueError(
        f"detect_mode needs query_len >= 1 and kv_len >= 1, got query_len={query_len}, "
        f"kv_len={kv_len}.")
  return Mode.of(query_len, kv_len)
