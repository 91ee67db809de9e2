"""Training checkpoints: exact round trip, atomic writes, and files that are refused unread."""

import os
import pickle
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.train import checkpoint
import processes


def _state(seed=0):
  rng = np.random.default_rng(seed)
  params = {"layer": {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
                      "b": jnp.zeros((4,), jnp.float32)}}
  opt = optax.adamw(1e-3)
  opt_state = opt.init(params)
  opt_state = opt.update(params, opt_state, params)[1]  # count == 1, moments non-zero
  return params, opt_state


def test_round_trip_restores_every_leaf_into_the_model_tree(tmp_path):
  params, opt_state = _state(0)
  file = str(tmp_path / "ckpt" / "checkpoint.npz")
  checkpoint.save(file, 17, params, opt_state)
  assert os.listdir(tmp_path / "ckpt") == ["checkpoint.npz"]  # no temporary file left
  fresh_params, fresh_opt = _state(1)
  got_params, got_opt, step = checkpoint.restore(file, fresh_params, fresh_opt)
  assert step == 17
  got, want = jax.tree.leaves((got_params, got_opt)), jax.tree.leaves((params, opt_state))
  assert jax.tree.structure((got_params, got_opt)) == jax.tree.structure((params, opt_state))
  for g, w in zip(got, want):
    assert np.asarray(g).dtype == np.asarray(w).dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_no_checkpoint_yet_gives_step_zero(tmp_path):
  params, opt_state = _state()
  assert checkpoint.restore(str(tmp_path / "none.npz"), params, opt_state)[2] == 0
  assert checkpoint.restore(None, params, opt_state)[2] == 0


class _Payload:
  """Unpickling this creates a file: the proof that a pickle would have run code."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (open, (self.marker, "w"))


def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path):
  marker = tmp_path / "pwned"
  file = tmp_path / "checkpoint.npz"
  file.write_bytes(pickle.dumps({"step": 1, "params": _Payload(str(marker))}))
  params, opt_state = _state()
  with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(file))):
    checkpoint.restore(str(file), params, opt_state)
  assert not marker.exists()


def test_a_truncated_checkpoint_gets_an_error_naming_the_file(tmp_path):
  params, opt_state = _state()
  file = tmp_path / "checkpoint.npz"
  checkpoint.save(str(file), 3, params, opt_state)
  data = file.read_bytes()
  file.write_bytes(data[: len(data) // 2])
  with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(file))):
    checkpoint.restore(str(file), params, opt_state)


def test_another_models_checkpoint_is_refused(tmp_path):
  params, opt_state = _state()
  file = str(tmp_path / "checkpoint.npz")
  checkpoint.save(file, 3, params, opt_state)
  bigger = {"layer": {"w": jnp.zeros((3, 5)), "b": jnp.zeros((5,))}}
  with pytest.raises(checkpoint.CheckpointError, match=r"leaf .* is float32\[4\], this model has float32\[5\]"):
    checkpoint.restore(file, bigger, optax.adamw(1e-3).init(bigger))
  np.save(tmp_path / "plain.npy", np.zeros(3))
  os.replace(tmp_path / "plain.npy", tmp_path / "plain.npz")
  with pytest.raises(checkpoint.CheckpointError, match="not a splash_hk checkpoint"):
    checkpoint.restore(str(tmp_path / "plain.npz"), params, opt_state)


def test_a_failed_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
  params, opt_state = _state()
  file = str(tmp_path / "checkpoint.npz")
  checkpoint.save(file, 5, params, opt_state)

  def crash(path, **_):
    with open(path, "wb") as f:
      f.write(b"half")
    raise OSError("disk full")

  monkeypatch.setattr(np, "savez", crash)
  with pytest.raises(OSError):
    checkpoint.save(file, 6, params, opt_state)
  assert checkpoint.restore(file, params, opt_state)[2] == 5


def test_the_training_binary_refuses_a_crafted_checkpoint(tmp_path):
  marker = tmp_path / "pwned"
  (tmp_path / "checkpoint.npz").write_bytes(pickle.dumps(_Payload(str(marker))))
  env = processes.env()
  proc = subprocess.run([sys.executable, "-m", "examples.train", "--steps=2",
                         f"--checkpoint_dir={tmp_path}"], capture_output=True, text=True, env=env,
                        timeout=120)
  assert proc.returncode != 0 and not marker.exists()
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: checkpoint") and str(tmp_path / "checkpoint.npz") in last
