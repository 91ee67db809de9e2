"""Training checkpoints that cannot run code when loaded.

A checkpoint is one `.npz` file: every leaf of {"params", "opt_state"} as a
plain array, and a JSON manifest (format, step, each leaf's tree path, shape
and dtype) stored as a string array. It is read with `allow_pickle=False` and
restored into the tree of a freshly initialised model, so loading needs no
pickled structure: a file that is not such an archive (a crafted pickle, a
truncated write, another model's checkpoint) is refused with an error naming
it, and nothing in it is executed. Process 0 writes to a temporary file and
renames it, so a killed run leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Any

from absl import logging
import jax
import numpy as np

from examples.train import paths

FORMAT = "splash_hk.checkpoint/1"
_MANIFEST = "__manifest__"


class CheckpointError(ValueError):
  """A checkpoint file that cannot be restored (the message names the file and why)."""


def path(checkpoint_dir: str | None) -> str | None:
  """The checkpoint file in --checkpoint_dir (resolved where the user typed the command)."""
  if not checkpoint_dir:
    return None
  return os.path.join(paths.user_path(checkpoint_dir), "checkpoint.npz")


def _leaves(tree) -> list[tuple[str, Any]]:
  return [(jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def save(file: str, step: int, params, opt_state) -> None:
  """Writes host trees as `file` (process 0 only), atomically."""
  if jax.process_index():
    return
  leaves = [(name, np.asarray(leaf)) for name, leaf in _leaves({"params": params,
                                                                 "opt_state": opt_state})]
  manifest = {"format": FORMAT, "step": int(step),
              "leaves": [{"path": n, "shape": list(a.shape), "dtype": str(a.dtype)} for n, a in leaves]}
  arrays = {f"leaf_{i:05d}": a for i, (_, a) in enumerate(leaves)}
  os.makedirs(os.path.dirname(file), exist_ok=True)
  tmp = f"{file}.tmp{os.getpid()}.npz"
  np.savez(tmp, **{_MANIFEST: np.array(json.dumps(manifest))}, **arrays)
  os.replace(tmp, file)


def restore(file: str | None, params, opt_state) -> tuple[Any, Any, int]:
  """(params, opt_state, step) from `file` into the trees of `params` and `opt_state`.

  Returns the given trees at step 0 when there is no checkpoint yet.

  Raises:
    CheckpointError: naming `file`, when it is not a checkpoint of this model.
  """
  if not file or not os.path.exists(file):
    return params, opt_state, 0
  template = {"params": params, "opt_state": opt_state}
  manifest, arrays = _read(file)
  expected = _leaves(template)
  names = [leaf["path"] for leaf in manifest["leaves"]]
  if names != [name for name, _ in expected]:
    missing = sorted(set(name for name, _ in expected) - set(names))[:3]
    raise CheckpointError(f"checkpoint {file} holds another model's state (leaves differ, e.g. "
                          f"{missing or sorted(set(names))[:3]}); use a new --checkpoint_dir.")
  restored = []
  for i, ((name, like), leaf) in enumerate(zip(expected, manifest["leaves"])):
    array = arrays[i]
    if list(array.shape) != list(np.shape(like)) or leaf["dtype"] != str(np.asarray(like).dtype):
      raise CheckpointError(f"checkpoint {file}: leaf {name} is {leaf['dtype']}{leaf['shape']}, "
                            f"this model has {np.asarray(like).dtype}{list(np.shape(like))}.")
    restored.append(array.view(np.asarray(like).dtype))
  tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), restored)
  logging.info("resumed from %s at step %d", file, manifest["step"])
  return tree["params"], tree["opt_state"], manifest["step"]


def _read(file: str) -> tuple[dict, list[np.ndarray]]:
  """The manifest and the leaf arrays of `file`, never unpickling anything."""
  try:
    archive = np.load(file, allow_pickle=False)
    if not isinstance(archive, np.lib.npyio.NpzFile) or _MANIFEST not in archive.files:
      raise CheckpointError(f"checkpoint {file} is not a splash_hk checkpoint (no manifest).")
    with archive:
      manifest = json.loads(str(archive[_MANIFEST]))
      if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {file} has format {manifest.get('format')!r}, "
                              f"want {FORMAT!r}.")
      arrays = [archive[f"leaf_{i:05d}"] for i in range(len(manifest["leaves"]))]
  except CheckpointError:
    raise
  except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, json.JSONDecodeError) as e:
    raise CheckpointError(f"checkpoint {file} is unreadable or not a splash_hk checkpoint "
                          f"({type(e).__name__}: {e}); it was not loaded.") from e
  return manifest, arrays
