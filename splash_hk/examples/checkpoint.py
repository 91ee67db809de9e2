"""Training checkpoints: (step, params, optimizer state), written atomically by process 0."""

from __future__ import annotations

import os
import pickle
from typing import Any

from absl import logging
import jax

from splash_hk.examples import paths


def path(checkpoint_dir: str | None) -> str | None:
  """The checkpoint file in --checkpoint_dir (resolved where the user typed the command)."""
  if not checkpoint_dir:
    return None
  return os.path.join(paths.user_path(checkpoint_dir), "checkpoint.pkl")


def restore(file: str | None, params, opt_state) -> tuple[Any, Any, int]:
  """(params, opt_state, step) from the checkpoint `file`, or the given ones at step 0."""
  if not file or not os.path.exists(file):
    return params, opt_state, 0
  with open(file, "rb") as f:
    state = pickle.load(f)
  logging.info("resumed from %s at step %d", file, state["step"])
  return state["params"], state["opt_state"], state["step"]


def save(file: str, step: int, params, opt_state) -> None:
  """Process 0 writes host trees atomically (a killed run leaves the previous checkpoint whole)."""
  if jax.process_index():
    return
  os.makedirs(os.path.dirname(file), exist_ok=True)
  tmp = file + f".tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    pickle.dump({"step": step, "params": params, "opt_state": opt_state}, f)
  os.replace(tmp, file)
